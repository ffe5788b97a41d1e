"""The Zipf lookup rate of an all-in-memory table in a shard on each malloc a launcher offers, measured in turns.

One shard a malloc (``LocalShards(allocator=...)``: ``system``, the process's own, glibc's here; ``jemalloc``,
preloaded), each holding the same table grown alike to ``--rows`` rows, then the Zipf(1.1) stream of
``scale_bench.py`` (the same seed) in turns of :data:`scale_bench.PAIRED_BLOCK` requests, every other shard stopped
(SIGSTOP) during a shard's turn and the order of the turns alternated: both shards see the machine of the same
minutes, whose speed moved the memory table's rate between 4.2M and 8.1M rows/s from run to run of
``scale_bench.py`` on the development VM (benchmarks/results/2026-11-27-disk-tier.md, experiments 18 to 23). Prints each shard's rate,
its CPU and the client's a request, the rate of each over the first's (the whole, and turn by turn), and with
``--json`` one JSON object on the last line.

    .venv/bin/python -m benchmarks.ps.malloc_bench                              # 100M rows, system against jemalloc
    .venv/bin/python -m benchmarks.ps.malloc_bench --rows 1e6 --warmup 20 --repeats 100
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Optional

import torch

from benchmarks.ps.scale_bench import (PAIRED_BLOCK, TABLE, Shards, demoter_cpu_s, lock_wait_s, start, stopped, stored_id,
                                       unique_batch, zipf_indices)
from lightning_persia.remote_ps.allocator import ALLOCATORS

_GB = 1e9


def grow(shards: dict[str, Shards], rows: int, request_ids: int) -> None:
    """Every shard's table grown to ``rows`` rows alike: the same training lookups of new ids, shard by shard."""
    for first in range(0, rows, request_ids):
        batch = stored_id(torch.arange(first, min(rows, first + request_ids)))
        for one in shards.values():
            one.client.lookup({TABLE: batch}, train=True)


@contextlib.contextmanager
def _alone(shards: dict[str, Shards], name: str):
    """Every shard but ``name``'s stopped meanwhile."""
    with contextlib.ExitStack() as stack:
        for other, one in shards.items():
            if other != name:
                stack.enter_context(stopped(one))
        yield


