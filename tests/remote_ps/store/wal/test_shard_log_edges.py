"""The edges of a shard's write-ahead log: a table created while a save begins, TTL expiry, a damaged record before
the end, a replay that fails half-way, a checkpoint that cannot be read at start, and lookups that see an update
whose record is still queued. Each case failed before: the shard lost acknowledged values, or its log."""
import os
import threading
import time

import pytest
import torch

from lightning_persia.ops.shard_map import shard_of
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.errors import CheckpointError
from lightning_persia.remote_ps.store.wal import open_shard_log
from lightning_persia.remote_ps.store.wal.log import segment_numbers, segment_path
from lightning_persia.remote_ps.store.wal.records import HEADER
from lightning_persia.remote_ps.table_config import SGD, Constant, TableConfig

from shard_log_helpers import assert_same, contents, train


def _start(tmp_path, incarnation, restore_from=None, defaults=None, durability="log"):
    store = ShardStore(0, 1, seed=3, disk_dir=str(tmp_path / "disk"), demotion_interval_s=None, table_defaults=defaults)
    store.log = open_shard_log(store, str(tmp_path / "wal"), durability, incarnation, restore_from, window=64)
    return store


def _values(store, name, ids):
    return store.lookup(name, ids, train=False)


@pytest.mark.parametrize("made", ["configured", "on-first-use"])
def test_a_table_made_while_a_save_begins_is_in_the_checkpoint_or_in_the_log(tmp_path, monkeypatch, made):
    late = TableConfig("late", 4, optimizer=SGD(lr=1.0), init=Constant(0.0))
    store = _start(tmp_path, "one", defaults={"late": late} if made == "on-first-use" else None)
    store.configure(TableConfig("a", 4))
    train(store, 2, tables=("a",))
    ids = torch.arange(10)
    finished = threading.Event()

    def make_late_table() -> None:
        if made == "configured":
            store.configure(late)
        store.lookup("late", ids, train=True)
        store.update("late", ids, torch.ones(10, 4))
        finished.set()

    original = ShardStore._begin
    started: list[threading.Thread] = []

    def begin_with_a_new_table(table, since):  # between the listing of the tables and the log's new segment
        if not started:
            started.append(threading.Thread(target=make_late_table))
            started[0].start()
            finished.wait(0.5)  # the table is made now, or (as it must) waits for the save's point
        return original(table, since)

    monkeypatch.setattr(ShardStore, "_begin", staticmethod(begin_with_a_new_table))
    store.save(str(tmp_path / "ckpt"))
    started[0].join(30)
    assert finished.is_set()
    restarted = _start(tmp_path, "two", defaults={"late": late} if made == "on-first-use" else None)
    assert restarted.log.report.replayed and restarted.log.report.not_trusted == ""
    assert torch.equal(_values(restarted, "late", ids), torch.full((10, 4), -1.0))


def test_ttl_expiry_is_logged_and_a_replay_keeps_the_rows_deleted(tmp_path):
    store = _start(tmp_path, "one")
    store.configure(TableConfig("mem", 4, optimizer=SGD(lr=1.0), ttl_steps=2))
    store.configure(TableConfig("disk", 4, optimizer=SGD(lr=1.0), ttl_steps=2, storage="disk", capacity=24))
    old, new = torch.arange(20), torch.arange(100, 110)
    for name in ("mem", "disk"):
        store.lookup(name, old, train=True)
        store.update(name, old, torch.ones(20, 4))
        for _ in range(3):
            store.lookup(name, new, train=True)
    trained = {name: _values(store, name, old) for name in ("mem", "disk")}
    assert store.expire(now=0.0) == 40  # both tables' 20 old rows, in memory and on disk
    expected = contents(store, tmp_path / "expected")
    gone = {name: _values(store, name, old) for name in ("mem", "disk")}  # an evaluation lookup's first rows

    restarted = _start(tmp_path, "two")
    assert restarted.log.report.replayed
    assert_same(contents(restarted, tmp_path / "replayed"), expected)
    for name in ("mem", "disk"):
        assert not torch.isclose(gone[name], trained[name]).any()
        assert torch.equal(_values(restarted, name, old), gone[name])


