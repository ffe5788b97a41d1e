"""A write-ahead log in segment files, written by one thread with group commit.

Callers :meth:`WriteAheadLog.append` records (cheap: the bytes are queued, in the order of the calls) and
:meth:`WriteAheadLog.wait` until theirs is written: the writer thread takes every record queued so far, writes
them with one ``write`` and, with ``durability="fsync"``, one ``fdatasync``, then wakes all their callers. So
under load many updates share one system call and one flush, and a caller waits for one batch at most.

``durability``: ``"log"`` returns once the bytes are in the operating system's page cache (they survive the
shard process dying, not the machine), ``"fsync"`` once they are on the disk.

The log is a sequence of segment files ``wal-NNNNNNNN.log``. :meth:`rotate` starts a new one (in order with the
records: a checkpoint's consistent point), and :meth:`set_base` records in ``BASE.json`` that the records before
a segment are in a checkpoint, then deletes the older segments: a checkpoint truncates the log.

A write that fails (``ENOSPC``, ``EFBIG``, ``EIO``) fails the log for good: every waiting and later caller gets
:class:`LogWriteError` naming the file and the cause; nothing that was not written is ever reported written.
"""
from __future__ import annotations

import errno
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from lightning_persia.durable import fsync_path, write_atomically
from lightning_persia.remote_ps.config import DURABILITY
from lightning_persia.remote_ps.store.errors import LogWriteError
from lightning_persia.remote_ps.store.wal.records import frame

BASE_FILE = "BASE.json"
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)

Buffers = Sequence[bytes | memoryview]


def segment_path(directory: Path, number: int) -> Path:
    return directory / f"wal-{number:08d}.log"


def segment_numbers(directory: Path) -> list[int]:
    """The segments in ``directory``, oldest first."""
    numbers = []
    for path in directory.glob("wal-*.log"):
        try:
            numbers.append(int(path.stem[4:]))
        except ValueError:
            continue
    return sorted(numbers)


def read_base(directory: Path) -> Optional[dict]:
    """``{"segment": k, "checkpoint": path or None}`` from ``BASE.json``, or None when there is none."""
    try:
        return json.loads((directory / BASE_FILE).read_text())
    except FileNotFoundError:
        return None


@dataclass
class LogStats:
    """What the log wrote since it opened (the Prometheus metrics of the shard read these)."""

    records: int = 0
    bytes_written: int = 0
    commits: int = 0  # batches written (one write, one flush with fsync)
    disk_bytes: int = 0  # the segments' size now
    segments: int = 0


@dataclass
class _Rotation:
    number: int
    opening: Buffers


