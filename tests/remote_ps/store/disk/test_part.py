"""A table's disk part (disk/part.py): rows demoted and promoted with their values, requests over the memory budget
refused, a full disk failing only the request that needs it, deltas on disk rows, its work timed; a memory table's
NoDisk answers alike."""
import errno
import os

import pytest
import torch

from lightning_persia.remote_ps.store import eviction
from lightning_persia.remote_ps.store.disk import records as disk_records
from lightning_persia.remote_ps.store.disk.part import DiskPart, NoDisk
from lightning_persia.remote_ps.store.disk.tier import DiskTierError
from lightning_persia.remote_ps.store.errors import InvalidRequestError, StoreError
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

DIM = 4


def _table(tmp_path, capacity=1000):
    config = TableConfig("t", DIM, optimizer=Adagrad(rowwise=True), capacity=capacity, storage="disk", storage_dtype="fp16")
    return Table(config, seed=0, disk_dir=str(tmp_path / "tier"))


def _tables(tmp_path):
    memory = Table(TableConfig("m", DIM, capacity=1000), seed=0)
    disk = Table(TableConfig("d", DIM, capacity=1000, storage="disk"), seed=0, disk_dir=str(tmp_path / "tier"))
    return memory, disk


@pytest.mark.usefixtures("disk_tier_kernels")
def test_a_memory_table_has_no_disk_and_its_statistics_have_the_disk_table_s_keys(tmp_path):
    memory, disk = _tables(tmp_path)
    assert isinstance(memory.disk, NoDisk) and isinstance(disk.disk, DiskPart)
    for table in (memory, disk):
        for batch in torch.arange(1200).split(600):  # 200 past the capacity: evicted, or demoted
            table.lookup(batch, train=True)
    memory_stats, disk_stats = memory.stats(), disk.stats()
    assert memory_stats.keys() == disk_stats.keys()
    assert memory_stats["demoted"] == memory_stats["disk_rows"] == memory_stats["pending_promotions"] == 0
    assert memory_stats["evicted"] >= 200 and disk_stats["demoted"] == disk_stats["disk_rows"] == 200


@pytest.mark.usefixtures("disk_tier_kernels")
def test_a_memory_table_evicts_a_bulk_and_a_disk_table_demotes_what_it_needs(tmp_path):
    memory, disk = _tables(tmp_path)
    assert memory.disk.evict_count(10) == eviction.bulk_size(10, 1000) > 10
    assert disk.disk.evict_count(10) == 10


def test_attaching_segments_to_a_memory_table_is_refused_naming_it():
    table = Table(TableConfig("m", DIM, capacity=10), seed=0)
    with pytest.raises(StoreError, match="table 'm' has no disk tier"):
        table.disk.attach([])


@pytest.mark.usefixtures("disk_tier_kernels")
def test_a_training_lookup_that_repeats_an_id_on_disk_promotes_it_once(tmp_path):
    table = _table(tmp_path, capacity=1000)
    for i in range(0, 3000, 500):
        table.lookup(torch.arange(i, i + 500), train=True)
    cold = torch.tensor([3, 7, 3, 11, 7])  # on disk (the coldest), two of them twice
    expected = table.lookup(cold, train=False)
    promoted = table.stats()["promoted"]
    assert torch.equal(table.lookup(cold, train=True), expected)
    stats = table.stats()
    assert stats["promoted"] == promoted + 3 and stats["rows"] + stats["disk_rows"] == 3000
    assert torch.equal(table.lookup(cold, train=False), expected)  # from memory now, one row each



@pytest.mark.usefixtures("disk_tier_kernels")
def test_table_demotes_then_promotes_with_values_and_state(tmp_path):
    table = _table(tmp_path, capacity=1000)
    ids = torch.arange(5000)
    first = torch.cat([table.lookup(ids[i : i + 500], train=True) for i in range(0, 5000, 500)])
    for i in range(0, 5000, 500):
        table.update(ids[i : i + 500], torch.ones(500, DIM))
    stats = table.stats()
    assert stats["rows"] <= 1000 and stats["rows"] + stats["disk_rows"] == 5000 and stats["demoted"] >= 4000
    assert stats["promoted"] >= 4000 and stats["dropped_update_rows"] == 0  # updates bring their demoted rows back
    for i in range(1000, 5000, 500):  # the rows looked up last stay in memory: ids[:1000] are on disk
        table.lookup(ids[i : i + 500], train=True)
    stats = table.stats()
    # evaluation lookups read from disk without bringing rows back; training lookups bring them back, unchanged
    cold = ids[:500]
    seen = table.lookup(cold, train=False)
    assert table.stats()["promoted"] == stats["promoted"]
    assert not torch.allclose(seen, first[:500])  # the update reached them
    assert torch.equal(table.lookup(cold, train=True), seen)
    assert table.stats()["promoted"] == stats["promoted"] + 500
    # an update of rows demoted since their lookup is applied, not dropped: they come back for it
    table.lookup(ids[4000:5000], train=True)  # demotes the 500 just promoted
    before = table.lookup(cold, train=False)
    assert table.update(cold, torch.ones(500, DIM)) == 500
    assert table.stats()["dropped_update_rows"] == 0
    assert not torch.allclose(table.lookup(cold, train=False), before)



