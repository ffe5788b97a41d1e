"""The channels of a client to every shard, on one background thread running a ``grpc.aio`` event loop.

:class:`ShardConnection` is the base of :class:`~lightning_persia.remote_ps.client.PSClient`: it opens the
channels (TLS, token, message limits), runs coroutines on its loop for the caller's thread, and makes one
call to one shard, or the same call to every shard, under the client's :class:`RetryPolicy` with the
shard's incarnation as fencing (``retry.py``).
"""
from __future__ import annotations

import asyncio
import atexit
import os
import threading
from concurrent.futures import Future
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Union

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2_grpc

from lightning_persia.remote_ps.client.errors import PSError
from lightning_persia.remote_ps.client.retry import RetryPolicy, call_with_retry
from lightning_persia.remote_ps.protocol import bearer_metadata, persia_pb2_grpc

PathOrPEM = Union[str, os.PathLike, bytes]


def _read_pem(value: Optional[PathOrPEM]) -> Optional[bytes]:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


class ShardConnection:
    """Channels to ``addresses`` (``addresses[i]`` is shard ``i``) and the event loop that drives them."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        retry: RetryPolicy,
        token: Optional[str] = None,
        tls_root_cert: Optional[PathOrPEM] = None,
        tls_client_cert: Optional[PathOrPEM] = None,
        tls_client_key: Optional[PathOrPEM] = None,
        tls_server_name: Optional[str] = None,
        max_message_mb: int = 512,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        if not addresses:
            raise ValueError("PSClient needs the address of at least one shard")
        self.addresses = list(addresses)
        self.num_shards = len(self.addresses)
        self.retry = retry
        self._max_message_bytes = max_message_mb << 20
        self._metadata = bearer_metadata(token)
        # Incarnation of each shard as last seen (wait_healthy / refresh_incarnations); once known, lookups,
        # updates and saves carry it, and a restarted shard refuses them with ShardRestartedError.
        self.incarnations: List[Optional[str]] = [None] * len(self.addresses)
        self._dims: Dict[str, int] = {}  # dim of every table met so far

        options = [
            ("grpc.max_send_message_length", self._max_message_bytes),
            ("grpc.max_receive_message_length", self._max_message_bytes),
            ("grpc.enable_retries", 0),  # retries are ours, with the same sequence number
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        credentials = None
        if tls_root_cert is not None or tls_client_cert is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(tls_root_cert),
                private_key=_read_pem(tls_client_key),
                certificate_chain=_read_pem(tls_client_cert),
            )

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="persia-ps-client", daemon=True)
        self._thread.start()
        self._closed = False

        async def connect() -> None:
            chained = list(interceptors) or None
            make = (lambda a: grpc.aio.secure_channel(a, credentials, options, interceptors=chained)) if credentials else (
                lambda a: grpc.aio.insecure_channel(a, options, interceptors=chained))
            self._open_channel = make
            self._channel_addresses = list(self.addresses)
            self._retired: list = []  # channels to shards that left the map
            self._channels = [make(address) for address in self.addresses]
            self._stubs = [persia_pb2_grpc.ParameterServerStub(c) for c in self._channels]
            self._health = [health_pb2_grpc.HealthStub(c) for c in self._channels]

        self._submit(connect()).result()
        # A client left open is closed before the interpreter finalizes: its thread decodes rows with torch ops,
        # which release the GIL, and a daemon thread that takes the GIL back once finalization has begun is
        # ended by pthread_exit, whose unwinding through torch's C++ frames aborts the process (``terminate
        # called without an active exception``). atexit runs while every thread may still finish its call.
        atexit.register(self.close)

    def close(self) -> None:
        """Cancels calls still in flight (their futures raise ``CancelledError``), closes the channels and
        stops the client's thread; the client cannot be used afterwards. Runs at interpreter exit if not called
        before."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)

        async def disconnect() -> None:
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await asyncio.gather(*(channel.close() for channel in self._channels + self._retired))

        try:
            asyncio.run_coroutine_threadsafe(disconnect(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _reach(self, addresses: Sequence[str]) -> None:
        """Talks to the shards of ``addresses`` from now on (a shard map's, once shards were added or drained): opens
        channels to the addresses it has none to. A channel it stops using stays open until :meth:`close`, for the
        calls in flight on it. Runs on the client's event loop."""
        known = list(self.addresses[: len(addresses)])
        if known != list(addresses[: len(known)]):
            raise PSError(f"the shard map's addresses {list(addresses)} do not extend the ones this client knows "
                          f"{self.addresses}: shards keep their positions when shards are added or drained")
        for shard, address in enumerate(addresses):
            if shard < len(self._channel_addresses) and self._channel_addresses[shard] == address:
                continue
            channel = self._open_channel(address)
            if shard < len(self._channels):
                self._retired.append(self._channels[shard])
                self._channels[shard], self._channel_addresses[shard] = channel, address
                self._stubs[shard], self._health[shard] = persia_pb2_grpc.ParameterServerStub(channel), health_pb2_grpc.HealthStub(channel)
            else:
                self._channels.append(channel)
                self._channel_addresses.append(address)
                self._stubs.append(persia_pb2_grpc.ParameterServerStub(channel))
                self._health.append(health_pb2_grpc.HealthStub(channel))
        self.incarnations = (self.incarnations + [None] * len(addresses))[: len(addresses)]
        self.addresses = list(addresses)
        self.num_shards = len(addresses)

    # ---- running calls -------------------------------------------------------------------------------

    def _submit(self, coroutine: Awaitable) -> Future:
        if self._closed:
            coroutine.close()  # type: ignore[attr-defined]
            raise PSError("this PSClient is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)  # type: ignore[arg-type]

    def _wait(self, coroutine: Awaitable) -> Any:
        return self._submit(coroutine).result()

    def _all(self, method: str, request, timeout_s: float) -> list:
        """The same call to every shard; blocks until all have answered."""
        return self._wait(self._gather(self._call(shard, method, request, timeout_s) for shard in range(self.num_shards)))

    @staticmethod
    async def _gather(coroutines) -> list:
        """Waits for every call (none is abandoned half-way), then raises the first error in shard order."""
        results = await asyncio.gather(*coroutines, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _call(self, shard: int, method: str, request, timeout_s: float,
                    before_retry: Optional[Callable[[], Awaitable[None]]] = None):
        """One RPC to one shard, with its deadline, retries (``before_retry``: see ``call_with_retry``) and fencing."""
        return await call_with_retry(
            getattr(self._stubs[shard], method), request, method=method, shard=shard, address=self._channel_addresses[shard],
            timeout_s=timeout_s, metadata=self._metadata, policy=self.retry, before_retry=before_retry,
            incarnation=lambda: self.incarnations[shard] if shard < len(self.incarnations) else None,
        )
