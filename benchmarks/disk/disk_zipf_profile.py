"""Where a disk table's Zipf lookups spend their time, in process (no gRPC): the same stream against a table held all
in memory and against a disk table, and a profile of the disk table's requests and of its demoter.

    .venv/bin/python -m benchmarks.disk.disk_zipf_profile --rows 1e8 --memory-rows 4e7 --warmup 300 --requests 50 \\
        --disk-dir /work/tmp-tier

Each table is grown by training lookups of ``--rows`` new ids, 131,072 a request (as ``scale_bench.py`` grows its
shard); then ``--warmup`` requests of the Zipf(1.1) stream bring its head into memory, and the ``--requests`` after
them are timed and profiled (cProfile: the request thread, and the demoter's promotions, estimates and demotions on
their own thread). As in a shard, the lookups leave the rows they read from disk to the demoter
(``--promote-at-once``: they bring them in themselves).
``--profile-rows`` lines of each profile, by time spent in the function itself.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time

import torch

from benchmarks.ps.scale_bench import stored_id, unique_batch, zipf_indices
from lightning_persia.remote_ps.store.disk.demoter import Demoter
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

_GROW_BATCH = 131_072
_RECORD_AND_ID_BYTES = 56  # this script's table (dim 16, fp16, row-wise Adagrad): a record, and its id in the ids file


class _ProfiledDemotions:
    """A disk table as its demoter sees it: the demoter's calls (the promotions its lookups queued, the estimates of
    the cold threshold, made without the lock, and the demotions) are profiled and timed while ``profiling`` is set;
    the others go to the ``table`` as they are."""

    profiling = False
    profile = cProfile.Profile()
    spent_s = 0.0

    def __init__(self, table: Table) -> None:
        self._table = table

    def __getattr__(self, name: str):
        return getattr(self._table, name)

    def cold_estimate(self, count: int):
        return self._profiled(self._table.cold_estimate, count)

    def demote(self, count: int, estimated=None) -> int:
        return self._profiled(self._table.demote, count, estimated)

    def promote_pending(self, limit: int) -> int:
        return self._profiled(self._table.promote_pending, limit)

    def _profiled(self, call, *args):
        if not self.profiling:
            return call(*args)
        started = time.perf_counter()
        self.profile.enable()
        try:
            return call(*args)
        finally:
            self.profile.disable()
            type(self).spent_s += time.perf_counter() - started


def _stream(rows: int, requests: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [unique_batch(zipf_indices(rows, _GROW_BATCH, generator)) for _ in range(requests)]


def _run(table: Table, rows: int, batches: list[torch.Tensor], warmup: int, profile: bool) -> tuple[float, cProfile.Profile, int]:
    """Grows ``table`` to ``rows``, runs the ``warmup`` first batches, then times (and profiles) the others; returns
    their time, their profile and the rows they promoted."""
    step = min(_GROW_BATCH, table.config.capacity)  # a training request fits in a disk table's budget
    for start in range(0, rows, step):
        table.lookup(stored_id(torch.arange(start, min(rows, start + step))), train=True)
    _disk_use(table, "grown")
    for batch in batches[:warmup]:
        table.lookup(batch, train=True)
    profiler = cProfile.Profile()
    promoted = table.stats()["promoted"]
    _ProfiledDemotions.profiling = profile
    started = time.perf_counter()
    if profile:
        profiler.enable()
    for batch in batches[warmup:]:
        table.lookup(batch, train=True)
    profiler.disable()
    _ProfiledDemotions.profiling = False
    elapsed = time.perf_counter() - started
    _disk_use(table, "after the stream")
    return elapsed, profiler, table.stats()["promoted"] - promoted


def _disk_use(table: Table, when: str) -> None:
    """A disk table's files against its live records (the rest is garbage compaction has not taken yet)."""
    stats = table.stats()
    if stats["storage"] == "disk":
        live = stats["disk_rows"] * _RECORD_AND_ID_BYTES
        print(f"  {when}: {stats['disk_rows']:,} rows on disk, files {stats['disk_bytes'] / 1e9:.2f} GB for "
              f"{live / 1e9:.2f} GB of live records; {stats['promoted']:,} rows promoted so far", flush=True)


def _top(profile: cProfile.Profile, lines: int) -> str:
    if not profile.getstats():
        return "(none ran)"
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(lines)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=float, default=2e7)
    parser.add_argument("--memory-rows", type=float, default=8e6, help="the disk table's memory budget")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--disk-dir", required=True, help="a folder for the disk table's segments (deleted after)")
    parser.add_argument("--profile-rows", type=int, default=14)
    parser.add_argument("--eviction", choices=("lru", "lfu"), default="lru", help="which rows the disk table demotes")
    parser.add_argument("--promote-at-once", action="store_true",
                        help="a lookup brings the rows it reads from disk into memory itself (a shard without a demoter), "
                             "instead of leaving them to the demoter (a shard's default)")
    args = parser.parse_args(argv)
    rows, memory_rows = int(args.rows), int(args.memory_rows)
    if not 0 < memory_rows < rows or args.warmup < 0 or args.requests < 1:
        parser.error("needs 0 < --memory-rows < --rows, --warmup >= 0 and --requests >= 1")
    torch.set_num_threads(1)
    batches = _stream(rows, args.warmup + args.requests)
    ids = sum(batch.numel() for batch in batches[args.warmup:])
    optimizer = Adagrad(lr=0.01, rowwise=True)
    print(f"disk_zipf_profile: {rows:,} rows ({memory_rows:,} of the disk table's in memory); {args.warmup} requests of "
          f"warmup, {args.requests} timed ({ids / args.requests:,.0f} distinct ids each)", flush=True)

    memory = Table(TableConfig("memory", 16, optimizer=optimizer, storage_dtype="fp16", capacity=(1 << 31) - 1), seed=0)
    memory_s, _, _ = _run(memory, rows, batches, args.warmup, profile=False)
    del memory
    print(f"memory table: {ids / memory_s / 1e6:.2f} M rows/s, {memory_s / args.requests * 1e3:.2f} ms a request", flush=True)

    with tempfile.TemporaryDirectory(dir=args.disk_dir) as folder:
        config = TableConfig("disk", 16, optimizer=optimizer, storage_dtype="fp16", capacity=memory_rows, storage="disk",
                             eviction=args.eviction)
        disk = Table(config, seed=0, disk_dir=folder, promote_later=not args.promote_at_once)
        profiled = _ProfiledDemotions(disk)
        demoter = Demoter(lambda: [profiled])
        demoter.start()
        try:
            disk_s, profile, promoted = _run(disk, rows, batches, args.warmup, profile=True)
        finally:
            demoter.stop()
            disk.close()
    print(f"disk table: {ids / disk_s / 1e6:.2f} M rows/s, {disk_s / args.requests * 1e3:.2f} ms a request "
          f"({memory_s / disk_s:.2f}x the memory table's rate); the last {args.requests} requests promoted {promoted / args.requests:,.0f} rows each, "
          f"the demoter's promotions, estimates and demotions took {_ProfiledDemotions.spent_s / args.requests * 1e3:.2f} ms a request")
    print("--- the requests (the request thread; a wait for the table's lock counts in Table.lookup)")
    print(_top(profile, args.profile_rows))
    print("--- the demoter's promotions, estimates and demotions")
    print(_top(_ProfiledDemotions.profile, args.profile_rows))
    if demoter.errors:  # the requests then demoted for it: the figures above are not the demoter's
        print(f"the demoter failed {demoter.errors} passes (logged above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
