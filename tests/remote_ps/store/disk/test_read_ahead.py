"""A disk table reads the records of a lookup's misses without its lock: what another request changes meanwhile."""
import os

import pytest
import torch

from lightning_persia.remote_ps.store.disk import read_ahead, tier
from lightning_persia.remote_ps.store.disk.read_ahead import ReadAhead
from lightning_persia.remote_ps.store.errors import StoreError
from lightning_persia.remote_ps.store.index import NativeIdIndex
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

pytestmark = pytest.mark.usefixtures("disk_tier_kernels")

DIM = 4


def _table(tmp_path, capacity=100):
    config = TableConfig("t", DIM, optimizer=Adagrad(rowwise=True), capacity=capacity, storage="disk", storage_dtype="fp16")
    return Table(config, seed=0, disk_dir=str(tmp_path / "tier"))


def _grown(tmp_path):
    """A table whose ids 0..99 are on disk, with values an update moved away from their initial rows."""
    table = _table(tmp_path)
    for batch in torch.arange(300).split(100):
        table.lookup(batch, train=True)
        table.update(batch, torch.ones(100, DIM))
    assert table.stats()["disk_rows"] == 200 and table.stats()["rows"] == 100
    return table


def _during_read(monkeypatch, table, meanwhile):
    """Runs ``meanwhile()`` inside the next read ahead, checking that it runs without the table's lock."""
    real_read = ReadAhead.read
    calls = []

    def read(ahead):
        assert not table.lock.locked()
        if not calls:
            calls.append(1)
            meanwhile()
        real_read(ahead)

    monkeypatch.setattr(ReadAhead, "read", read)
    return calls


def _reads_under_lock(monkeypatch, table):
    """``(locked, start)``: once ``start()`` is called, each read of records appends to ``locked`` whether the
    table's lock was held during it."""
    real_read_records, locked = read_ahead.read_records, []

    def read_records(*args, **kwargs):
        locked.append(table.lock.locked())
        real_read_records(*args, **kwargs)

    def start():  # the read ahead's, and the one under the lock: the same native call, looked up in each module
        monkeypatch.setattr(read_ahead, "read_records", read_records)
        monkeypatch.setattr(tier, "read_records", read_records)

    return locked, start


def test_the_misses_are_read_without_the_lock_and_serve_the_same_rows(tmp_path, monkeypatch):
    table = _grown(tmp_path)
    expected = table.lookup(torch.arange(100), train=False)  # evaluation: read, not brought in
    calls = _during_read(monkeypatch, table, lambda: None)
    assert torch.equal(table.lookup(torch.arange(100), train=True), expected)
    assert calls and table.stats()["promoted"] >= 100


def test_rows_another_request_brought_in_meanwhile_are_taken_from_memory(tmp_path, monkeypatch):
    table = _grown(tmp_path)
    cold = torch.arange(50)
    expected = table.lookup(cold, train=False)
    _during_read(monkeypatch, table, lambda: table.lookup(cold[:20], train=True))  # promotes 20 of them meanwhile
    promoted = table.stats()["promoted"]
    assert torch.equal(table.lookup(cold, train=True), expected)
    assert table.stats()["promoted"] == promoted + 50  # 20 by the other request, 30 by this one: none twice
    assert table.stats()["rows"] + table.stats()["disk_rows"] == 300


def test_an_evaluation_lookup_finds_in_memory_the_rows_promoted_meanwhile(tmp_path, monkeypatch):
    table = _grown(tmp_path)
    cold = torch.arange(50)
    expected = table.lookup(cold, train=False)
    _during_read(monkeypatch, table, lambda: table.lookup(cold[:20], train=True))  # off the disk, into memory
    assert torch.equal(table.lookup(cold, train=False), expected)


def test_a_row_that_moved_to_another_slot_meanwhile_is_read_again_under_the_lock(tmp_path, monkeypatch):
    table = _grown(tmp_path)
    cold = torch.arange(50)
    expected = table.lookup(cold, train=False)

    locked, record_reads = _reads_under_lock(monkeypatch, table)

    def promote_then_demote_again():
        table.lookup(cold, train=True)  # in memory now...
        table.lookup(torch.arange(200, 300), train=True)  # ...and back on disk, in new slots
        record_reads()  # this lookup's reads from here on

    _during_read(monkeypatch, table, promote_then_demote_again)
    assert torch.equal(table.lookup(cold, train=True), expected)
    assert locked == [False, True]  # read ahead without the lock, then the moved rows again with it
    assert table.stats()["rows"] + table.stats()["disk_rows"] == 300


def test_records_whose_rows_stayed_on_disk_are_kept_when_others_left_it_meanwhile(tmp_path, monkeypatch):
    table = _grown(tmp_path)
    cold, others = torch.arange(50), torch.arange(60, 80)
    expected = table.lookup(cold, train=False)
    locked, record_reads = _reads_under_lock(monkeypatch, table)

    def promote_others():
        table.lookup(others, train=True)  # their entries leave the id map: the map changed, these slots did not
        record_reads()

    _during_read(monkeypatch, table, promote_others)
    assert torch.equal(table.lookup(cold, train=True), expected)
    assert locked == [False]  # read once, without the lock: nothing read again with it
    assert table.stats()["rows"] + table.stats()["disk_rows"] == 300


