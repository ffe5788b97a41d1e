"""Rows of several tables in one flat tensor: blocks of one width, and their bucketing by shard."""
from __future__ import annotations

import torch

from lightning_persia.ops.bucketize import bucketize
from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.ops.keyed_ids import KeyedIds, RowLayout


def test_consecutive_tables_of_one_width_make_one_block():
    layout = RowLayout(counts=[2, 1, 4, 3], dims=[16, 16, 8, 16])
    assert [(b.first_table, b.end_table, b.dim, b.first_row, b.end_row, b.offset) for b in layout.blocks] == [
        (0, 2, 16, 0, 3, 0), (2, 3, 8, 3, 7, 48), (3, 4, 16, 7, 10, 80)]
    assert layout.numel == 128 and layout.table_offsets() == [0, 32, 48, 80, 128]
    assert layout.block_counts([1, 1, 2, 0]) == [2, 2, 0]
    flat = torch.arange(128.0)
    assert layout.blocks[1].of(flat).shape == (4, 8) and layout.blocks[1].of(flat)[0, 0] == 48


def test_bucketize_groups_ids_by_shard_keeping_tables_in_order():
    keyed = KeyedIds(("a", "b"), (50, 30), torch.arange(80) * 7919)
    shard_map = ShardMap.uniform(2).resized(3)
    buckets = bucketize(keyed, shard_map)
    shards = shard_map.shard_of(keyed.ids)
    for shard in range(3):
        mine = buckets.ids[buckets.starts[shard] : buckets.starts[shard + 1]]
        expected = keyed.ids[shards == shard]  # stable: table a's ids first, in order
        assert torch.equal(mine, expected)
        assert buckets.counts[shard] == [int((shards[:50] == shard).sum()), int((shards[50:] == shard).sum())]
    assert torch.equal(keyed.ids[buckets.order], buckets.ids)
    single = bucketize(keyed, ShardMap.uniform(1))
    assert single.order is None and single.counts == [[50, 30]] and single.starts == [0, 80]