class WriteAheadLog:
    """The log of one shard in ``directory`` (see the module docstring).

    ``write``: how bytes reach a file descriptor (``os.write``); a test passes one that fills up.
    """

    def __init__(self, directory: str | os.PathLike, durability: str, opening: Buffers,
                 write: Callable[[int, memoryview], int] = os.write) -> None:
        if durability not in DURABILITY[1:]:
            raise ValueError(f"durability of a write-ahead log must be 'log' or 'fsync', got {durability!r}")
        self.directory = Path(directory)
        self.durability = durability
        self.stats = LogStats()
        self._write = write
        self._cond = threading.Condition()
        self._queue: list = []
        self._appended = 0  # tickets handed out
        self._written = 0  # tickets written (and flushed with fsync)
        self._failed: Optional[LogWriteError] = None
        self._closing = False
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = segment_numbers(self.directory)
        self.stats.segments = len(existing)
        self.stats.disk_bytes = sum(segment_path(self.directory, n).stat().st_size for n in existing)
        self.segment = (existing[-1] + 1) if existing else 0
        self._fd = -1
        self._next_segment = self.segment
        try:  # before serving: a log that cannot be written stops the shard at start
            self._start_segment(self.segment, frame(opening))
        except OSError as err:
            raise _error(segment_path(self.directory, self.segment), err) from None
        self._thread = threading.Thread(target=self._run, name="persia-ps-wal", daemon=True)
        self._thread.start()

    # ---- callers -----------------------------------------------------------------------------------

    def append(self, payload: Buffers) -> int:
        """Queues a record; returns its ticket for :meth:`wait`. Raises :class:`LogWriteError` once the log failed."""
        buffers = frame(payload)
        with self._cond:
            self._check()
            self._queue.append(buffers)
            self._appended += 1
            self._cond.notify()
            return self._appended

    def wait_all(self) -> None:
        """Returns once every record queued so far is written with the log's durability."""
        with self._cond:
            ticket = self._appended
        self.wait(ticket)

    def wait(self, ticket: int) -> None:
        """Returns once record ``ticket`` (and every one before it) is written with the log's durability."""
        with self._cond:
            while self._written < ticket:
                self._check()
                self._cond.wait()

    def rotate(self, opening: Buffers) -> int:
        """Starts a new segment whose first record is ``opening``, after every record queued so far; its number."""
        with self._cond:
            self._check()
            self._next_segment += 1
            self._queue.append(_Rotation(self._next_segment, frame(opening)))
            self._appended += 1
            self._cond.notify()
            ticket, number = self._appended, self._next_segment
        self.wait(ticket)
        return number

    def set_base(self, segment: int, checkpoint: Optional[str]) -> None:
        """Records that ``checkpoint`` holds everything before segment ``segment``, and deletes the older segments."""
        write_atomically(self.directory / BASE_FILE, json.dumps({"segment": segment, "checkpoint": checkpoint}))
        for number in segment_numbers(self.directory):
            if number < segment:
                path = segment_path(self.directory, number)
                size = path.stat().st_size
                path.unlink()
                with self._cond:
                    self.stats.disk_bytes -= size
                    self.stats.segments -= 1

    def failure(self) -> Optional[LogWriteError]:
        with self._cond:
            return self._failed

    def close(self) -> None:
        """Writes what is queued, then stops the writer."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ---- the writer --------------------------------------------------------------------------------

    def _check(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
                done = self._appended
            try:
                pending: list = []
                for item in batch:
                    if isinstance(item, _Rotation):
                        self._flush(pending)
                        pending = []
                        self._start_segment(item.number, item.opening)
                    else:
                        pending += item
                        self.stats.records += 1
                self._flush(pending)
            except OSError as err:
                with self._cond:
                    self._failed = _error(segment_path(self.directory, self.segment), err)
                    self._cond.notify_all()
                return
            with self._cond:
                self._written = done
                self.stats.commits += 1
                self._cond.notify_all()

    def _flush(self, buffers: list) -> None:
        if not buffers:
            return
        data = memoryview(b"".join(buffers))
        while data:
            written = self._write(self._fd, data)
            data = data[written:]
            self.stats.bytes_written += written
            self.stats.disk_bytes += written
        if self.durability == "fsync":
            os.fdatasync(self._fd)

    def _start_segment(self, number: int, opening: Buffers) -> None:
        if self._fd >= 0:
            if self.durability == "fsync":
                os.fdatasync(self._fd)
            os.close(self._fd)
            self._fd = -1
        path = segment_path(self.directory, number)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self.segment = number
        self.stats.segments += 1
        self._flush(list(opening))
        if self.durability == "fsync":  # the new file's name is on the disk before a record in it is acknowledged
            fsync_path(self.directory)


def _error(path: Path, err: OSError) -> LogWriteError:
    full = err.errno in _FULL
    cause = os.strerror(err.errno) if err.errno else str(err)
    advice = ("free space on its disk (or raise its file-size limit)" if full else "repair its disk")
    return LogWriteError(
        f"the write-ahead log {path} cannot be written ({cause}): this request is not acknowledged, and the shard "
        f"acknowledges no more updates. The updates acknowledged so far are in the log; {advice}, then restart the "
        "shard: it replays its log and the trainers go on",
        disk_full=full,
    )
