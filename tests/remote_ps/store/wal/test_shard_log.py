"""A shard restarted on its write-ahead log holds exactly the rows it acknowledged, past its last checkpoint."""
import pytest

from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.wal import open_shard_log
from lightning_persia.remote_ps.store.wal.log import segment_numbers, segment_path
from lightning_persia.remote_ps.table_config import Adagrad, Normal, TableConfig

from shard_log_helpers import assert_same, contents, train


def _start(tmp_path, *, durability="log", incarnation="one", restore_from=None):
    # no demoter: which rows of a disk table are in memory (what _contents compares) then depends on the requests alone
    store = ShardStore(0, 1, seed=3, disk_dir=str(tmp_path / f"disk-{incarnation}"), demotion_interval_s=None)

    store.log = open_shard_log(store, str(tmp_path / "wal"), durability, incarnation, restore_from, window=64)
    return store


@pytest.mark.parametrize("capacity,admit,storage", [(1 << 20, 1.0, "memory"), (300, 1.0, "memory"), (1 << 20, 0.5, "memory"),
                                                    (300, 1.0, "disk")],
                         ids=["admit-all", "evicting", "admit-half", "demoting-to-disk"])
def test_a_restarted_shard_replays_to_exactly_the_rows_it_acknowledged(tmp_path, store_kernels, capacity, admit, storage):
    if storage == "disk" and store_kernels != "native":
        pytest.skip("storage 'disk' needs the native kernels (disk/tier.py refuses it otherwise)")
    store = _start(tmp_path)
    store.configure(TableConfig("a", 8, optimizer=Adagrad(lr=0.1, rowwise=True), capacity=capacity, admit_probability=admit,
                                storage=storage))
    store.configure(TableConfig("b", 4, optimizer=Adagrad(lr=0.1), init=Normal(0, 0.1), capacity=capacity))
    train(store, 12)
    store.save(str(tmp_path / "ckpt"))  # the log before it is deleted, the replay starts from it
    train(store, 12, first_seq=13, seed=1)
    before = contents(store, tmp_path / "expected")  # (a save of its own: it rotates the log, nothing lost)
    train(store, 3, first_seq=25, seed=2)
    expected = contents(store, tmp_path / "expected-2")

    restarted = _start(tmp_path, incarnation="two")  # the first process is abandoned as a kill would leave it
    report = restarted.log.report
    assert report.replayed and report.records > 0 and report.checkpoint == str(tmp_path / "expected-2")
    assert restarted.log.accepted == {"one", "two"}
    assert_same(contents(restarted, tmp_path / "replayed"), expected)
    assert before != {}


def test_the_replay_starts_past_the_checkpoint_and_rebuilds_the_exactly_once_memory(tmp_path):
    store = _start(tmp_path)
    store.configure(TableConfig("a", 8))
    store.configure(TableConfig("b", 8))
    train(store, 5)
    store.save(str(tmp_path / "ckpt"))
    assert len(segment_numbers(tmp_path / "wal")) == 1  # truncated at the checkpoint
    train(store, 4, first_seq=6)
    expected = contents(store, tmp_path / "expected")
    segment = segment_path(tmp_path / "wal", segment_numbers(tmp_path / "wal")[-1])
    with open(segment, "ab") as f:  # a write torn by the kill: a header and part of a record
        f.write(b"LAWP\x00\x10\x00\x00\x01\x02\x03\x04partial")

    restarted = _start(tmp_path, incarnation="two")
    report = restarted.log.report
    assert report.dropped_bytes == 19 and "ends after" in report.dropped
    assert report.checkpoint == str(tmp_path / "expected")
    assert restarted.log.applied_seqs()["c"] == list(range(1, 10))  # seqs 1-5 from the checkpoint's segment opening
    assert not segment.read_bytes().endswith(b"partial")  # cut off: no torn record between whole ones later
    assert_same(contents(restarted, tmp_path / "replayed"), expected)


def test_a_log_whose_checkpoint_is_gone_is_not_trusted_and_the_shard_starts_from_restore_from(tmp_path):
    store = _start(tmp_path)
    store.configure(TableConfig("a", 8))
    store.configure(TableConfig("b", 8))
    train(store, 3)
    store.save(str(tmp_path / "old"))
    store.save(str(tmp_path / "new"))
    train(store, 3, first_seq=4)
    for path in (tmp_path / "new").rglob("*"):
        if path.is_file():
            path.unlink()
    restarted = _start(tmp_path, incarnation="two", restore_from=str(tmp_path / "old"))
    report = restarted.log.report
    assert not report.replayed and "does not load" in report.not_trusted
    assert report.checkpoint == str(tmp_path / "old") and restarted.log.accepted == {"two"}
    assert segment_numbers(tmp_path / "wal") == [restarted.log.wal.segment]  # a fresh log after that checkpoint


def test_a_log_written_without_fsync_before_the_machine_restarted_is_not_trusted(tmp_path, monkeypatch):
    store = _start(tmp_path)
    store.configure(TableConfig("a", 8))
    store.configure(TableConfig("b", 8))
    train(store, 2)
    monkeypatch.setattr("lightning_persia.remote_ps.store.wal.shard_log.boot_id", lambda: "another boot")
    restarted = _start(tmp_path, incarnation="two")
    report = restarted.log.report
    assert not report.replayed and "machine restarted" in report.not_trusted and report.checkpoint is None
    assert restarted.log.accepted == {"two"} and restarted.tables() == []  # restore_from (none here), not the replay


def test_a_log_written_with_fsync_is_trusted_after_the_machine_restarted(tmp_path, monkeypatch):
    store = _start(tmp_path, durability="fsync")
    store.configure(TableConfig("a", 8))
    store.configure(TableConfig("b", 8))
    train(store, 2)
    monkeypatch.setattr("lightning_persia.remote_ps.store.wal.shard_log.boot_id", lambda: "another boot")
    restarted = _start(tmp_path, durability="fsync", incarnation="two")
    assert restarted.log.report.not_trusted == "" and restarted.log.accepted == {"one", "two"}
