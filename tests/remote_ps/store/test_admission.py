"""Admission after k sightings: a counting filter, no row per unseen id; either storage."""
import pytest
import torch

from lightning_persia.ops.hashing import slot_of
from lightning_persia.ops.shard_map import SLOTS
from lightning_persia.remote_ps.store.admission import CountingFilter
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import ConfigError, TableConfig

DIM = 4


def test_counts_rise_per_sighting_and_decay_with_traffic():
    counts = CountingFilter(1 << 16)
    assert counts.add(torch.tensor([7, 8])).tolist() == [1, 1]
    assert counts.add(torch.tensor([7])).tolist() == [2]
    assert counts.add(torch.tensor([7, 9])).tolist() == [3, 1]
    others = torch.arange(1000, 1000 + (1 << 17))
    others = others[slot_of(others, SLOTS) != slot_of(torch.tensor([7]), SLOTS)][: 1 << 16]  # none shares 7's counters
    counts.add(others)  # as many sightings as counters: every counter halves
    assert counts.add(torch.tensor([7])).tolist() == [2]


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_an_id_is_stored_at_its_kth_lookup_and_served_its_initial_row_before(tmp_path, storage, request):
    if storage == "disk":
        request.getfixturevalue("disk_tier_kernels")
    config = TableConfig("t", DIM, admit_after=3, storage=storage, capacity=1000)
    table = Table(config, seed=0, disk_dir=str(tmp_path / "tier") if storage == "disk" else None)
    reference = Table(TableConfig("t", DIM), seed=0)
    ids = torch.arange(50)
    first = table.lookup(ids, train=True)
    assert torch.equal(first, reference.lookup(ids, train=True))  # the initial rows, as any table gives them
    assert table.stats()["rows"] == 0 and table.stats()["not_admitted"] == 50
    table.lookup(ids[:20], train=True)
    assert table.stats()["rows"] == 0
    table.lookup(ids[:10], train=True)  # the third sighting of ids 0..9
    assert table.stats()["rows"] == 10
    assert table.update(ids, torch.ones(50, DIM)) == 10  # only stored rows learn


def test_admit_after_is_checked():
    with pytest.raises(ConfigError, match="admit_after must be in 1..255"):
        TableConfig("t", DIM, admit_after=0)
