"""A TCP proxy on loopback that adds latency and severs connections, between PS clients and a shard.

It forwards raw bytes (gRPC over HTTP/2, TLS or not) and never parses them, so what a client sees is exactly
what a flaky network does: a connection reset in the middle of a request or of its answer.

Example::

    with ChaosProxy("127.0.0.1:5000", drop_probability=0.02, seed=1) as proxy:
        client = PSClient([proxy.address])       # every chunk forwarded has a 2% chance to kill the connection
        proxy.delay_s = 0.5                      # from now on each chunk waits 0.5 s (a slow link)
        proxy.kill_all()                         # sever every open connection now
"""
from __future__ import annotations

import asyncio
import random
import threading
from typing import Optional


class ChaosProxy:
    """Listens on ``127.0.0.1:<free port>`` and forwards every connection to ``target`` (``host:port``).

    Args:
        target: the shard's address.
        delay_s: latency added to every forwarded chunk, each direction (can be changed at any time).
        drop_probability: chance, per forwarded chunk, that the connection is reset (both sides) instead.
        seed: seed of the drop decisions.
    """

    def __init__(self, target: str, *, delay_s: float = 0.0, drop_probability: float = 0.0, seed: Optional[int] = None) -> None:
        host, port = target.rsplit(":", 1)
        self.target_host, self.target_port = host.strip("[]"), int(port)
        self.delay_s = delay_s
        self.drop_probability = drop_probability
        self.connections = 0
        self.dropped = 0
        self.forwarded_bytes = 0
        self._random = random.Random(seed)
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-proxy", daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop).result(10)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            server_reader, server_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            client_writer.transport.abort()
            return
        pair = (client_writer, server_writer)
        self._writers.update(pair)

        def reset() -> None:
            for writer in pair:
                writer.transport.abort()  # RST, not a clean close: what a dying link looks like

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    data = await reader.read(1 << 16)
                    if not data:
                        break
                    if self.drop_probability and self._random.random() < self.drop_probability:
                        self.dropped += 1
                        reset()
                        return
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    writer.write(data)
                    self.forwarded_bytes += len(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                reset()

        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))
        self._writers.difference_update(pair)

    def kill_all(self) -> int:
        """Resets every open connection now; returns how many sockets were cut."""

        def cut() -> int:
            writers = list(self._writers)
            for writer in writers:
                writer.transport.abort()
            self.dropped += len(writers) // 2
            return len(writers)

        return self._call(cut)

    def _call(self, fn):
        future: "asyncio.Future" = asyncio.run_coroutine_threadsafe(self._async(fn), self._loop)
        return future.result(5)

    @staticmethod
    async def _async(fn):
        return fn()

    def close(self) -> None:
        if self._loop.is_closed():
            return

        async def shutdown() -> None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            await self._server.wait_closed()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> "ChaosProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
