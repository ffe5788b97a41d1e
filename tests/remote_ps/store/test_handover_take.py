"""What a taking shard does with a page of rows: writes it a slice at a time, the table serving between slices."""
import torch

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.store import ShardStore, handover
from lightning_persia.remote_ps.store.wal.changes import Change, TableChange
from lightning_persia.remote_ps.table_config import SGD, TableConfig, Uniform


def test_a_taker_writes_a_page_a_slice_at_a_time_with_the_table_free_between(monkeypatch):
    monkeypatch.setattr(handover, "_TAKEN_A_RECORD", 100)
    config = TableConfig("t", 4, optimizer=SGD(lr=1.0), init=Uniform(-1, 1))
    source, taker = ShardStore(0, 2, seed=7), ShardStore(1, 2, seed=7)
    for store in (source, taker):
        store.configure(config)
    ids = torch.arange(20_000) * 7919 + 5
    mine = ids[ShardMap.uniform(2).shard_of(ids) == 0]
    source.lookup("t", mine, train=True)
    to_map = ShardMap(tuple(1 if slot % 4 == 0 else owner for slot, owner in enumerate(ShardMap.uniform(2).owners)), 1)
    moving = mine[to_map.shard_of(mine) == 1]
    expected = source.lookup("t", moving, train=False)

    writes = []  # (rows written, whether the table's lock was free when the write began)
    record = ShardStore._record

    def watched(store, changes):
        writes.append((sum(c.rows["ids"].numel() for c in changes if c.rows), not store._table("t").lock.locked()))
        return record(store, changes)

    monkeypatch.setattr(ShardStore, "_record", watched)
    page = [Change([TableChange(name.name, step, rows=rows)]) for name, step, rows in source.begin_handover(to_map)]
    taker.take_changes([config], page, to_map)

    assert sum(rows for rows, _ in writes) == moving.numel() > 1000
    assert max(rows for rows, _ in writes) == 100 and all(free for _, free in writes)
    taker.adopt_map(to_map)
    torch.testing.assert_close(taker.lookup("t", moving, train=False), expected, rtol=0, atol=0)