def _damage(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_record_before_the_end_makes_the_log_untrusted_and_keeps_it(tmp_path):
    store = _start(tmp_path, "one")
    store.configure(TableConfig("a", 8))
    train(store, 6, tables=("a",))
    (number,) = segment_numbers(tmp_path / "wal")
    segment = segment_path(tmp_path / "wal", number)
    original = segment.read_bytes()
    _damage(segment, len(original) // 3)

    restarted = _start(tmp_path, "two")
    report = restarted.log.report
    assert not report.replayed and "damaged record followed by whole ones" in report.not_trusted, report.not_trusted
    assert restarted.log.accepted == {"two"} and restarted.tables() == []  # empty: no restore_from was given
    (kept,) = (tmp_path / "wal").glob("untrusted-*")
    assert segment_path(kept, number).stat().st_size == len(original) and (kept / "BASE.json").exists()
    assert segment_numbers(tmp_path / "wal") == [restarted.log.wal.segment]


def test_a_torn_last_record_is_cut_and_the_log_stays_trusted(tmp_path):
    store = _start(tmp_path, "one")
    store.configure(TableConfig("a", 8))
    train(store, 3, tables=("a",))
    expected = contents(store, tmp_path / "expected")
    segment = segment_path(tmp_path / "wal", segment_numbers(tmp_path / "wal")[-1])
    size = segment.stat().st_size
    with open(segment, "ab") as f:  # the last write's record, whole but for bytes the crash never wrote
        f.write(HEADER.pack(0x5057414C, 64, 12345) + b"\x01" * 64)
    restarted = _start(tmp_path, "two")
    assert restarted.log.report.replayed and restarted.log.report.not_trusted == ""
    assert restarted.log.report.dropped_bytes == HEADER.size + 64 and segment.stat().st_size == size
    assert_same(contents(restarted, tmp_path / "replayed"), expected)


def test_a_replay_that_fails_half_way_falls_back_and_keeps_the_log(tmp_path):
    made_on_use = TableConfig("d", 4)
    store = _start(tmp_path, "one", defaults={"d": made_on_use})
    store.configure(TableConfig("a", 4))
    train(store, 3, tables=("a",))
    store.save(str(tmp_path / "ckpt"))  # restore_from of the restart: what it falls back to
    train(store, 3, first_seq=4, tables=("a", "d"))
    restarted = _start(tmp_path, "two", restore_from=str(tmp_path / "ckpt"))  # without the table "d" declared
    report = restarted.log.report
    assert not report.replayed and "its replay failed: UnknownTableError" in report.not_trusted, report.not_trusted
    assert report.checkpoint == str(tmp_path / "ckpt") and restarted.tables() == ["a"]  # the checkpoint's
    (kept,) = (tmp_path / "wal").glob("untrusted-*")
    assert segment_numbers(kept)


def test_a_checkpoint_that_cannot_be_read_at_start_stops_the_shard_and_keeps_its_log(tmp_path):
    store = _start(tmp_path, "one")
    store.configure(TableConfig("a", 4))
    train(store, 2, tables=("a",))
    store.save(str(tmp_path / "ckpt"))
    train(store, 2, first_seq=3, tables=("a",))
    expected = contents(store, tmp_path / "expected")
    segments = sorted(p.name for p in (tmp_path / "wal").iterdir())
    (tmp_path / "expected").rename(tmp_path / "away")  # the volume that holds it is not there yet
    with pytest.raises(CheckpointError, match=r"follows the checkpoint .*expected, which cannot be read now .*move .*wal away"):
        _start(tmp_path, "two", restore_from=str(tmp_path / "ckpt"))
    assert sorted(p.name for p in (tmp_path / "wal").iterdir()) == segments  # nothing moved, nothing deleted
    (tmp_path / "away").rename(tmp_path / "expected")
    restarted = _start(tmp_path, "three")
    assert restarted.log.report.replayed and restarted.log.accepted == {"one", "three"}
    assert_same(contents(restarted, tmp_path / "replayed"), expected)


def test_a_lookup_never_answers_with_an_update_whose_record_is_not_written_yet(tmp_path):
    store = _start(tmp_path, "one")
    store.configure(TableConfig("a", 4, optimizer=SGD(lr=1.0), init=Constant(0.0)))
    ids = torch.arange(8)
    store.lookup("a", ids, train=True)
    gate, writes = threading.Event(), []
    write = store.log.wal._write

    def held_write(fd, data):  # the log's writer stalls, as under a slow disk
        writes.append(len(data))
        gate.wait(30)
        return write(fd, data)

    store.log.wal._write = held_write
    updater = threading.Thread(target=store.update, args=("a", ids, torch.ones(8, 4)))
    updater.start()
    while not writes:
        time.sleep(0.01)
    seen: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: seen.append(_values(store, "a", ids)))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and not seen  # it read the update's rows: it waits for their record
    gate.set()
    updater.join(30)
    reader.join(30)
    assert torch.equal(seen[0], torch.full((8, 4), -1.0))


def test_a_log_left_by_an_earlier_shard_count_is_not_replayed_over_a_later_reshard(tmp_path):
    store = _start(tmp_path, "one")  # a run of one shard, its log in wal/ ...
    store.configure(TableConfig("a", 4, optimizer=SGD(lr=1.0), init=Constant(0.0)))
    ids = torch.arange(40)
    store.lookup("a", ids, train=True)
    store.update("a", ids, torch.ones(40, 4))
    store.save(str(tmp_path / "one-shard"))
    for segment in (tmp_path / "wal").glob("wal-*.log"):  # its last write an hour before the later run's save
        os.utime(segment, (time.time() - 3600, time.time() - 3600))
    for index in range(2):  # ... then the job went on with two shards, and saved
        shard = ShardStore(index, 2, seed=3)
        shard.load(str(tmp_path / "one-shard"))
        owned = ids[shard_of(ids, 2) == index]
        shard.update("a", owned, torch.ones(owned.numel(), 4))
        shard.save(str(tmp_path / "two-shards"))
    restarted = _start(tmp_path, "two", restore_from=str(tmp_path / "two-shards"))  # back to one shard
    report = restarted.log.report
    assert not report.replayed and "before restore_from" in report.not_trusted and "left by an earlier run" in report.not_trusted
    assert torch.equal(_values(restarted, "a", ids), torch.full((40, 4), -2.0))  # the two-shard run's rows


def test_a_log_newer_than_restore_from_is_replayed(tmp_path):
    """The supervisor's restore_from lags a later load or save of the shards: the log is the newer, and trusted."""
    store = _start(tmp_path, "one")
    store.configure(TableConfig("a", 4, optimizer=SGD(lr=1.0), init=Constant(0.0)))
    ids = torch.arange(10)
    store.lookup("a", ids, train=True)
    store.save(str(tmp_path / "first"))
    store.update("a", ids, torch.ones(10, 4))
    store.save(str(tmp_path / "second"))
    store.load(str(tmp_path / "first"))  # a rollback the supervisor has not heard of
    store.update("a", ids, torch.ones(10, 4))
    restarted = _start(tmp_path, "two", restore_from=str(tmp_path / "second"))
    assert restarted.log.report.replayed and restarted.log.report.not_trusted == ""
    assert torch.equal(_values(restarted, "a", ids), torch.full((10, 4), -1.0))


def test_a_shard_restarted_before_the_other_shards_finished_a_save_replays_from_its_own_part(tmp_path):
    """Its log follows the save it finished; another shard's folder of that save is not written yet (or never is)."""
    stores = [ShardStore(i, 2, seed=3, demotion_interval_s=None) for i in range(2)]
    for i, store in enumerate(stores):
        store.log = open_shard_log(store, str(tmp_path / f"wal-{i}"), "log", "one", None, window=64)
        store.configure(TableConfig("a", 4, optimizer=SGD(lr=1.0), init=Constant(0.0)))
    ids = torch.arange(40)
    mine = ids[shard_of(ids, 2) == 1]
    stores[1].lookup("a", mine, train=True)
    stores[1].update("a", mine, torch.ones(mine.numel(), 4))
    stores[1].save(str(tmp_path / "save"))  # shard 0 has not written its folder: the save is not complete
    stores[1].update("a", mine, torch.ones(mine.numel(), 4))
    restarted = ShardStore(1, 2, seed=3, demotion_interval_s=None)
    restarted.log = open_shard_log(restarted, str(tmp_path / "wal-1"), "log", "two", None, window=64)
    report = restarted.log.report
    assert report.replayed and report.not_trusted == "" and restarted.log.accepted == {"one", "two"}
    assert torch.equal(_values(restarted, "a", mine), torch.full((mine.numel(), 4), -2.0))
