"""A giving shard's CPU for one wave of a move, in this process: reading the wave's rows at its point, and dropping
them at its end, by reading every row's slot (a sweep: what a shard's first handover, or one after a restart, does)
or by the ids it remembers handing over (what the next ones do).

One store (shard 0 of 2) holds ``--rows`` rows of one table; ``--waves`` waves of ``--wave-slots`` of its slots each
go to a third shard (a store in this process too), with nothing changing meanwhile. The first wave's end sweeps (the
store is new); the median over the others is what a wave of a long move costs. The seconds are this thread's CPU
(the store does the work in the caller's thread), so other processes' load changes them little.

    python -m benchmarks.cluster.handover_cpu_bench --json                       # 10M rows: a 20M-row table's shard
    python -m benchmarks.cluster.handover_cpu_bench --rows 2500000 --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.wal.changes import Change, TableChange
from lightning_persia.remote_ps.table_config import SGD, Constant, TableConfig


def _wave(source: ShardStore, taker: ShardStore, to_map: ShardMap) -> dict:
    """One wave, nothing changing during it: the source's CPU seconds for its point read and for its end."""
    began = time.thread_time()
    for config, step, rows in source.begin_handover(to_map):
        taken = time.thread_time()
        taker.take_changes([config], [Change([TableChange(config.name, step, rows=rows)])], to_map)
        began += time.thread_time() - taken  # the taker's work is not the source's
    point_s = time.thread_time() - began
    source.fence_handover()
    taker.take_changes(*source.handover_changes(), to_map)
    taker.adopt_map(to_map)
    began = time.thread_time()
    source.finish_handover()
    return {"point_read_cpu_s": point_s, "finish_cpu_s": time.thread_time() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="rows the giving shard holds")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--wave-slots", type=int, default=102, help="slots a wave moves (102: a 20M-row table's waves)")
    parser.add_argument("--waves", type=int, default=6, help="waves timed (at least 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args()

    config = TableConfig("items", args.dim, optimizer=SGD(lr=1.0), init=Constant(0.0))
    two = ShardMap.uniform(2)
    source, taker = ShardStore(0, 2, seed=0), ShardStore(2, 3, seed=0)
    source.configure(config)
    candidates = torch.arange(0, 2 * args.rows + (1 << 20))
    ids = candidates[two.shard_of(candidates) == 0][: args.rows]
    for part in ids.split(1 << 20):
        source.lookup("items", part, train=True)
    waves = [wave for wave in two.waves(3, args.wave_slots) if 0 in {was for was, _ in two.moves(wave).values()}][: args.waves]
    if len(waves) < max(args.waves, 2):
        parser.error(f"--wave-slots {args.wave_slots}: shard 0 gives slots in fewer than {max(args.waves, 2)} waves")
    results = []
    for wave in waves:  # the waves between them move shard 1's slots: shard 0 hears of them with the next one
        moved = int(((source.shard_map.shard_of(ids) == 0) & (wave.shard_of(ids) != 0)).sum())
        results.append({"rows_handed": moved, **_wave(source, taker, wave)})
    later = results[1:]
    summary = {"rows": args.rows, "dim": args.dim, "wave_slots": args.wave_slots, "waves": results,
               "later_point_read_cpu_s": statistics.median(wave["point_read_cpu_s"] for wave in later),
               "later_finish_cpu_s": statistics.median(wave["finish_cpu_s"] for wave in later),
               "load": os.getloadavg()[0]}
    for number, wave in enumerate(results, 1):
        print(f"wave {number}: {wave['rows_handed']:,} rows; point read {wave['point_read_cpu_s']:.2f} s, "
              f"end {wave['finish_cpu_s']:.2f} s of CPU")
    print(f"waves 2 to {len(results)}, medians: point read {summary['later_point_read_cpu_s']:.2f} s, "
          f"end {summary['later_finish_cpu_s']:.2f} s of CPU")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
