"""Calls from one shard to the other shards of its cluster: a move's pages to its takers (``handover_delivery.py``),
and the settling of a move whose coordinator is gone (``move_settling.py``)."""
from __future__ import annotations

from typing import Optional

import grpc

from lightning_persia.remote_ps.protocol import bearer_metadata, persia_pb2_grpc
from lightning_persia.remote_ps.security import TLSFiles


class Peers:
    """Channels to the other shards, with the cluster's ``token`` and, where the shards serve TLS, this shard's own
    TLS files: a cluster whose shards check client certificates shares their CA, so this shard's identity passes.
    ``max_message_bytes``: the largest message a channel sends or receives (the shards' ``max_message_mb``)."""

    def __init__(self, token: Optional[str] = None, tls: Optional[TLSFiles] = None, *,
                 max_message_bytes: int = 512 << 20) -> None:
        self.metadata = bearer_metadata(token)
        self._tls = tls
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.enable_retries", 0),  # a call that fails is the caller's to retry (or to give the move up)
            # a peer restarted during a move is reached again within 2 s of its return, as the clients reach it
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]

    def channel(self, address: str) -> grpc.Channel:
        """A new channel to the shard at ``address`` (the caller closes it)."""
        if self._tls is None:
            return grpc.insecure_channel(address, self._options)

        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(
            root_certificates=read(self._tls.client_ca) if self._tls.client_ca else None,
            private_key=read(self._tls.key), certificate_chain=read(self._tls.cert)), self._options)

    def call(self, address: str, method: str, request, timeout_s: float):
        """One call of ``method`` on the shard at ``address``, over a channel of its own."""
        with self.channel(address) as channel:
            stub = persia_pb2_grpc.ParameterServerStub(channel)
            return getattr(stub, method)(request, timeout=timeout_s, metadata=self.metadata)
