"""Which rows read from disk a training lookup promotes: the filter of recent reads, the policy, and a disk table
that leaves a row read once after a long time on disk and promotes it when read again soon."""
from __future__ import annotations

import pytest
import torch

from lightning_persia.remote_ps.store.promotion_policy import PromotionPolicy, RecentReads
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

pytestmark = pytest.mark.usefixtures("disk_tier_kernels")


def test_recent_reads_remember_ids_for_a_window_then_forget_them():
    recent = RecentReads(1 << 16)
    ids = torch.arange(1000) * 7919
    recent.add(ids, step=10, window=100)
    assert bool(recent.seen(ids).all())
    assert int(recent.seen(ids + 1).sum()) <= 5  # other ids: only where both their bits are shared
    recent.add(ids[:0], step=60, window=100)  # half the window on: a newer generation begins, the older stays
    assert bool(recent.seen(ids).all())
    recent.add(ids[:0], step=110, window=100)  # and again: the generation that held them is cleared
    assert not bool(recent.seen(ids).any())


def test_recent_reads_need_a_power_of_two_of_bits():
    with pytest.raises(ValueError, match="power of two of at least 8 bits, got 1000"):
        RecentReads(1000)


def test_the_policy_promotes_every_row_until_the_demoter_reports_its_threshold():
    policy = PromotionPolicy(capacity=1000)
    assert bool(policy.promotes(torch.arange(5), torch.zeros(5, dtype=torch.int32), step=10_000).all())


def test_the_policy_promotes_rows_touched_within_its_window_or_read_again_within_it():
    policy = PromotionPolicy(capacity=1000)
    policy.demoting_at(100)  # at step 120 the horizon is 20 steps, the window 30
    access = torch.tensor([95, 90, 89, 10], dtype=torch.int32)
    assert policy.promotes(torch.arange(4), access, step=120).tolist() == [True, True, False, False]
    assert policy.promotes(torch.arange(4), access, step=121).tolist() == [True, True, True, True]  # read again
    assert not bool(policy.promotes(torch.tensor([50]), torch.tensor([10], dtype=torch.int32), step=122).any())


def _grown(tmp_path, rows=300_000, batch=10_000):
    """A 100k-row LRU disk table grown to ``rows`` ids, ``batch`` a lookup, the oldest on disk, and the ids."""
    config = TableConfig("t", 4, optimizer=Adagrad(rowwise=True), capacity=100_000, storage="disk", storage_dtype="fp16")
    table = Table(config, seed=0, disk_dir=str(tmp_path / "tier"))
    ids = torch.arange(rows) * 3
    for part in ids.split(batch):
        table.lookup(part, train=True)
    return table, ids


def test_a_disk_table_leaves_a_row_read_long_after_its_last_touch_on_disk_until_read_again(tmp_path):
    table, ids = _grown(tmp_path)
    table.demote(1000)  # as the demoter does: memory's coldest rows are lookup 21's, a horizon of 10 lookups
    first, recent = ids[:100], ids[175_000:175_100]  # touched at lookup 1, and at lookup 18 of 30
    expected = table.lookup(torch.cat([first, recent]), train=False)
    before = table.stats()

    answer = table.lookup(torch.cat([first, recent]), train=True)
    after = table.stats()
    assert torch.equal(answer, expected)
    assert after["left_on_disk"] - before["left_on_disk"] == 100 and after["promoted"] - before["promoted"] == 100
    assert after["disk_rows"] == before["disk_rows"] - 100

    assert torch.equal(table.lookup(first, train=True), expected[:100])  # read again soon: promoted
    again = table.stats()
    assert again["promoted"] - after["promoted"] == 100 and again["left_on_disk"] == after["left_on_disk"]
    assert torch.equal(table.lookup(first, train=False), expected[:100])


def test_a_disk_table_evicting_by_lfu_promotes_every_row_it_reads(tmp_path):
    config = TableConfig("t", 4, optimizer=Adagrad(rowwise=True), capacity=100_000, storage="disk", storage_dtype="fp16",
                         eviction="lfu")
    table = Table(config, seed=0, disk_dir=str(tmp_path / "tier"))
    ids = torch.arange(300_000) * 3
    for part in ids.split(10_000):
        table.lookup(part, train=True)
    table.demote(1000)
    before = table.stats()
    table.lookup(ids[:100], train=True)
    after = table.stats()
    assert after["promoted"] - before["promoted"] == 100 and after["left_on_disk"] == 0
