"""Promotions left to the demoter: a training lookup answers from disk and queues the rows it read (promotions.py)."""
import time

import torch

from lightning_persia.remote_ps.store.disk.tier import DiskTier
from lightning_persia.remote_ps.store.disk.promotions import PendingPromotion, PendingPromotions
from lightning_persia.remote_ps.store.shard_store import ShardStore
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

DIM = 4
COLD = torch.arange(50)
SLICE = 1 << 14


def _table(tmp_path, promote_later=True, capacity=100):
    config = TableConfig("t", DIM, optimizer=Adagrad(rowwise=True), capacity=capacity, storage="disk", storage_dtype="fp16")
    return Table(config, seed=0, disk_dir=str(tmp_path / "tier"), promote_later=promote_later)


def _grown(tmp_path, promote_later=True):
    """A table whose ids 0..199 are on disk (100..199 the coldest in memory before them), updated once each."""
    table = _table(tmp_path, promote_later)
    for batch in torch.arange(300).split(100):
        table.lookup(batch, train=True)
        table.update(batch, torch.ones(100, DIM))
    assert table.stats()["disk_rows"] == 200 and table.stats()["rows"] == 100
    return table


def test_the_queue_gives_the_oldest_rows_first_and_holds_at_most_its_limit():
    queue = PendingPromotions(limit=5)

    def batch(n, step):
        return PendingPromotion(torch.arange(n), torch.arange(n), torch.zeros(n, 8, dtype=torch.uint8), step, 0)

    queue.add(batch(3, step=1))
    assert queue.has_room(2) and not queue.has_room(3) and len(queue) == 3
    queue.add(batch(2, step=2))
    assert [queue.take(8).step, queue.take(8).step, queue.take(8)] == [1, 2, None] and len(queue) == 0
    queue.add(batch(4, step=3))
    head = queue.take(3)  # the first 3 rows of the batch; its last one stays first in the queue
    assert head.ids.tolist() == [0, 1, 2] and head.records.shape == (3, 8) and len(queue) == 1
    assert queue.take(3).ids.tolist() == [3] and len(queue) == 0
    queue.add(batch(4, step=4))
    queue.clear()
    assert len(queue) == 0 and queue.take(8) is None


def test_a_training_lookup_answers_from_disk_and_the_demoter_brings_the_rows_in(tmp_path, disk_tier_kernels):
    table = _grown(tmp_path)
    expected = table.lookup(COLD, train=False)
    assert torch.equal(table.lookup(COLD, train=True), expected)
    stats = table.stats()
    assert stats["pending_promotions"] == 50 and stats["disk_rows"] == 200 and stats["promoted"] == 0
    assert table.promote_pending(SLICE) == 50 and table.promote_pending(SLICE) == 0  # taken from the queue
    stats = table.stats()
    assert stats["pending_promotions"] == 0 and stats["promoted"] == 50 and stats["demoted"] == 250  # 50 made room
    assert stats["rows"] == 100 and stats["disk_rows"] == 200 and stats["inserted"] == 300  # moved, none admitted anew
    # they carry the step of the lookup that read them: hotter than the rows no lookup touched since they were
    # admitted, which the next new ids demote instead of them
    table.lookup(torch.arange(1000, 1050), train=True)
    assert torch.equal(table.lookup(COLD, train=True), expected)
    assert table.stats()["pending_promotions"] == 0  # still in memory: nothing read from disk


def test_new_ids_admitted_beside_queued_rows_leave_the_queued_rows_theirs(tmp_path, disk_tier_kernels):
    table = _grown(tmp_path)
    new = torch.arange(1000, 1030)
    expected = torch.cat([table.lookup(COLD[:20], train=False), _table(tmp_path / "fresh").lookup(new, train=False)])
    got = table.lookup(torch.cat([COLD[:20], new]), train=True)  # 20 read from disk and queued, 30 admitted
    assert torch.equal(got, expected)  # the queued ones keep their trained values: not admitted afresh
    stats = table.stats()
    assert stats["pending_promotions"] == 20 and stats["inserted"] == 330
    assert stats["rows"] + stats["disk_rows"] == 330  # each id once
    table.promote_pending(SLICE)
    assert table.stats()["rows"] + table.stats()["disk_rows"] == 330
    assert torch.equal(table.lookup(torch.cat([COLD[:20], new]), train=False), expected)


def test_rows_promoted_later_end_as_rows_promoted_at_once(tmp_path, disk_tier_kernels):
    later, now = _grown(tmp_path / "later"), _grown(tmp_path / "now", promote_later=False)
    for table in (later, now):
        table.lookup(COLD, train=True)
        table.promote_pending(SLICE)
        table.update(COLD, torch.full((50, DIM), 0.5))
        table.lookup(torch.arange(300, 400), train=True)  # demotes the coldest: the same rows in both
        table.promote_pending(SLICE)
    for ids in (torch.arange(400), COLD):
        assert torch.equal(later.lookup(ids, train=False), now.lookup(ids, train=False))
    assert later.stats()["disk_rows"] == now.stats()["disk_rows"]


