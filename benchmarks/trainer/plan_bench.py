"""CPU time of planning one batch's lookup on the trainer: the dedup of its ids (each implementation) and their sharding.

A Criteo-shaped batch (26 tables, one id per row and table, Zipf ids from train_bench's synthetic data) is planned
the way the prefetch thread plans it; every figure is CPU time per call (``time.process_time``, one torch thread).

    .venv/bin/python -m benchmarks.trainer.plan_bench [--batch-size 4096] [--calls 50]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable
from unittest import mock

import numpy as np
import torch

from benchmarks.trainer import data
from benchmarks.trainer.data import RankSlices
from lightning_persia.data import CRITEO_SPARSE_FEATURES
from lightning_persia.ops import dedup, native
from lightning_persia.ops.keyed_ids import KeyedIds
from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.client import Sharder


def cpu_ms(call: Callable[[], object], calls: int) -> float:
    call()
    start = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--shards", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    meta = data.prepare(data.default_cache_dir(), seed=0, batch_size=args.batch_size, train_batches=1, test_batches=1,
                        cardinality_scale=0.1, zipf_alpha=1.1)
    kjt = RankSlices(meta["path"], "train", args.batch_size)[0].sparse_features
    keyed = KeyedIds(tuple(CRITEO_SPARSE_FEATURES), tuple(kjt.length_per_key()), kjt.values())
    unique, _ = dedup.keyed_unique(keyed)
    print(f"one batch: {keyed.ids.numel():,} ids in {len(keyed.tables)} tables, {unique.ids.numel():,} unique; "
          f"CPU ms per call over {args.calls} calls")
    if native.available():
        print(f"  dedup, native hash table per table:       {cpu_ms(lambda: dedup.keyed_unique(keyed), args.calls):6.2f}")
    with mock.patch.object(dedup.native, "available", lambda: False):
        print(f"  dedup, tensor ops, numpy's stable sort:   {cpu_ms(lambda: dedup.keyed_unique(keyed), args.calls):6.2f}")
        sort = np.sort
        with mock.patch.object(dedup.np, "sort", lambda values, kind=None: sort(values)):
            print(f"  dedup, tensor ops, numpy's default sort:  {cpu_ms(lambda: dedup.keyed_unique(keyed), args.calls):6.2f}")
    sharder = Sharder(ShardMap.uniform(args.shards), 1 << 20, 64 << 20, 16)
    print(f"  sharding the unique ids over {args.shards} shards:  {cpu_ms(lambda: sharder(unique), args.calls):6.2f}")


if __name__ == "__main__":
    main()
