"""Parameter-server micro-benchmark: lookup and update throughput through gRPC, and shard memory per row.

Starts real shard processes (``lightning-persia ps serve --port 0``) on loopback, drives them with one
PSClient keeping ``--inflight`` requests in flight, and prints a table. The baseline of each figure is the
same work done by a ShardStore inside this process (no RPC), measured in the same run: the ratio is what
the wire and the server cost.

    .venv/bin/python -m benchmarks.ps.ps_bench                      # 1 and 2 shards, 10M-row memory figure
    .venv/bin/python -m benchmarks.ps.ps_bench --json               # ... and one JSON object on the last line
    .venv/bin/python -m benchmarks.ps.ps_bench --memory-rows 0 --seconds 2   # quick run, no memory figure

Setup of every figure: requests of ``--ids`` (65,536) unique ids, dim ``--dim`` (16), rows and gradients in
fp16 on the wire, row-wise Adagrad. ``bytes_per_row`` is the growth of the shard's resident memory (VmRSS of
/proc/<pid>/status) per stored row after ``--memory-rows`` (10M) rows were admitted and updated once, over
the RSS of the idle shard with the table configured.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

TABLE = "bench"


def table_config(dim: int) -> TableConfig:
    return TableConfig(TABLE, dim, optimizer=Adagrad(lr=0.01, rowwise=True), capacity=1 << 30)


def make_batches(pool: int, ids: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randperm(pool, generator=generator)[:ids] for _ in range(count)]


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def pipelined(submit, batches, seconds: float, inflight: int, repeats: int) -> tuple[float, float]:
    """Best of ``repeats`` runs: rows per second with ``inflight`` requests outstanding; median latency (ms)."""
    for batch in batches[:2]:  # warm-up
        submit(batch).result()
    latencies = []
    for batch in batches[:5]:
        start = time.perf_counter()
        submit(batch).result()
        latencies.append(time.perf_counter() - start)
    latencies.sort()
    best = 0.0
    for _ in range(repeats):
        pending: deque = deque()
        rows, i = 0, 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            while len(pending) < inflight:
                batch = batches[i % len(batches)]
                pending.append((batch.numel(), submit(batch)))
                i += 1
            count, future = pending.popleft()
            future.result()
            rows += count
        while pending:
            count, future = pending.popleft()
            future.result()
            rows += count
        best = max(best, rows / (time.perf_counter() - start))
    return best, latencies[len(latencies) // 2] * 1e3


def in_process(args, batches, grads) -> dict:
    """The baseline: the same lookups and updates, ``inflight`` at a time, on a ShardStore in this process."""
    store = ShardStore(0, 1, seed=0)
    store.configure(table_config(args.dim))
    for batch in batches:
        store.lookup(TABLE, batch, train=True)
    with ThreadPoolExecutor(args.inflight) as pool:
        lookup, _ = pipelined(lambda b: pool.submit(store.lookup, TABLE, b, True), batches, args.seconds, args.inflight, args.repeats)
        update, _ = pipelined(lambda b: pool.submit(store.update, TABLE, b, grads), batches, args.seconds, args.inflight, args.repeats)
    return {"lookup_rows_per_s": lookup, "update_rows_per_s": update}


def through_grpc(args, num_shards: int, batches, grads) -> dict:
    with LocalShards(num_shards) as shards, PSClient(shards.addresses, timeout_s=120) as client:
        client.wait_healthy(120)
        client.configure([table_config(args.dim)])
        for batch in batches:  # admit the pool, so the timed part reads and updates existing rows
            client.lookup({TABLE: batch}, train=True)
        lookup, lookup_ms = pipelined(
            lambda b: client.lookup_async({TABLE: b}, train=True, wire_dtype=args.wire_dtype), batches, args.seconds, args.inflight, args.repeats)
        update, update_ms = pipelined(
            lambda b: client.update_async({TABLE: (b, grads)}, wire_dtype=args.wire_dtype), batches, args.seconds, args.inflight, args.repeats)
    return {"shards": num_shards, "lookup_rows_per_s": lookup, "lookup_ms": lookup_ms,
            "update_rows_per_s": update, "update_ms": update_ms}


def memory(args) -> dict:
    """Shard RSS growth per stored row after ``memory_rows`` rows were admitted and updated once."""
    with LocalShards(1) as shards, PSClient(shards.addresses, timeout_s=300) as client:
        client.wait_healthy(120)
        client.configure([table_config(args.dim)])
        pid = shards.processes[0].pid
        client.lookup({TABLE: torch.arange(args.ids)}, train=False)  # warm every code path once, store nothing
        base = rss_bytes(pid)
        grads = torch.randn(args.ids, args.dim) * 1e-3
        start = time.perf_counter()
        for first in range(0, args.memory_rows, args.ids):
            ids = torch.arange(first, min(first + args.ids, args.memory_rows))
            client.lookup({TABLE: ids}, train=True)
            client.update({TABLE: (ids, grads[: ids.numel()])})
        fill_s = time.perf_counter() - start
        rows = client.stats()[0]["tables"][TABLE]["rows"]
        time.sleep(2.5)  # idle long enough for the shard to hand freed request buffers back (malloc_trim_interval_s)
        rss = rss_bytes(pid)
        peak = rss_bytes(pid, "VmHWM")
    return {"rows": rows, "bytes_per_row": (rss - base) / rows, "rss_base_mb": base / 2**20, "rss_mb": rss / 2**20,
            "rss_peak_mb": peak / 2**20, "fill_s": fill_s, "ideal_bytes_per_row": args.dim * 4 + 4}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2], help="shard counts to measure")
    parser.add_argument("--ids", type=int, default=65536, help="unique ids per request")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--pool", type=int, default=1 << 20, help="distinct ids the requests draw from")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the best counts (the machine may be shared)")
    parser.add_argument("--inflight", type=int, default=2, help="requests the client keeps in flight")
    parser.add_argument("--wire-dtype", default="fp16", choices=["fp16", "fp32"])
    parser.add_argument("--memory-rows", type=int, default=10_000_000, help="rows for bytes_per_row; 0 skips it")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    batches = make_batches(args.pool, args.ids, count=16)
    grads = torch.randn(args.ids, args.dim) * 1e-3
    baseline = in_process(args, batches, grads)
    results = [through_grpc(args, n, batches, grads) for n in args.shards]
    mem = memory(args) if args.memory_rows else None

    print(f"PS benchmark: {args.ids} unique ids/request, dim {args.dim}, {args.wire_dtype} on the wire, "
          f"row-wise Adagrad, {args.inflight} requests in flight, best of {args.repeats} x {args.seconds:g} s")
    print(f"machine: {os.cpu_count()} cores, load average {load_before:.1f} before the run and "
          f"{os.getloadavg()[0]:.1f} after (other work on the machine lowers every figure)")
    header = f"{'setup':<22}{'lookup rows/s':>16}{'vs store':>10}{'lookup ms':>11}{'update rows/s':>16}{'vs store':>10}{'update ms':>11}"
    print(header)
    print("-" * len(header))
    print(f"{'store, in-process':<22}{baseline['lookup_rows_per_s']:>16,.0f}{'1.00':>10}{'':>11}"
          f"{baseline['update_rows_per_s']:>16,.0f}{'1.00':>10}{'':>11}")
    for r in results:
        print(f"{str(r['shards']) + ' shard(s), gRPC':<22}{r['lookup_rows_per_s']:>16,.0f}"
              f"{r['lookup_rows_per_s'] / baseline['lookup_rows_per_s']:>10.2f}{r['lookup_ms']:>11.1f}"
              f"{r['update_rows_per_s']:>16,.0f}{r['update_rows_per_s'] / baseline['update_rows_per_s']:>10.2f}"
              f"{r['update_ms']:>11.1f}")
    if mem:
        print(f"\nshard memory: {mem['rows']:,} rows, {mem['bytes_per_row']:.1f} bytes/row over the idle shard "
              f"(ideal {mem['ideal_bytes_per_row']} = dim x 4 + 4); RSS {mem['rss_base_mb']:.0f} -> {mem['rss_mb']:.0f} MB, "
              f"peak {mem['rss_peak_mb']:.0f} MB; filled in {mem['fill_s']:.1f} s")
    if args.json:
        first = results[0]
        summary = {
            "lookup_rows_per_s": first["lookup_rows_per_s"],
            "update_rows_per_s": first["update_rows_per_s"],
            "bytes_per_row": mem["bytes_per_row"] if mem else None,
            "shards": first["shards"],
            "load_average": [load_before, os.getloadavg()[0]],
            "ids_per_request": args.ids, "dim": args.dim, "wire_dtype": args.wire_dtype, "inflight": args.inflight,
            "baseline_in_process": baseline,
            "by_shards": results,
            "memory": mem,
        }
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