def test_an_update_before_the_promotion_promotes_the_rows_itself_and_is_applied_once(tmp_path, disk_tier_kernels):
    later, now = _grown(tmp_path / "later"), _grown(tmp_path / "now", promote_later=False)
    for table in (later, now):
        table.lookup(COLD, train=True)
        table.update(COLD, torch.ones(50, DIM))
    assert later.promote_pending(SLICE) == 50 and later.stats()["promoted"] == 50  # the update brought them in
    assert torch.equal(later.lookup(COLD, train=False), now.lookup(COLD, train=False))
    assert later.stats()["promoted"] == now.stats()["promoted"] == 50


def test_a_row_that_moved_since_it_was_read_is_not_promoted_from_the_old_record(tmp_path, disk_tier_kernels):
    table = _grown(tmp_path)
    table.lookup(COLD, train=True)  # queued with their records as read
    table.update(COLD, torch.ones(50, DIM))  # promoted by the update and changed...
    table.lookup(torch.arange(200, 300), train=True)  # ...and demoted again, to new slots
    promoted = table.stats()["promoted"]
    assert table.promote_pending(SLICE) == 50 and table.stats()["promoted"] == promoted  # none from the old records
    updated = table.lookup(COLD, train=False)
    stats = table.stats()
    assert stats["rows"] + stats["disk_rows"] == 300
    assert torch.equal(table.lookup(COLD, train=True), updated)  # the update's values, not the queued records'


def test_a_row_removed_from_disk_since_it_was_read_is_not_brought_back(tmp_path, disk_tier_kernels):
    table = _grown(tmp_path)
    table.lookup(COLD, train=True)
    with table.lock:
        table.remove_ids_locked(COLD[:10])  # a delta drops them
    assert table.promote_pending(SLICE) == 50 and table.stats()["promoted"] == 40
    stats = table.stats()
    assert stats["rows"] + stats["disk_rows"] == 290


def test_a_batch_read_before_a_segment_number_was_written_anew_is_dropped(tmp_path, disk_tier_kernels, monkeypatch):
    table = _grown(tmp_path)
    expected = table.lookup(COLD, train=False)
    table.lookup(COLD, train=True)
    monkeypatch.setattr(DiskTier, "generation", property(lambda tier: 1))  # compaction deleted a segment, reopened
    assert table.promote_pending(SLICE) == 50 and table.stats()["pending_promotions"] == 0
    assert table.stats()["promoted"] == 0
    assert table.stats()["disk_rows"] == 200
    assert torch.equal(table.lookup(COLD, train=True), expected)  # read again, and queued again


def test_an_id_a_request_repeats_is_queued_once_and_a_full_queue_promotes_at_once(tmp_path, disk_tier_kernels, monkeypatch):
    table = _grown(tmp_path)
    expected = table.lookup(torch.tensor([3, 3, 4]), train=False)
    assert torch.equal(table.lookup(torch.tensor([3, 3, 4]), train=True), expected)
    assert table.stats()["pending_promotions"] == 2
    monkeypatch.setattr(PendingPromotions, "has_room", lambda queue, n: False)
    assert torch.equal(table.lookup(torch.tensor([5, 5, 6]), train=True), table.lookup(torch.tensor([5, 5, 6]), train=False))
    assert table.stats()["promoted"] == 2 and table.stats()["pending_promotions"] == 2  # 5 and 6 brought in at once


def test_a_batch_larger_than_a_slice_is_promoted_a_slice_at_a_time(tmp_path, disk_tier_kernels):
    table = _grown(tmp_path)
    table.lookup(COLD, train=True)
    assert [table.promote_pending(20), table.promote_pending(20), table.promote_pending(20), table.promote_pending(20)] == [20, 20, 10, 0]
    assert table.stats()["promoted"] == 50 and table.stats()["pending_promotions"] == 0


def test_a_dropped_table_forgets_its_queue(tmp_path, disk_tier_kernels):
    table = _grown(tmp_path)
    table.lookup(COLD, train=True)
    table.close()
    assert table.stats()["pending_promotions"] == 0 and table.promote_pending(SLICE) == 0


def test_a_shard_with_a_demoter_leaves_promotions_to_it_and_one_without_promotes_at_once(tmp_path, disk_tier_kernels):
    config = TableConfig("t", DIM, optimizer=Adagrad(rowwise=True), capacity=100, storage="disk", storage_dtype="fp16")
    intervals = {"idle demoter": 3600.0, "no demoter": None, "demoter": 0.01}
    stores = {name: ShardStore(0, 1, seed=0, disk_dir=str(tmp_path / name), demotion_interval_s=interval)
              for name, interval in intervals.items()}
    for store in stores.values():
        store.configure(config)
        for batch in torch.arange(300).split(100):
            store.lookup("t", batch, train=True)
            store.update("t", batch, torch.ones(100, DIM))
        store.lookup("t", COLD, train=True)
    assert stores["idle demoter"].stats()["t"]["pending_promotions"] == 50  # queued, no pass ran
    assert stores["no demoter"].stats()["t"]["pending_promotions"] == 0  # the lookup promoted them itself
    deadline = time.monotonic() + 30
    while stores["demoter"].stats()["t"]["pending_promotions"] and time.monotonic() < deadline:
        time.sleep(0.01)
    for name in ("no demoter", "demoter"):
        stats = stores[name].stats()["t"]
        assert stats["pending_promotions"] == 0 and stats["promoted"] >= 50, name
    expected = stores["no demoter"].lookup("t", torch.arange(300), train=False)
    for store in stores.values():
        assert torch.equal(store.lookup("t", torch.arange(300), train=False), expected)
