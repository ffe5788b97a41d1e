"""The demoter: a disk table's memory tier kept below its budget off the request path; mapped pages released."""
import errno
import os
import time

import pytest
import torch

from lightning_persia.remote_ps.store import eviction
from lightning_persia.remote_ps.store.disk import tier as disk_tier
from lightning_persia.remote_ps.store.disk.demoter import HEADROOM_FRACTION, Demoter, demotion_target
from lightning_persia.remote_ps.store.shard_store import ShardStore
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

pytestmark = pytest.mark.usefixtures("disk_tier_kernels")

DIM = 4
CAPACITY = 1600
HEADROOM = int(CAPACITY * HEADROOM_FRACTION)


def _table(tmp_path):
    config = TableConfig("t", DIM, optimizer=Adagrad(rowwise=True), capacity=CAPACITY, storage="disk", storage_dtype="fp16")
    return Table(config, seed=0, disk_dir=str(tmp_path / "tier"))


def test_the_target_starts_at_half_the_headroom_and_goes_down_to_all_of_it():
    assert demotion_target(1600, 1600 - HEADROOM // 2) == 0
    assert demotion_target(1600, 1600 - HEADROOM // 2 + 1) == HEADROOM // 2 + 1
    assert demotion_target(1600, 1600) == HEADROOM
    assert demotion_target(1600, 0) == 0


def test_a_pass_leaves_headroom_and_requests_then_demote_nothing(tmp_path):
    table = _table(tmp_path)
    ids = torch.arange(CAPACITY)
    before = table.lookup(ids, train=True)
    assert table.stats()["demoted"] == 0  # a full budget is no excess yet: the request demoted nothing
    assert Demoter(lambda: [table]).run_once() == HEADROOM
    stats = table.stats()
    assert stats["rows"] == CAPACITY - HEADROOM and stats["disk_rows"] == HEADROOM and stats["demoted"] == HEADROOM
    table.lookup(torch.arange(CAPACITY, CAPACITY + HEADROOM), train=True)  # fits in the headroom
    assert table.stats()["demoted"] == HEADROOM
    assert torch.equal(table.lookup(ids, train=False), before)  # the demoted rows read back from disk


def test_a_request_past_the_headroom_demotes_what_it_needs_only(tmp_path):
    table = _table(tmp_path)
    table.lookup(torch.arange(CAPACITY), train=True)
    table.lookup(torch.arange(CAPACITY, CAPACITY + 10), train=True)
    stats = table.stats()
    assert stats["rows"] == CAPACITY and stats["demoted"] == 10


def test_a_failed_demotion_is_counted_and_the_table_serves_on(tmp_path, monkeypatch):
    table = _table(tmp_path)
    table.lookup(torch.arange(CAPACITY), train=True)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("lightning_persia.remote_ps.store.disk.tier.write_all", full)
    demoter = Demoter(lambda: [table])
    assert demoter.run_once() == 0 and demoter.errors == 1
    assert table.stats()["rows"] == CAPACITY and table.stats()["disk_rows"] == 0  # nothing moved, nothing lost
    assert table.lookup(torch.arange(10), train=False).abs().sum() > 0


def test_a_closed_table_is_left_alone(tmp_path):
    table = _table(tmp_path)
    table.lookup(torch.arange(CAPACITY), train=True)
    table.close()
    assert table.demote(100) == 0


def test_the_thread_demotes_on_its_own(tmp_path):
    table = _table(tmp_path)
    table.lookup(torch.arange(CAPACITY), train=True)
    demoter = Demoter(lambda: [table], interval_s=0.001)
    demoter.start()
    try:
        for _ in range(2000):
            if table.stats()["disk_rows"] == HEADROOM:
                break
            time.sleep(0.005)
    finally:
        demoter.stop()
    assert table.stats()["disk_rows"] == HEADROOM


def test_a_shard_counts_the_cpu_of_its_demoter_s_passes(tmp_path):
    store = ShardStore(0, 1, disk_dir=str(tmp_path / "disk"), demotion_interval_s=0.001)
    assert store.background_cpu_s() == {"demoter": 0.0, "expirer": 0.0}  # no disk table yet: no thread, no pass
    store.configure(TableConfig("t", DIM, optimizer=Adagrad(rowwise=True), capacity=CAPACITY, storage="disk", storage_dtype="fp16"))
    store.lookup("t", torch.arange(CAPACITY), train=True)
    for _ in range(2000):  # a pass's CPU is counted once the pass returns, after its demotions
        used = store.background_cpu_s()
        if store.stats()["t"]["disk_rows"] == HEADROOM and used["demoter"] > 0.0:
            break
        time.sleep(0.005)
    assert store.stats()["t"]["disk_rows"] == HEADROOM and used["demoter"] > 0.0 and used["expirer"] == 0.0


def test_a_demotion_samples_the_access_values_without_the_lock(tmp_path, monkeypatch):
    config = TableConfig("t", DIM, optimizer=Adagrad(rowwise=True), capacity=100_000, storage="disk", storage_dtype="fp16")
    table = Table(config, seed=0, disk_dir=str(tmp_path / "tier"))
    table.lookup(torch.arange(100_000), train=True)  # more rows than a sample: the threshold is estimated
    real, locked = eviction.estimate, []

    def estimate(*args):
        locked.append(table.lock.locked())
        return real(*args)

    monkeypatch.setattr(eviction, "estimate", estimate)
    assert table.demote(1000) == 1000
    assert locked == [False] and table.stats()["disk_rows"] == 1000


def test_a_pass_demotes_in_short_slices_each_few_by_one_estimate(tmp_path, monkeypatch):
    monkeypatch.setattr("lightning_persia.remote_ps.store.disk.demoter.SLICE_ROWS", 4)
    monkeypatch.setattr(eviction, "_SAMPLE", 256)  # the table does not fit in a sample: its victims are estimated
    table = _table(tmp_path)
    table.lookup(torch.arange(CAPACITY), train=True)
    estimates, slices = [], []
    real_estimate, real_demote = table.cold_estimate, table.demote

    def cold_estimate(count):
        estimates.append(count)
        return real_estimate(count)

    def demote(count, estimated=None):
        slices.append((count, estimated))
        return real_demote(count, estimated)

    monkeypatch.setattr(table, "cold_estimate", cold_estimate)
    monkeypatch.setattr(table, "demote", demote)
    assert HEADROOM == 100 and Demoter(lambda: [table]).run_once() == HEADROOM
    assert estimates == [100, 68, 36, 4]  # the rows left of the pass's target, every 8 slices
    assert [count for count, _ in slices] == [4] * 25
    assert all(estimated is not None for _, estimated in slices)
    assert all(slices[i][1] == slices[i - i % 8][1] for i in range(25))  # each slice by its group's estimate
    assert table.stats()["disk_rows"] == HEADROOM


def _lock_free_demotions(table, monkeypatch):
    """Records each slice a request's demotion evicts with the table's lock taken: its count, whether the lock was
    held when the demotion began (False: the request let it go), and the kind of operation."""
    real_demote, real_evict, calls, open_demotion = table.demote, table.evict_coldest, [], []

    def demote(count, estimated=None, of="demotion"):
        open_demotion.append((table.lock.locked(), of))
        try:
            return real_demote(count, estimated, of)
        finally:
            open_demotion.pop()

    def evict_coldest(count, estimated=None, keep=None):
        if open_demotion:
            calls.append((count, *open_demotion[-1]))
        return real_evict(count, estimated, keep)

    monkeypatch.setattr(table, "demote", demote)
    monkeypatch.setattr(table, "evict_coldest", evict_coldest)
    return calls


def test_a_request_short_of_more_than_a_slice_demotes_a_slice_at_a_time_between_its_locks(tmp_path, monkeypatch):
    monkeypatch.setattr("lightning_persia.remote_ps.store.disk.part.SLICE_ROWS", 100)  # a lookup demotes between its locks past it
    monkeypatch.setattr("lightning_persia.remote_ps.store.table.DEMOTION_SLICE_ROWS", 100)  # a slice at a time
    table = _table(tmp_path)
    old = torch.arange(CAPACITY)
    before = table.lookup(old, train=True)
    calls = _lock_free_demotions(table, monkeypatch)
    fresh = torch.arange(CAPACITY, CAPACITY + 350)  # no demoter ran: the request is 350 rows short
    table.lookup(fresh, train=True)
    assert calls == [(100, False, "a lookup's demotion, a slice")] * 3 + [(50, False, "a lookup's demotion, a slice")]
    stats = table.stats()
    assert stats["demoted"] == 350 and stats["rows"] == CAPACITY and stats["disk_rows"] == 350
    kinds = {operation["of"] for operation in stats["worst_disk_works"]}
    assert "a lookup's demotion, a slice" in kinds
    assert torch.equal(table.lookup(old, train=False), before)  # the demoted rows read back from disk
    assert torch.equal(table.lookup(fresh, train=False), table.lookup(fresh, train=True))


def test_a_request_short_of_a_slice_or_less_demotes_under_its_lock(tmp_path, monkeypatch):
    monkeypatch.setattr("lightning_persia.remote_ps.store.disk.part.SLICE_ROWS", 100)  # a lookup demotes between its locks past it
    monkeypatch.setattr("lightning_persia.remote_ps.store.table.DEMOTION_SLICE_ROWS", 100)  # a slice at a time
    table = _table(tmp_path)
    table.lookup(torch.arange(CAPACITY), train=True)
    calls = _lock_free_demotions(table, monkeypatch)
    table.lookup(torch.arange(CAPACITY, CAPACITY + 100), train=True)
    assert calls == [] and table.stats()["demoted"] == 100


def test_ids_another_request_brings_in_while_room_is_made_are_not_admitted_twice(tmp_path, monkeypatch):
    monkeypatch.setattr("lightning_persia.remote_ps.store.disk.part.SLICE_ROWS", 100)  # a lookup demotes between its locks past it
    monkeypatch.setattr("lightning_persia.remote_ps.store.table.DEMOTION_SLICE_ROWS", 100)  # a slice at a time
    table = _table(tmp_path)
    table.lookup(torch.arange(CAPACITY), train=True)
    fresh = torch.arange(CAPACITY, CAPACITY + 300)
    real_demote, others = table.demote, []

    def demote(count, estimated=None, of="demotion"):
        if not others:  # another request, between the first request's two holds of the lock: admits and trains 10
            others.append(table.lookup(fresh[:10], train=True))
            table.update(fresh[:10], torch.ones(10, DIM))
        return real_demote(count, estimated, of)

    monkeypatch.setattr(table, "demote", demote)
    got = table.lookup(fresh, train=True)
    assert table.stats()["inserted"] == CAPACITY + 300  # each of the 300 admitted once
    trained = table.lookup(fresh[:10], train=False)
    assert not torch.equal(trained, others[0]) and torch.equal(got[:10], trained)  # the first request saw the update


def test_requests_of_several_tables_make_room_between_their_locks_too(tmp_path, monkeypatch):
    monkeypatch.setattr("lightning_persia.remote_ps.store.disk.part.SLICE_ROWS", 100)  # a lookup demotes between its locks past it
    monkeypatch.setattr("lightning_persia.remote_ps.store.table.DEMOTION_SLICE_ROWS", 100)  # a slice at a time
    tables = [_table(tmp_path / "a"), _table(tmp_path / "b")]
    config = TableConfig("m", DIM, capacity=CAPACITY)  # a table in memory in the same request evicts, as before
    tables.append(Table(config, seed=0))
    for table in tables:
        table.lookup(torch.arange(CAPACITY), train=True)
    calls = [_lock_free_demotions(table, monkeypatch) for table in tables[:2]]
    fresh = torch.arange(CAPACITY, CAPACITY + 250)
    Table.lookup_together([(table, fresh) for table in tables], train=True, dtype=torch.float32)
    slice_of = "a lookup's demotion, a slice"
    assert calls == [[(100, False, slice_of), (100, False, slice_of), (50, False, slice_of)]] * 2
    assert [table.stats()["rows"] for table in tables] == [CAPACITY] * 3
    assert [table.stats()["demoted"] for table in tables] == [250, 250, 0]


def test_a_full_disk_while_a_request_makes_room_fails_it_clearly_and_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr("lightning_persia.remote_ps.store.disk.part.SLICE_ROWS", 100)  # a lookup demotes between its locks past it
    monkeypatch.setattr("lightning_persia.remote_ps.store.table.DEMOTION_SLICE_ROWS", 100)  # a slice at a time
    table = _table(tmp_path)
    old = torch.arange(CAPACITY)
    before = table.lookup(old, train=True)
    Demoter(lambda: [table]).run_once()  # HEADROOM rows on disk: the next request reads some back ahead
    wanted = torch.cat([old[:50], torch.arange(CAPACITY, CAPACITY + 400)])  # 450 missed, 100 rows free
    real_write = disk_tier.write_all

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_tier, "write_all", full)
    with pytest.raises(disk_tier.DiskTierError, match="No space left on device"):
        table.lookup(wanted, train=True)
    stats = table.stats()
    assert stats["rows"] + stats["disk_rows"] == CAPACITY  # nothing admitted, nothing lost
    monkeypatch.setattr(disk_tier, "write_all", real_write)
    got = table.lookup(wanted, train=True)  # the table serves on
    assert torch.equal(got[:50], before[:50].float()) and table.stats()["rows"] == CAPACITY
    assert torch.equal(table.lookup(old, train=False), before)
