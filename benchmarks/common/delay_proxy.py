"""A TCP forwarder that holds every chunk for a fixed time in each direction: one-way network latency.

Used by ``train_bench.py --netem`` where the kernel has no ``netem`` qdisc (``CONFIG_NET_SCH_NETEM`` unset):
the bandwidth limit is then a ``tbf`` qdisc on the veth pair and the delay comes from this process, run in
the shards' namespace in front of each shard. Bytes are forwarded unchanged (gRPC over HTTP/2) and in order;
each chunk leaves ``delay_ms`` after it arrived (asyncio timers: about 0.1-1 ms of extra jitter).

    python delay_proxy.py --delay-ms 1 LISTEN_HOST:PORT=TARGET_HOST:PORT [...]

A listen port of 0 picks a free one. Prints ``DELAY_PROXY_READY <port>,<port>,...`` (the listening ports, in
order) once every listener is up; exits on SIGTERM or when its parent dies.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

READY = "DELAY_PROXY_READY"


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def read() -> None:
        try:
            while True:
                data = await reader.read(1 << 20)
                queue.put_nowait((time.monotonic() + delay_s, data))
                if not data:
                    return
        except (ConnectionError, OSError):
            queue.put_nowait((0.0, b""))

    async def write() -> None:
        try:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            return

    await asyncio.gather(read(), write())


async def _serve(listen: str, target: str, delay_s: float) -> asyncio.AbstractServer:
    listen_host, listen_port = listen.rsplit(":", 1)
    target_host, target_port = target.rsplit(":", 1)

    async def handle(client_reader, client_writer) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(target_host, int(target_port))
        except OSError:
            client_writer.transport.abort()
            return
        try:
            await asyncio.gather(_pump(client_reader, server_writer, delay_s), _pump(server_reader, client_writer, delay_s))
        finally:
            for writer in (client_writer, server_writer):
                writer.transport.abort()

    return await asyncio.start_server(handle, listen_host, int(listen_port))


async def _main(args: argparse.Namespace) -> None:
    servers = []
    for mapping in args.mappings:
        listen, _, target = mapping.partition("=")
        servers.append(await _serve(listen, target, args.delay_ms / 1000.0))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    ports = [str(server.sockets[0].getsockname()[1]) for server in servers]
    print(READY, ",".join(ports), flush=True)
    parent = os.getppid()
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            if os.getppid() != parent:  # the benchmark is gone
                break
    for server in servers:
        server.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("mappings", nargs="+", metavar="LISTEN=TARGET")
    asyncio.run(_main(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
