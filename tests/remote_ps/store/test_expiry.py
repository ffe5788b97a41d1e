"""Time to live: rows untouched for a number of lookups or seconds are deleted in bulk, in memory and on disk."""
import pytest
import torch

from lightning_persia.remote_ps.store.expiry import StepClock, TimeToLive, expiry_step
from lightning_persia.remote_ps.store.shard_store import ShardStore
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import ConfigError, TableConfig

DIM = 4


def test_the_step_clock_turns_seconds_into_steps():
    clock = StepClock()
    clock.record(10.0, 5)
    clock.record(20.0, 50)
    assert clock.step_at(9.0) is None and clock.step_at(10.0) == 5 and clock.step_at(25.0) == 50
    assert expiry_step(100, 25.0, clock, ttl_steps=None, ttl_seconds=10.0) == 5  # the step 10 s ago
    assert expiry_step(100, 25.0, clock, ttl_steps=30, ttl_seconds=10.0) == 70  # the stricter of the two
    assert expiry_step(100, 25.0, clock, ttl_steps=None, ttl_seconds=100.0) is None  # nothing recorded that early


def test_rows_untouched_for_ttl_steps_are_deleted_and_the_others_kept():
    table = Table(TableConfig("t", DIM, ttl_steps=3), seed=0)
    old, recent = torch.arange(0, 100), torch.arange(100, 150)
    old_values = table.lookup(old, train=True)
    for _ in range(4):
        table.lookup(recent, train=True)
    recent_values = table.lookup(recent, train=False)
    assert table.expire(now=0.0) == 100
    stats = table.stats()
    assert stats["rows"] == 50 and stats["expired"] == 100
    assert torch.equal(table.lookup(recent, train=False), recent_values)
    # an expired id is new again: deterministic initial row, admitted anew
    assert torch.equal(table.lookup(old, train=True), old_values)
    assert table.stats()["inserted"] == 250


def test_rows_untouched_for_ttl_seconds_are_deleted():
    table = Table(TableConfig("t", DIM, ttl_seconds=10.0), seed=0)
    table.lookup(torch.arange(10), train=True)
    assert table.expire(now=100.0) == 0  # records step 1 at t=100
    table.lookup(torch.arange(10, 20), train=True)
    assert table.expire(now=105.0) == 0  # 5 s: nothing is 10 s old yet
    assert table.expire(now=112.0) == 10  # the rows last touched at or before t=102 (step 1): the first ten
    assert table.stats()["rows"] == 10


@pytest.mark.usefixtures("disk_tier_kernels")
def test_a_disk_table_expires_rows_on_disk_too(tmp_path):
    store = ShardStore(0, 1, disk_dir=str(tmp_path))
    store.configure(TableConfig("t", DIM, capacity=100, storage="disk", ttl_steps=5))
    for batch in torch.arange(1000).split(100):
        store.lookup("t", batch, train=True)
    stats = store.stats()["t"]  # the demoter may have moved a few more rows to disk: memory keeps headroom
    assert stats["disk_rows"] + stats["rows"] == 1000 and stats["disk_rows"] >= 900
    assert store.expire(now=0.0) == 500  # steps 1..5 of 10: the first 500 ids, all on disk now
    stats = store.stats()["t"]
    assert stats["disk_rows"] + stats["rows"] == 500 and stats["disk_rows"] >= 400

    assert store.lookup("t", torch.arange(500, 1000), train=False).abs().sum() > 0


def test_a_ttl_needs_lru_access_values():
    with pytest.raises(ConfigError, match="a TTL needs eviction 'lru'"):
        TableConfig("t", DIM, ttl_steps=3, eviction="lfu")
    with pytest.raises(ConfigError, match="ttl_steps must be a positive number"):
        TableConfig("t", DIM, ttl_steps=0)


def test_a_table_without_a_ttl_expires_nothing_and_its_part_gives_no_limit():
    config = TableConfig("t", 4)
    assert TimeToLive(config).limit(now=1e9, step=10**6) is None
    table = Table(config, seed=0)
    table.lookup(torch.arange(10), train=True)
    assert table.expire(now=1e9) == 0 and table.stats()["rows"] == 10