def measure(shards: dict[str, Shards], rows: int, request_ids: int, warmup: int, repeats: int) -> dict:
    """Each shard's Zipf rows/s over the ``repeats`` requests after ``warmup``, in turns; its CPU, its demoter
    thread's part of it and the client's a request (ms), and the wall time a request waited for the table's lock (ms;
    NaN where the shard's code does not count it); and each turn's time of the first shard over every other's
    (``turns``: name -> ratios)."""
    generator = torch.Generator().manual_seed(1234)
    batches = [unique_batch(zipf_indices(rows, request_ids, generator)) for _ in range(warmup + repeats)]
    names = list(shards)
    spent = dict.fromkeys(names, 0.0)
    shard_cpu = dict.fromkeys(names, 0.0)
    client_cpu = dict.fromkeys(names, 0.0)
    turns: dict[str, list[float]] = {name: [] for name in names[1:]}
    waited_before: Optional[dict[str, float]] = None
    demoter_before: Optional[dict[str, float]] = None
    for first in range(0, len(batches), PAIRED_BLOCK):
        block, timed = batches[first : first + PAIRED_BLOCK], first >= warmup
        if timed and waited_before is None:  # between turns: every shard runs, and answers
            waited_before = {name: lock_wait_s(shards[name]) for name in names}
            demoter_before = {name: demoter_cpu_s(shards[name]) for name in names}
        took = {}
        for name in names if (first // PAIRED_BLOCK) % 2 == 0 else names[::-1]:
            with _alone(shards, name):
                cpu, own, began = sum(shards[name].cpu_s()), time.process_time(), time.perf_counter()
                for batch in block:
                    shards[name].client.lookup({TABLE: batch}, train=True)
                took[name] = time.perf_counter() - began
                if timed:
                    spent[name] += took[name]
                    shard_cpu[name] += sum(shards[name].cpu_s()) - cpu
                    client_cpu[name] += time.process_time() - own
        if timed:
            for name in names[1:]:
                turns[name].append(took[names[0]] / took[name])
    looked_up = sum(b.numel() for b in batches[warmup:])
    waited = {name: (lock_wait_s(shards[name]) - waited_before[name]) * 1e3 / repeats if waited_before else float("nan")
              for name in names}
    demoter = {name: (demoter_cpu_s(shards[name]) - demoter_before[name]) * 1e3 / repeats if demoter_before else float("nan")
               for name in names}
    return {name: {"zipf_rows_per_s": looked_up / spent[name], "shard_cpu_ms_per_request": shard_cpu[name] * 1e3 / repeats,
                   "demoter_cpu_ms_per_request": demoter[name],
                   "client_cpu_ms_per_request": client_cpu[name] * 1e3 / repeats, "rss_bytes": shards[name].rss(),
                   "lock_wait_ms_per_request": waited[name],
                   **({"over_first": spent[names[0]] / spent[name], "turns_over_first": sorted(turns[name])} if name in turns else {})}
            for name in names}


def grow_and_measure(shards: dict[str, Shards], rows: int, request_ids: int, warmup: int, repeats: int) -> dict:
    """:func:`grow` every shard's table (printing how long it took), then :func:`measure` them."""
    began = time.perf_counter()
    grow(shards, rows, request_ids)
    print(f"grown in {time.perf_counter() - began:.0f} s", flush=True)
    return measure(shards, rows, request_ids, warmup, repeats)


def describe(name: str, figures: dict) -> str:
    """A shard's line of :func:`measure`'s ``figures``: its Zipf rate, its CPU and the client's a request, its RSS."""
    return (f"{name}: Zipf lookups {figures['zipf_rows_per_s'] / 1e6:.2f} M rows/s, shard CPU "
            f"{figures['shard_cpu_ms_per_request']:.2f} ms a request (its demoter {figures['demoter_cpu_ms_per_request']:.2f}), "
            f"client {figures['client_cpu_ms_per_request']:.2f} ms, "
            f"waiting for the table's lock {figures['lock_wait_ms_per_request']:.2f} ms, "
            f"RSS {figures['rss_bytes'] / _GB:.2f} GB")


def turns(figures: dict) -> str:
    """The spread of a shard's rate over the first shard's, turn by turn, of :func:`measure`'s ``figures``."""
    ratios = figures["turns_over_first"]
    return f"(turn by turn: median {ratios[len(ratios) // 2]:.3f}x, {ratios[0]:.3f}x to {ratios[-1]:.3f}x over {len(ratios)} turns)"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=float, default=1e8, help="rows of each shard's table (default 1e8)")
    parser.add_argument("--allocators", default="system,jemalloc",
                        help=f"the shards' mallocs, comma-separated, at least two of {', '.join(ALLOCATORS)} (default system,jemalloc); "
                             "the others' rates are given over the first's")
    parser.add_argument("--warmup", type=int, default=500, help="Zipf requests before the timed ones (default 500)")
    parser.add_argument("--repeats", type=int, default=2500, help="timed Zipf requests (default 2500)")
    parser.add_argument("--request-ids", type=int, default=131072, help="Zipf draws a request (default 131072)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args(argv)
    names = [a.strip() for a in args.allocators.split(",") if a.strip()]
    unknown = [a for a in names if a not in ALLOCATORS]
    if unknown or len(set(names)) != len(names) or len(names) < 2:
        parser.error(f"--allocators needs two or more distinct of {', '.join(ALLOCATORS)}; got {args.allocators!r}")
    rows = int(args.rows)
    if rows < 1 or args.repeats < 1 or args.warmup < 0 or args.request_ids < 1:
        parser.error("--rows, --repeats and --request-ids must be positive, --warmup not negative")
    print(f"malloc_bench: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; {rows:,} rows in memory a shard; "
          f"shards on {', '.join(names)}", flush=True)
    shards: dict[str, Shards] = {}
    try:
        for name in names:
            shards[name] = start(1, "fp16", [], allocator=name)
        out = grow_and_measure(shards, rows, args.request_ids, args.warmup, args.repeats)
    finally:
        for one in shards.values():
            one.close()
    for name, figures in out.items():
        line = describe(name, figures)
        if "over_first" in figures:
            line += f"; {figures['over_first']:.3f}x {names[0]}'s rate {turns(figures)}"
        print(line)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        print(json.dumps({"rows": rows, "allocators": names, "shards": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
