"""Parameter-server soak: exactness under load with connection drops, and shard memory under a long run at capacity.

Part 1 (exactness): ``--clients`` processes (``lightning_persia.testing.hammer``) x 2 shards push known SGD gradients
for ``--steps`` steps each, every client through its own proxies that reset a connection with probability
``--drop`` per forwarded chunk. The final rows must equal the analytic sum exactly (no update lost or doubled).

Part 2 (memory): one shard, one table of ``--capacity`` rows (dim ``--dim``, row-wise Adagrad); a client admits
``--batch`` fresh ids per round and updates them, for ``--rounds`` rounds (many times the capacity, so LRU
eviction runs all the time). The shard's RSS (VmRSS) is sampled every round: after the table first fills, RSS
must stay flat; the table never holds more than ``capacity`` rows; ``capacity x bytes_per_row`` is printed
beside the RSS growth.

    .venv/bin/python -m tools.ps_soak                         # defaults: about 2-3 minutes here
    .venv/bin/python -m tools.ps_soak --steps 300 --rounds 100 # quick

Exit status 1 if the rows differ from the analytic sum or RSS grows beyond the bound.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.table_config import SGD, Adagrad, Constant, TableConfig
from lightning_persia.testing import hammer

TABLES = ["soak_a", "soak_b"]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def exactness(args) -> bool:
    print(f"== exactness: {args.clients} client processes x 2 shards x {args.steps} steps, drop probability {args.drop} per chunk")
    with LocalShards(2, overrides=["seed=1"]) as shards, PSClient(shards.addresses) as client:
        client.configure([TableConfig(t, hammer.DIM, optimizer=SGD(lr=1.0), init=Constant(0.0)) for t in TABLES])
        everything = torch.arange(hammer.NUM_IDS)
        client.lookup({t: everything for t in TABLES}, train=True)
        started = time.monotonic()
        processes = [subprocess.Popen(
            [sys.executable, "-m", "lightning_persia.testing.hammer", "--addresses", ",".join(shards.addresses),
             "--client", str(i), "--steps", str(args.steps), "--tables", ",".join(TABLES),
             "--drop-probability", str(args.drop), "--seed", str(i)], stdout=subprocess.PIPE, text=True)
            for i in range(args.clients)]
        results = []
        for process in processes:
            out, _ = process.communicate(timeout=3600)
            if process.returncode != 0:
                print(f"client failed with status {process.returncode}")
                return False
            results.append(json.loads(out.strip().splitlines()[-1]))
        seconds = time.monotonic() - started
        expected = hammer.expected_rows(range(args.clients), args.steps)
        got = client.lookup({t: everything for t in TABLES}, train=False, wire_dtype="fp32")
        errors = {t: float((got[t] - expected).abs().max()) for t in TABLES}
        stats = client.stats()
        duplicates = sum(s["server"]["dedup_duplicates"] for s in stats)
        updates = sum(s["server"].get("Update", 0) for s in stats)
    print(f"{'client':>6} {'steps':>6} {'seconds':>8} {'connections':>12} {'dropped':>8}")
    for r in results:
        print(f"{r['client']:>6} {r['steps']:>6} {r['seconds']:>8.1f} {r['connections']:>12} {r['dropped_connections']:>8}")
    print(f"Update RPCs received: {updates} (incl. retries); retries answered as duplicates: {duplicates}; "
          f"wall {seconds:.1f} s")
    print(f"max |row - analytic sum| per table: {errors} -> {'EXACT' if all(e == 0 for e in errors.values()) else 'WRONG'}")
    return all(e == 0 for e in errors.values())


def memory(args) -> bool:
    print(f"\n== memory: capacity {args.capacity} rows, dim {args.dim}, {args.rounds} rounds of {args.batch} fresh ids "
          f"({args.rounds * args.batch / args.capacity:.0f}x the capacity)")
    table = TableConfig("soak_mem", args.dim, optimizer=Adagrad(lr=0.01, rowwise=True), capacity=args.capacity)
    env = {"MALLOC_ARENA_MAX": str(args.arena_max)} if args.arena_max else None
    with LocalShards(1, overrides=["seed=1", "malloc_trim_interval_s=0.5"], env=env) as shards, PSClient(shards.addresses) as client:
        pid = shards.processes[0].pid
        client.configure([table])
        idle = rss_mb(pid)
        samples = []
        fill_round = None
        started = time.monotonic()
        for r in range(args.rounds):
            ids = torch.arange(r * args.batch, (r + 1) * args.batch)
            client.lookup({"soak_mem": ids}, train=True)
            client.update({"soak_mem": (ids, torch.randn(ids.numel(), args.dim))})
            stats = client.stats()[0]["tables"]["soak_mem"]
            if fill_round is None and (r + 1) * args.batch >= args.capacity:
                fill_round = r
            samples.append((r, rss_mb(pid), stats["rows"], stats["evicted"], stats["bytes"]))
        seconds = time.monotonic() - started
    rows_max = max(s[2] for s in samples)
    row_bytes = samples[-1][4] / max(samples[-1][2], 1)
    bound_mb = args.capacity * row_bytes / 2**20
    # Steady state: once the table is full, the second half of the run must not need more memory than the first.
    at_capacity = [s for s in samples if fill_round is not None and s[0] > fill_round]
    half = len(at_capacity) // 2
    first_peak = max(s[1] for s in at_capacity[:half])
    second_peak = max(s[1] for s in at_capacity[half:])
    print(f"{'round':>6} {'RSS MB':>8} {'rows':>9} {'evicted':>10}")
    step = max(1, len(samples) // 12)
    for r, rss, rows, evicted, _ in samples[::step] + [samples[-1]]:
        print(f"{r:>6} {rss:>8.1f} {rows:>9} {evicted:>10}")
    growth = second_peak - first_peak
    ok = rows_max <= args.capacity and growth <= max(0.05 * first_peak, 16.0)
    print(f"rows never above capacity: {rows_max} <= {args.capacity}; store bytes/row {row_bytes:.0f}, "
          f"capacity x bytes/row = {bound_mb:.1f} MB")
    print(f"RSS: idle shard {idle:.0f} MB; at capacity, peak of rounds {at_capacity[0][0]}-{at_capacity[half - 1][0]}: "
          f"{first_peak:.1f} MB, of rounds {at_capacity[half][0]}-{at_capacity[-1][0]}: {second_peak:.1f} MB "
          f"(growth {growth:+.1f} MB); above idle: {first_peak - idle:.0f} MB = table {bound_mb:.0f} MB + allocator arenas "
          f"and request buffers; {seconds:.0f} s -> {'BOUNDED' if ok else 'GROWING'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--drop", type=float, default=0.02)
    parser.add_argument("--capacity", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--arena-max", type=int, default=0, help="MALLOC_ARENA_MAX of the shard (0: glibc default)")
    parser.add_argument("--skip-exactness", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    ok = True
    if not args.skip_exactness:
        ok &= exactness(args)
    if not args.skip_memory:
        ok &= memory(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
