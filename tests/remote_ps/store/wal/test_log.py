"""The group-commit writer: order, many records per write, rotation and truncation, and a full disk."""
import errno
import os
import threading

import pytest

from lightning_persia.remote_ps.store.errors import LogWriteError
from lightning_persia.remote_ps.store.wal.log import WriteAheadLog, read_base, segment_numbers, segment_path
from lightning_persia.remote_ps.store.wal.records import ReadEnd, read_records


def _records(path) -> list[bytes]:
    with open(path, "rb") as stream:
        return list(read_records(stream, ReadEnd()))


@pytest.mark.parametrize("durability", ["log", "fsync"])
def test_records_of_many_threads_are_written_in_the_order_they_were_appended(tmp_path, durability):
    wal = WriteAheadLog(tmp_path, durability, [b"open"])
    order, lock = [], threading.Lock()

    def writer(k: int) -> None:
        for i in range(200):
            with lock:  # the order of the appends is the order the records must have
                payload = f"{k}:{i}".encode()
                ticket = wal.append([payload])
                order.append(payload)
            wal.wait(ticket)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wal.close()
    assert _records(segment_path(tmp_path, 0)) == [b"open", *order]
    assert wal.stats.records == 800
    assert wal.stats.commits < 800  # group commit: some writes carried several records


def test_a_rotation_starts_a_segment_and_the_base_deletes_the_older_ones(tmp_path):
    wal = WriteAheadLog(tmp_path, "log", [b"open 0"])
    wal.wait(wal.append([b"a"]))
    segment = wal.rotate([b"open 1"])
    wal.wait(wal.append([b"b"]))
    assert segment == 1 and segment_numbers(tmp_path) == [0, 1]
    wal.set_base(segment, "/checkpoints/x")
    wal.close()
    assert segment_numbers(tmp_path) == [1]
    assert read_base(tmp_path) == {"segment": 1, "checkpoint": "/checkpoints/x"}
    assert _records(segment_path(tmp_path, 1)) == [b"open 1", b"b"]
    assert wal.stats.disk_bytes == os.path.getsize(segment_path(tmp_path, 1))


def test_a_reopened_log_starts_the_next_segment(tmp_path):
    WriteAheadLog(tmp_path, "log", [b"first"]).close()
    wal = WriteAheadLog(tmp_path, "log", [b"second"])
    wal.close()
    assert wal.segment == 1 and segment_numbers(tmp_path) == [0, 1]


class _Disk:
    """A disk of ``room`` bytes for the log's writes; beyond, ``ENOSPC`` (or a short write at the edge)."""

    def __init__(self, room: int) -> None:
        self.room = room

    def write(self, fd: int, data: memoryview) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, data[: self.room])
        self.room -= n
        return n


def test_a_full_disk_fails_the_waiting_and_every_later_caller_and_acknowledges_nothing_unwritten(tmp_path):
    disk = _Disk(room=200)
    wal = WriteAheadLog(tmp_path, "log", [b"open"], write=disk.write)
    written = wal.append([b"x" * 50])
    wal.wait(written)
    too_much = wal.append([b"y" * 500])
    with pytest.raises(LogWriteError, match="No space left on device") as caught:
        wal.wait(too_much)
    assert caught.value.disk_full and str(segment_path(tmp_path, 0)) in str(caught.value)
    with pytest.raises(LogWriteError):
        wal.append([b"later"])
    assert wal.failure() is caught.value
    wal.close()
    end = ReadEnd()
    with open(segment_path(tmp_path, 0), "rb") as stream:
        assert list(read_records(stream, end)) == [b"open", b"x" * 50]
    assert end.dropped_bytes > 0  # the part of the record that fitted: torn, dropped on replay


def test_durability_none_is_not_a_log(tmp_path):
    with pytest.raises(ValueError, match="'log' or 'fsync'"):
        WriteAheadLog(tmp_path, "none", [b"open"])


def test_a_log_that_cannot_be_created_stops_the_shard_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError):
        WriteAheadLog(blocker / "wal", "log", [b"open"])
