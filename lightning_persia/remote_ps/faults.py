"""Faults a shard injects on request, for tests and fault benchmarks (``fault_delay_s`` and ``fault_ack_delay_s``
of the PS config).

:class:`DelayInterceptor` slows every Lookup and Update (or, ``after`` the handler, holds an Update's answer once it
is applied and logged); :class:`~lightning_persia.remote_ps.server.ShardServer` installs it only when a delay is
configured, so a shard without faults checks nothing per call.
"""
from __future__ import annotations

import time
from typing import Collection

import grpc

from lightning_persia.remote_ps.protocol import SERVICE_NAME

DELAYED_METHODS = frozenset({"Lookup", "Update"})


class DelayInterceptor(grpc.ServerInterceptor):
    """Sleeps ``delay_s`` on the handler thread before each call of ``methods`` of the PS service (``after``: once the
    handler returned, before the answer goes out)."""

    def __init__(self, delay_s: float, methods: Collection[str] = DELAYED_METHODS, after: bool = False) -> None:
        if delay_s <= 0:
            raise ValueError(f"a fault delay must be > 0 s, got {delay_s}")
        self._delay_s = delay_s
        self._after = after
        self._paths = frozenset(f"/{SERVICE_NAME}/{method}" for method in methods)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._paths:
            return handler
        behaviour, delay_s, after = handler.unary_unary, self._delay_s, self._after

        def delayed(request, context):
            if not after:
                time.sleep(delay_s)
            response = behaviour(request, context)
            if after:
                time.sleep(delay_s)
            return response

        return grpc.unary_unary_rpc_method_handler(
            delayed, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer,
        )
