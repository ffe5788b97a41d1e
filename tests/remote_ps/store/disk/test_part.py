"""A table's disk part (disk/part.py): a disk table's DiskPart and a memory table's NoDisk answer alike."""
import pytest
import torch

from lightning_persia.remote_ps.store import eviction
from lightning_persia.remote_ps.store.disk.part import DiskPart, NoDisk
from lightning_persia.remote_ps.store.errors import InvalidRequestError, StoreError
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import TableConfig

DIM = 4


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


@pytest.mark.usefixtures("disk_tier_kernels")
def test_a_training_request_over_a_disk_table_s_memory_budget_is_refused_naming_it(tmp_path):
    memory, disk = _tables(tmp_path)
    memory.lookup(torch.arange(2000), train=True)  # a memory table evicts what does not fit
    with pytest.raises(InvalidRequestError, match="table 'd': a request of 2000 ids is larger than"):
        disk.lookup(torch.arange(2000), train=True)
    with pytest.raises(InvalidRequestError, match="table 'd': a request of 2000 ids"):
        disk.update(torch.arange(2000), torch.ones(2000, DIM))
    assert disk.stats()["rows"] == 0


def test_attaching_segments_to_a_memory_table_is_refused_naming_it():
    table = Table(TableConfig("m", DIM, capacity=10), seed=0)
    with pytest.raises(StoreError, match="table 'm' has no disk tier"):
        table.disk.attach([])