@pytest.mark.usefixtures("disk_tier_kernels")
def test_a_request_larger_than_the_budget_is_refused_whole(tmp_path):
    table = _table(tmp_path, capacity=100)
    table.lookup(torch.arange(50), train=True)
    with pytest.raises(InvalidRequestError, match="request of 101 ids is larger than the table's memory budget of 100 rows"):
        table.lookup(torch.arange(101), train=True)
    with pytest.raises(InvalidRequestError, match="memory budget"):
        table.update(torch.arange(101), torch.ones(101, DIM))
    assert table.stats()["rows"] == 50 and table.stats()["inserted"] == 50



@pytest.mark.usefixtures("disk_tier_kernels")
def test_a_full_disk_fails_the_inserting_lookup_only(tmp_path, monkeypatch):
    table = _table(tmp_path, capacity=100)
    kept = torch.arange(100)
    values = table.lookup(kept, train=True)

    def full(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_records.os, "pwrite", full)
    with pytest.raises(DiskTierError, match="No space left on device"):
        table.lookup(torch.arange(100, 150), train=True)  # rows must leave memory for them: the disk refuses
    assert torch.equal(table.lookup(kept, train=True), values)  # what is stored still serves, nothing lost
    assert table.stats()["rows"] == 100 and table.stats()["disk_rows"] == 0



@pytest.mark.usefixtures("disk_tier_kernels")
def test_a_delta_replaces_or_removes_rows_on_disk(tmp_path):
    table = _table(tmp_path, capacity=100)
    for batch in torch.arange(300).split(100):
        table.lookup(batch, train=True)
    on_disk = torch.arange(10)  # looked up first: demoted since
    assert table.stats()["disk_rows"] == 200
    n = on_disk.numel()
    with table.lock:
        table.upsert_locked({"ids": on_disk, "weights": torch.ones(n, DIM), "state": torch.zeros(n, 1),
                             "access": torch.zeros(n, dtype=torch.int32)})
        table.remove_ids_locked(torch.arange(10, 20))
    # the ten replaced now live in memory (ten others demoted for them), the ten removed are gone
    assert table.stats()["disk_rows"] == 200 - 10 + 10 - 10
    assert torch.equal(table.lookup(on_disk, train=False), torch.ones(n, DIM, dtype=torch.float32))
    fresh = Table(TableConfig("t", DIM, storage_dtype="fp16"), seed=0).lookup(torch.arange(10, 20), train=False)
    assert torch.equal(table.lookup(torch.arange(10, 20), train=False), fresh)  # removed: its initial row again




@pytest.mark.usefixtures("disk_tier_kernels")
def test_the_disk_tiers_worst_work_is_timed_per_request_and_zero_without_disk_work(tmp_path):
    table = _table(tmp_path, capacity=1000)
    table.lookup(torch.arange(800), train=True)
    assert table.stats()["worst_disk_work_cpu_s"] == 0.0 and table.stats()["worst_disk_work_of"] == ""  # nothing yet
    table.lookup(torch.arange(800, 20000), train=False)  # evaluation: misses, nothing on disk to read
    table.lookup(torch.arange(1000, 1900), train=True)  # demotes rows past the budget
    demoting = table.stats()["worst_disk_work_cpu_s"]
    assert demoting > 0.0 and table.stats()["demoted"] > 0 and table.stats()["worst_disk_work_of"] == "lookup"
    table.lookup(torch.arange(0, 900), train=True)  # reads and promotes them back
    assert table.stats()["worst_disk_work_cpu_s"] >= demoting
