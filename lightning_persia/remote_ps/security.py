"""Who may talk to a shard: the bind check, the token interceptor and the TLS identity.

- :func:`check_bind_security` refuses a non-loopback address without a token, TLS or an explicit ``insecure``.
- :class:`TokenInterceptor` refuses every call without ``authorization: Bearer <token>`` (the health service
  stays open).
- :class:`TLSFiles` reads a shard's PEM files into gRPC server credentials.
"""
from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Optional

import grpc

from lightning_persia.remote_ps.protocol import AUTH_METADATA_KEY, BEARER_PREFIX

_HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"


class BindSecurityError(ValueError):
    """A non-loopback bind address without a token, TLS or an explicit ``insecure``."""


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


def check_bind_security(host: str, *, token: Optional[str], tls: bool, insecure: bool) -> None:
    """Raises :class:`BindSecurityError` unless ``host`` is loopback or the shard is protected (or ``insecure``)."""
    if is_loopback_host(host) or token or tls or insecure:
        return
    raise BindSecurityError(
        f"refusing to serve on non-loopback address {host!r} without protection: anyone who can reach it could "
        "read and overwrite the embedding tables. Pass --token T (clients send 'authorization: Bearer T'), "
        "--tls-cert/--tls-key (and optionally --tls-client-ca), or --insecure to accept the risk"
    )


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <token>`` metadata with UNAUTHENTICATED.

    The health service stays open, so that load balancers and orchestrators can probe the shard; it tells
    nothing but "serving".
    """

    def __init__(self, token: str) -> None:
        self._expected = f"{BEARER_PREFIX}{token}".encode()

        def refuse(message: str):
            def handler(request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

            return grpc.unary_unary_rpc_method_handler(handler)

        self._missing = refuse(f"missing '{AUTH_METADATA_KEY}: {BEARER_PREFIX}<token>' metadata; this shard requires a token")
        self._wrong = refuse("wrong token")

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(_HEALTH_METHOD_PREFIX):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                return continuation(handler_call_details) if hmac.compare_digest(given, self._expected) else self._wrong
        return self._missing


@dataclass
class TLSFiles:
    """PEM files of a shard's TLS identity; ``client_ca`` makes the shard require client certificates."""

    cert: str
    key: str
    client_ca: Optional[str] = None

    def credentials(self) -> grpc.ServerCredentials:
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        ca = read(self.client_ca) if self.client_ca else None
        return grpc.ssl_server_credentials([(read(self.key), read(self.cert))], root_certificates=ca, require_client_auth=ca is not None)
