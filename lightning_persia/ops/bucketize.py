"""Bucketing of several tables' ids by parameter-server shard, all tables at once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.ops.keyed_ids import KeyedIds


@dataclass(frozen=True)
class ShardBuckets:
    """The ids of a :class:`KeyedIds` grouped by shard, each shard's ids still table after table.

    ``ids`` is the KeyedIds' ids in shard order; shard ``s`` owns ``ids[starts[s]:starts[s + 1]]``, of which
    ``counts[s][t]`` belong to table ``t``. ``order[j]`` is the position in the KeyedIds of ``ids[j]``
    (``None``: one shard, the order is unchanged).
    """

    keyed: KeyedIds
    ids: torch.Tensor
    order: Optional[torch.Tensor]
    counts: list[list[int]]
    starts: list[int]

    @property
    def num_shards(self) -> int:
        return len(self.counts)


def bucketize(keyed: KeyedIds, shard_map: ShardMap) -> ShardBuckets:
    """Groups ``keyed``'s ids by the shard ``shard_map`` puts them on (a stable grouping)."""
    n, num_tables, num_shards = keyed.ids.numel(), len(keyed.tables), shard_map.num_shards
    if num_shards == 1:
        return ShardBuckets(keyed, keyed.ids, None, [list(keyed.counts)], [0, n])
    shards = shard_map.shard_of(keyed.ids)
    order = torch.argsort(shards, stable=True)
    per_table = torch.bincount(shards * num_tables + keyed.table_of_ids, minlength=num_shards * num_tables).view(num_shards, num_tables)
    starts = [0] + torch.cumsum(per_table.sum(1), 0).tolist()
    return ShardBuckets(keyed, keyed.ids.index_select(0, order), order, per_table.tolist(), starts)
