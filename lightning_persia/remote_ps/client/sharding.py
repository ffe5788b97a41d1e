"""Ids of several tables bucketed by shard, split into messages under the limits, and encoded once.

A trainer shards a batch's ids once (:class:`Sharder`, picklable, so DataLoader workers can run it too) and
sends the result with the lookup and again with the update of the same ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import numpy as np
import torch

from lightning_persia.ops import wire
from lightning_persia.ops.bucketize import bucketize
from lightning_persia.ops.keyed_ids import Block, KeyedIds, RowLayout
from lightning_persia.ops.shard_map import ShardMap


@dataclass
class ShardMessage:
    """One message's share of a :class:`ShardedIds`: ids ``[start, end)`` of the shard order, with their tables."""

    shard: int
    start: int
    end: int
    tables: Tuple[str, ...]  # the tables it names, and their counts
    counts: Tuple[int, ...]
    table_counts: Tuple[int, ...]  # ids of every table of the KeyedIds in it (0 for the others)
    ids: bytes  # encoded once, sent with the lookup and again with the update of the same ids

    def blocks(self, layout: RowLayout) -> Iterator[Tuple[Block, int, int]]:
        """``(block, first row in shard order, rows)`` of each block of ``layout`` with ids in this message."""
        row = self.start
        for block, count in zip(layout.blocks, layout.block_counts(self.table_counts)):
            if count:
                yield block, row, count
                row += count


@dataclass(frozen=True)
class ShardedIds:
    """Ids of several tables bucketed by shard, split into messages and encoded: what :meth:`PSClient.shard` makes
    once per batch, for its lookup and its update.

    ``order[j]`` is the position in ``keyed`` of the ``j``-th id in shard order (None: one shard, the same order).
    """

    keyed: KeyedIds
    order: Optional[torch.Tensor]
    messages: Tuple[ShardMessage, ...]
    map_version: int = 0  # the version of the shard map the ids were routed by


@dataclass(frozen=True)
class Sharder:
    """Buckets ids by shard, splits them into messages under the limits and encodes them (see :meth:`PSClient.shard`)."""

    shard_map: ShardMap
    max_ids_per_message: int
    max_message_bytes: int
    max_dim: int  # the widest table's: sizes the messages

    def __call__(self, keyed: KeyedIds) -> ShardedIds:
        buckets = bucketize(keyed, self.shard_map)
        per_id = 8 + max(w.itemsize for w in wire.WIRE_DTYPES.values()) * self.max_dim
        step = max(1, min(self.max_ids_per_message, (self.max_message_bytes // 2) // per_id))
        messages = []
        for shard in range(self.shard_map.num_shards):
            first, last = buckets.starts[shard], buckets.starts[shard + 1]
            ends = np.cumsum(buckets.counts[shard])
            starts = ends - np.asarray(buckets.counts[shard])
            for start in range(first, max(last, first + 1), step):
                end = min(start + step, last)
                # shard 0's first message names every table, so that a table asked for no ids still gets its
                # dim (and unknown tables their NOT_FOUND)
                everything = shard == 0 and start == first
                counts = np.clip(ends, start - first, end - first) - np.clip(starts, start - first, end - first)
                keep = np.ones(len(counts), dtype=bool) if everything else counts > 0
                if not keep.any():
                    continue
                tables = tuple(t for t, k in zip(keyed.tables, keep) if k)
                messages.append(ShardMessage(shard, start, end, tables, tuple(counts[keep].tolist()), tuple(counts.tolist()),
                                             wire.encode_ids(buckets.ids[start:end])))
        return ShardedIds(keyed, buckets.order, tuple(messages), self.shard_map.version)
