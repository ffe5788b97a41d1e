"""Turning a batch into its step's lookup: each remote module's input found and deduplicated, the ids sharded.

Everything here is plain data and tensor code (no module, no connection, nothing on a GPU), so it runs wherever
the batch is: on the pipeline's prefetch thread, or, when the train DataLoader has worker processes, inside
them (:class:`PlanningCollate`), where PERSIA's embedding workers would do it: out of the trainer's interpreter,
while the trainer runs earlier steps.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.embedding.batch_rows import RowPlan
from lightning_persia.embedding.batch_search import Path, at_path, find_kjts
from lightning_persia.ops.dedup import keyed_unique
from lightning_persia.ops.keyed_ids import KeyedIds

Deduplicate = Callable[[KeyedIds], tuple[KeyedIds, torch.Tensor]]
"""Every table's unique ids of some ids, and each id's row among them (``ops.dedup.keyed_unique``, or an embedding
worker's: ``EmbeddingWorkers.deduplicate``)."""


@runtime_checkable
class CountingDeduplicate(Protocol):
    """A :data:`Deduplicate` that can also count a collection's ids per table itself, from the batch's lengths (an
    embedding worker reading them in the trainer's memory: ``worker_client.WorkerDeduplication``), so that the
    planning thread does no pass over the lengths."""

    def __call__(self, keyed: KeyedIds) -> tuple[KeyedIds, torch.Tensor]: ...

    def by_features(self, tables: tuple[str, ...], feature_tables: tuple[int, ...], stride: int, ids: torch.Tensor,
                    lengths: torch.Tensor) -> Optional[tuple[KeyedIds, torch.Tensor, tuple[int, ...]]]:
        """The unique ids, inverse indices and ids per table of ``ids`` (``stride`` lengths a feature, ``feature_tables[f]``
        the table of feature ``f``); None when it cannot (the caller counts and calls the deduplication)."""


def _plan_ids(key: str, tables: tuple[str, ...], dims: tuple[int, ...], counts: tuple[int, ...], ids: torch.Tensor,
              source: tuple[torch.Tensor, ...], feature_tables: Optional[tuple[int, ...]], dedup: Deduplicate) -> RowPlan:
    unique, inverse = dedup(KeyedIds(tables, counts, ids.reshape(-1).to(device="cpu", dtype=torch.int64)))
    return RowPlan(key, unique, dims, inverse, source, feature_tables, counts)


def _length_per_key(kjt: KeyedJaggedTensor) -> list[int]:
    """``kjt.length_per_key()`` without TorchRec's ``torch.sum`` over a ``[keys, batch]`` view of the lengths, which
    costs 1.4 to 4 ms of CPU at batch 16,384 and 26 keys: read off the offsets when the batch has them, else off a
    cumulative sum of the lengths (0.16 ms)."""
    known = kjt.length_per_key_or_none()
    stride = kjt.stride() if kjt.keys() else 0
    if known is not None or kjt.variable_stride_per_key() or not stride:
        return known if known is not None else kjt.length_per_key()
    offsets = kjt.offsets_or_none()
    if offsets is not None:
        return offsets[::stride].diff().tolist()
    ends = torch.cumsum(kjt.lengths(), 0)[stride - 1 :: stride]
    return torch.diff(ends, prepend=ends.new_zeros(1)).tolist()


@dataclass(frozen=True)
class CollectionPlanner:
    """Plans the lookup of a TorchRec collection twin: the features of its remote tables, in a KeyedJaggedTensor.

    ``feature_tables[f]`` is the table (an index into ``tables``) of ``features[f]``; each table's features are
    consecutive. ``pooled``: the module pools its features (an ``EmbeddingBagCollection``: its plans carry what
    its fused lookup needs).
    """

    key: str
    tables: tuple[str, ...]
    dims: tuple[int, ...]
    features: tuple[str, ...]
    feature_tables: tuple[int, ...]
    pooled: bool = True

    def find(self, batch: Any) -> Optional[KeyedJaggedTensor]:
        """The first KeyedJaggedTensor of ``batch`` that holds every feature of the module."""
        for kjt in find_kjts(batch):
            if self.accepts(kjt):
                return kjt
        return None

    def accepts(self, features: Any) -> bool:
        """Whether ``features`` can be this module's input."""
        return isinstance(features, KeyedJaggedTensor) and set(self.features) <= set(features.keys())

    def select(self, kjt: KeyedJaggedTensor, features: Optional[Sequence[str]] = None) -> KeyedJaggedTensor:
        """``kjt`` restricted to (and ordered as) ``features`` (default: the remote tables' ones)."""
        features = list(self.features if features is None else features)
        keys = kjt.keys()
        if keys == features:
            return kjt
        missing = [f for f in features if f not in keys]
        if missing:
            raise KeyError(f"{self.key!r}: features {missing} are missing from the input (it has {keys})")
        return kjt.permute([keys.index(f) for f in features])

    def sources(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, ...]:
        return (kjt.values(), kjt.lengths())

    def plan(self, kjt: KeyedJaggedTensor, dedup: Deduplicate = keyed_unique) -> RowPlan:
        mine = self.select(kjt)
        if isinstance(dedup, CountingDeduplicate) and not mine.variable_stride_per_key() and mine.keys() and mine.stride():
            found = dedup.by_features(self.tables, self.feature_tables, mine.stride(), mine.values().reshape(-1), mine.lengths())
            if found is not None:
                unique, inverse, counts = found
                return RowPlan(self.key, unique, self.dims, inverse, self.sources(kjt), self.feature_tables if self.pooled else None, counts)
        per_feature = torch.tensor(_length_per_key(mine), dtype=torch.int64)
        counts = torch.zeros(len(self.tables), dtype=torch.int64).index_add_(0, torch.tensor(self.feature_tables, dtype=torch.int64), per_feature)
        return _plan_ids(self.key, self.tables, self.dims, tuple(counts.tolist()), mine.values(), self.sources(kjt),
                         self.feature_tables if self.pooled else None, dedup)


@dataclass(frozen=True)
class TensorPlanner:
    """Plans the lookup of a ``nn.Embedding[Bag]`` twin: one table, a tensor of ids as input."""

    key: str
    table: str
    dim: int

    def find(self, batch: Any) -> None:
        return None  # any tensor of the batch could be it: the first step tells (BatchPlanner.paths)

    def accepts(self, features: Any) -> bool:
        return isinstance(features, torch.Tensor) and not features.is_floating_point() and not features.is_complex()

    def sources(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (ids,)

    def plan(self, ids: torch.Tensor, dedup: Deduplicate = keyed_unique) -> RowPlan:
        return _plan_ids(self.key, (self.table,), (self.dim,), (ids.numel(),), ids, (ids,), None, dedup)


Planner = Union[CollectionPlanner, TensorPlanner]


@dataclass(frozen=True)
class PlannedBatch:
    """A batch with its step's lookup planned where the batch was made: each module's plan, the ids sharded."""

    batch: Any
    plans: tuple[RowPlan, ...]
    sharded: Any  # the step's ids bucketed and encoded (ShardClient.shard); None without a plan

    def pin_memory(self) -> "PlannedBatch":
        """The same with the batch in pinned memory (``DataLoader(pin_memory=True)``)."""
        pin = getattr(self.batch, "pin_memory", None)
        return replace(self, batch=pin()) if callable(pin) else self


@dataclass(frozen=True)
class BatchPlanner:
    """Plans a batch's lookup: every module whose input the batch shows, then the ids of all of them sharded.

    ``paths``: where in a batch the input of a module that cannot tell (a plain ``nn.Embedding``) was found;
    ``shard``: how the ids are bucketed and encoded for the shards (``PSClient.sharder()``), picklable like the rest;
    ``dedup``: how each module's ids are deduplicated (in the process that plans, unless an embedding worker does it).
    """

    planners: tuple[Planner, ...]
    paths: tuple[tuple[str, Path], ...]
    shard: Callable[[KeyedIds], Any]
    dedup: Deduplicate = keyed_unique

    def plan(self, batch: Any) -> PlannedBatch:
        paths = dict(self.paths)
        plans = []
        for planner in self.planners:
            path = paths.get(planner.key)
            features = at_path(batch, path) if path is not None else planner.find(batch)
            if features is not None and planner.accepts(features):  # a batch shaped otherwise is fetched in the forward
                plans.append(planner.plan(features, self.dedup))
        sharded = self.shard(KeyedIds.concat([p.unique for p in plans])) if plans else None
        return PlannedBatch(batch, tuple(plans), sharded)


class PlanningCollate:
    """A DataLoader ``collate_fn`` that also plans each batch's lookup, in the DataLoader's worker process."""

    def __init__(self, collate_fn: Callable[[Any], Any], planner: BatchPlanner) -> None:
        self.collate_fn = collate_fn
        self.planner = planner

    def __call__(self, samples: Any) -> PlannedBatch:
        return self.planner.plan(self.collate_fn(samples))
