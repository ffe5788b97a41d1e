"""A memory limit shared out among a shard's disk tables' mappings: what the limit leaves, less its margin."""
import pytest
import torch

from lightning_persia.remote_ps.store.disk import segment_mapping, tier as disk_tier
from lightning_persia.remote_ps.store.disk.demoter import Demoter
from lightning_persia.remote_ps.store.disk.mapped_budget import MARGIN, MappedBudget, resident_bytes
from lightning_persia.remote_ps.store.shard_store import ShardStore
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import TableConfig

MB = 1 << 20


class _Mapping:
    """A table as the budget sees it: what it maps and the budget it was given."""

    def __init__(self, mapped_bytes: int) -> None:
        self.mapped_bytes = mapped_bytes
        self.budget = None

    def set_mapped_budget(self, nbytes: int) -> None:
        self.budget = nbytes


def test_the_room_under_the_limit_less_its_margin_is_shared_equally_on_top_of_what_each_maps():
    limit = 1024 * MB
    tables = [_Mapping(100 * MB), _Mapping(0)]
    MappedBudget(limit, resident=lambda: 500 * MB).apply(tables)  # 400 MB of it rows, maps and buffers
    room = int(limit * (1 - MARGIN)) - 500 * MB
    assert [t.budget for t in tables] == [100 * MB + room // 2, room // 2]


def test_a_shard_over_its_limit_has_its_mappings_give_back_the_excess_and_none_goes_below_nothing():
    limit = 1024 * MB
    tables = [_Mapping(300 * MB), _Mapping(10 * MB)]
    MappedBudget(limit, resident=lambda: 1200 * MB).apply(tables)
    excess = 1200 * MB - int(limit * (1 - MARGIN))
    assert tables[0].budget == 300 * MB - excess // 2
    assert tables[1].budget == 0


def test_no_disk_tables_is_nothing_to_share_and_a_limit_of_nothing_is_refused():
    MappedBudget(MB, resident=lambda: 0).apply([])
    with pytest.raises(ValueError, match="a memory limit must be > 0 bytes, got 0"):
        MappedBudget(0)


def test_the_resident_memory_read_is_the_processes_rss():
    with open("/proc/self/status") as status:
        rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    assert abs(resident_bytes() - rss_kb * 1024) < 64 * MB


@pytest.mark.usefixtures("disk_tier_kernels")
def test_the_demoter_maps_a_table_s_segments_up_to_what_the_limit_leaves_and_gives_back_past_it(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "SEGMENT_SHIFT", 10)
    monkeypatch.setattr(disk_tier, "SEGMENT_ROWS", 1 << 10)
    monkeypatch.setattr(segment_mapping, "_SHRINK_SLACK", 0)
    table = Table(TableConfig("t", 4, capacity=1024, storage="disk", storage_dtype="fp16"), seed=0, disk_dir=str(tmp_path / "tier"))
    for first in range(0, 4 * 1024, 512):
        table.lookup(torch.arange(first, first + 512), train=True)  # ~3k rows demoted: three segments and a part
    table.lookup(torch.arange(4 * 1024), train=False)  # every segment read
    limit = 1 << 30
    others = [0]  # the shard's memory other than its mapped records
    demoter = Demoter(lambda: [table], mapped_budget=MappedBudget(limit, resident=lambda: others[0] + table.disk.mapped_bytes))
    for _ in range(8):
        demoter.run_once()
    demoted = table.stats()["demoted"]
    assert demoted > 3 * 1024 and table.disk.mapped_bytes % demoted == 0  # room for all: every record written is mapped
    segment = 1024 * table.disk.mapped_bytes // demoted
    before = table.lookup(torch.arange(4 * 1024), train=False)
    others[0] = int(limit * (1 - MARGIN)) - segment  # the rows grew: the limit now leaves one segment's room
    for _ in range(8):
        demoter.run_once()
    stats = table.stats()
    assert table.disk.mapped_bytes == segment == stats["disk_mapped_budget_bytes"]
    assert torch.equal(table.lookup(torch.arange(4 * 1024), train=False), before)  # the unmapped ones read with pread


def test_a_memory_limit_needs_the_demoter_that_sizes_the_mappings():
    with pytest.raises(ValueError, match="a memory limit sizes the disk tables' mappings in the demoter's passes"):
        ShardStore(0, 1, memory_limit_bytes=1 << 30, demotion_interval_s=None)