def test_only_the_ids_whose_rows_left_the_disk_meanwhile_are_probed_again_in_memory(tmp_path, monkeypatch):
    table = _grown(tmp_path)
    cold = torch.arange(50)
    expected = table.lookup(cold, train=False)
    probed, after = [], []
    real_find = NativeIdIndex.find

    def find(index, ids, *args, **kwargs):
        if after:
            probed.append(ids.tolist())
        return real_find(index, ids, *args, **kwargs)

    def meanwhile():
        table.lookup(torch.tensor([60, 61, 10, 11]), train=True)  # rows into memory: two of this request's among them
        after.append(True)

    monkeypatch.setattr(NativeIdIndex, "find", find)
    _during_read(monkeypatch, table, meanwhile)
    assert torch.equal(table.lookup(cold, train=True), expected)
    assert probed == [[10, 11]]  # the 48 others were still on disk at the slots read
    assert table.stats()["rows"] + table.stats()["disk_rows"] == 300


def _open_segments(tmp_path) -> int:
    """Files of the tier this process holds open (deleted ones included)."""
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")]
    return sum(str(tmp_path / "tier" / "segment-") in target for target in fds)


def test_a_table_dropped_during_the_read_fails_the_lookup_and_then_closes_its_files(tmp_path, monkeypatch):
    table = _grown(tmp_path)
    open_during_read = []

    def drop():
        table.close()
        open_during_read.append(_open_segments(tmp_path))

    _during_read(monkeypatch, table, drop)
    with pytest.raises(StoreError, match="table 't' was dropped during the lookup"):
        table.lookup(torch.arange(50), train=True)
    assert list((tmp_path / "tier").glob("segment-*")) == []  # deleted by the drop
    assert open_during_read == [2] and _open_segments(tmp_path) == 0  # kept open for the read, closed after it


def test_a_request_of_several_tables_reads_each_ahead_and_ends_every_read_when_one_table_was_dropped(tmp_path, monkeypatch):
    first, second = _grown(tmp_path / "a"), _grown(tmp_path / "b")
    cold = torch.arange(50)
    expected = [first.lookup(cold, train=False), second.lookup(cold, train=False)]
    calls = _during_read(monkeypatch, first, lambda: None)
    got = Table.lookup_together([(first, cold), (second, cold)], train=True, dtype=torch.float32)
    assert calls and all(torch.equal(g, e.float()) for g, e in zip(got, expected))
    _during_read(monkeypatch, first, second.close)
    with pytest.raises(StoreError, match="dropped during the lookup"):
        Table.lookup_together([(first, torch.arange(50, 100)), (second, torch.arange(50, 100))], train=True, dtype=torch.float32)
    assert _open_segments(tmp_path / "b") == 0 and _open_segments(tmp_path / "a") == 2
    first.close()
    assert _open_segments(tmp_path / "a") == 0  # its read ended too: nothing kept it open


def test_misses_none_of_which_are_on_disk_are_admitted_without_a_read(tmp_path, monkeypatch):
    table = _grown(tmp_path)
    calls = _during_read(monkeypatch, table, lambda: None)
    table.lookup(torch.arange(1000, 1050), train=True)  # new ids: the id map answers, nothing to read
    assert not calls and table.stats()["inserted"] == 350


def test_rows_removed_from_disk_meanwhile_are_not_served_from_the_read(tmp_path, monkeypatch):
    table = _grown(tmp_path)
    cold = torch.arange(50)
    expected = table.lookup(cold, train=False)

    def remove_ten():
        with table.lock:
            table.remove_ids_locked(cold[:10])  # a delta drops them: nothing inserted, the id map changed

    _during_read(monkeypatch, table, remove_ten)
    got = table.lookup(cold, train=False)
    initial = _table(tmp_path / "fresh").lookup(cold[:10], train=False)  # what an id the table does not hold gets
    assert torch.equal(got[:10], initial) and not torch.equal(got[:10], expected[:10])
    assert torch.equal(got[10:], expected[10:])


def test_an_id_admitted_and_demoted_meanwhile_is_read_from_disk_not_admitted_twice(tmp_path, monkeypatch):
    table = _grown(tmp_path)
    new = torch.tensor([1000])

    def admit_then_demote():
        table.lookup(new, train=True)  # admitted...
        table.lookup(torch.arange(2000, 2100), train=True)  # ...and demoted, the coldest row for these 100
        assert table.stats()["disk_rows"] == 200 + 1 + 100

    calls = _during_read(monkeypatch, table, admit_then_demote)
    table.lookup(torch.cat([torch.arange(10), new]), train=True)  # 1000 was nowhere when this read began
    stats = table.stats()
    assert calls and stats["rows"] + stats["disk_rows"] == 300 + 1 + 100  # each id once: 1000 brought back, not admitted again
