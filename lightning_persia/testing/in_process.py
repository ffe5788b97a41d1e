"""The parameter-server calls of the embedding pipeline, served by shard stores in this process (for unit tests).

:class:`InProcessShards` implements the :class:`~lightning_persia.embedding.shard_client.ShardClient` calls with
real :class:`~lightning_persia.remote_ps.store.ShardStore` s (the shards' rows, initialisers and optimizers) but
no gRPC and no process: tests of the pipeline's scheduling, staleness window and prefetch run in milliseconds,
and can hold updates back to see what a lookup misses.

Example::

    shards = InProcessShards(num_shards=2, seed=0)
    shards.configure([TableConfig("t", dim=4, optimizer=SGD(lr=1.0))])
    pipeline = EmbeddingPipeline(shards, staleness=2, wire_dtype="fp32", device=torch.device("cpu"))
    shards.hold_updates()      # lookups go on, updates wait
    shards.release_updates()
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Optional, Sequence

import torch

from lightning_persia.ops.bucketize import ShardBuckets, bucketize
from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.ops.keyed_ids import KeyedIds, RowLayout
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.table_config import TableConfig


class InProcessShards:
    """``num_shards`` shard stores behind the pipeline's client calls; every call is recorded.

    Lookups and updates each run on a thread of their own, in the order they were made, so a held update
    holds back later updates but not lookups (as shards that answer lookups while an update is in flight).
    """

    def __init__(self, num_shards: int = 1, seed: int = 0) -> None:
        self.num_shards = num_shards
        self.stores = [ShardStore(i, num_shards, seed=seed) for i in range(num_shards)]
        self.lookups: list[tuple[KeyedIds, bool]] = []  # (ids, train) of every lookup, in order
        self.updates: list[KeyedIds] = []  # ids of every update applied, in order
        self._dims: dict[str, int] = {}
        self._lookup_thread = ThreadPoolExecutor(1, thread_name_prefix="in-process-lookup")
        self._update_thread = ThreadPoolExecutor(1, thread_name_prefix="in-process-update")
        self._updates_open = threading.Event()
        self._updates_open.set()

    def configure(self, tables: Sequence[TableConfig]) -> None:
        for config in tables:
            for store in self.stores:
                store.configure(config)
            self._dims[config.name] = config.dim

    def hold_updates(self) -> None:
        """Updates wait (unapplied, unacknowledged) until :meth:`release_updates`."""
        self._updates_open.clear()

    def release_updates(self) -> None:
        self._updates_open.set()

    def rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The current rows of ``ids`` of ``table`` (an evaluation lookup: nothing admitted)."""
        return self._lookup(KeyedIds((table,), (ids.numel(),), ids), train=False).view(ids.numel(), -1)

    # ---- the ShardClient calls ------------------------------------------------------------------------

    def shard(self, keyed: KeyedIds) -> ShardBuckets:
        return bucketize(keyed, ShardMap.uniform(self.num_shards))

    def sharder(self) -> "partial[ShardBuckets]":
        return partial(bucketize, shard_map=ShardMap.uniform(self.num_shards))

    def lookup_sharded_async(self, sharded: ShardBuckets, *, train: bool, wire_dtype: str = "fp16") -> "Future[torch.Tensor]":
        self.lookups.append((sharded.keyed, train))
        return self._lookup_thread.submit(self._lookup, sharded.keyed, train)

    def update_sharded_async(
        self, sharded: ShardBuckets, grads: torch.Tensor, dims: Sequence[int], *, wire_dtype: str = "fp16", sender: Optional[str] = None,
    ) -> "Future[None]":
        return self._update_thread.submit(self._update, sharded.keyed, grads.clone(), tuple(dims))

    def close(self) -> None:
        self.release_updates()
        self._lookup_thread.shutdown()
        self._update_thread.shutdown()

    # ---- the stores ----------------------------------------------------------------------------------

    def _split(self, keyed: KeyedIds, dims: Sequence[int], flat: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        offsets = RowLayout(keyed.counts, dims).table_offsets()
        ids = torch.split(keyed.ids, list(keyed.counts))
        return [(t, i, flat[offsets[k] : offsets[k + 1]].view(-1, d)) for k, (t, i, d) in enumerate(zip(keyed.tables, ids, dims))]

    def _lookup(self, keyed: KeyedIds, train: bool) -> torch.Tensor:
        dims = [self._dims[t] for t in keyed.tables]
        out = torch.empty(RowLayout(keyed.counts, dims).numel)
        for name, ids, rows in self._split(keyed, dims, out):
            for store in self.stores:
                mine = self._owned(store, ids)
                if mine.numel():
                    rows[mine] = store.lookup_many([(name, ids[mine])], train)[0]
        return out

    def _update(self, keyed: KeyedIds, grads: torch.Tensor, dims: tuple[int, ...]) -> None:
        self._updates_open.wait()
        for name, ids, rows in self._split(keyed, dims, grads):
            for store in self.stores:
                mine = self._owned(store, ids)
                if mine.numel():
                    store.update_many([(name, ids[mine], rows[mine].float().contiguous())])
        self.updates.append(keyed)

    def _owned(self, store: ShardStore, ids: torch.Tensor) -> torch.Tensor:
        """Positions of the ids that ``store`` holds."""
        return torch.nonzero(store.shard_map.shard_of(ids) == store.shard_index).squeeze(1)
