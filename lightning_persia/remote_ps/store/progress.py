"""How far a shard's long jobs are: the save, load, re-shard or hand-over (a live move's copy) of each table, in rows.

A job is told the rows it has done a block at a time (:meth:`Job.advance`: never per row); every ``interval_s`` it
logs the rows done, the rate and the time left, and :class:`Progress` keeps the latest figures of every job for
Prometheus (``persia_ps_job_*`` in :mod:`lightning_persia.remote_ps.metrics`). A job that ends within one interval
logs nothing.

Example::

    progress = Progress("shard 0/2")
    job = progress.begin("save", "user", total_rows=10_000_000)
    for chunk in chunks:
        ...
        job.advance(len(chunk))
    job.finish()
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

log = logging.getLogger("lightning_persia.ps")

JOBS = ("save", "load", "re-shard", "hand-over")
INTERVAL_S = 10.0


@dataclass(frozen=True)
class JobFigures:
    """A job's figures when asked: rows done of ``total_rows`` (``None``: not known in advance), rows/s, seconds left."""

    job: str
    table: str
    done_rows: int
    total_rows: Optional[int]
    rows_per_second: float
    seconds_left: Optional[float]
    finished: bool


class Job:
    """One job on one table; see the module's example. Thread-safe for one writer and any number of readers."""

    def __init__(self, name: str, table: str, total_rows: Optional[int], where: str, interval_s: float,
                 clock: Callable[[], float]) -> None:
        self.name, self.table, self.total_rows = name, table, total_rows
        self._where, self._interval_s, self._clock = where, interval_s, clock
        self._start = self._last_log = clock()
        self._done = 0
        self._finished: Optional[float] = None

    def advance(self, rows: int) -> None:
        """``rows`` more done; logs the figures when ``interval_s`` passed since the last line."""
        self._done += rows
        now = self._clock()
        if now - self._last_log >= self._interval_s:
            self._last_log = now
            log.info("%s: %s", self._where, self._describe(self.figures(now)))

    def finish(self) -> None:
        """The job is over; logs its total when it took longer than one interval."""
        self._finished = self._clock()
        elapsed = self._finished - self._start
        if elapsed >= self._interval_s:
            log.info("%s: %s of table %r done: %s rows in %.0f s (%s rows/s)", self._where, self.name, self.table,
                     f"{self._done:,}", elapsed, f"{self._done / elapsed:,.0f}")

    def figures(self, now: Optional[float] = None) -> JobFigures:
        end = self._finished if self._finished is not None else (self._clock() if now is None else now)
        elapsed = max(end - self._start, 1e-9)
        rate = self._done / elapsed
        left = None
        if self.total_rows is not None:
            left = 0.0 if self._finished is not None else max(self.total_rows - self._done, 0) / rate if rate else None
        return JobFigures(self.name, self.table, self._done, self.total_rows, rate, left, self._finished is not None)

    def _describe(self, figures: JobFigures) -> str:
        done = f"{figures.done_rows:,}"
        if figures.total_rows:
            done += f" of {figures.total_rows:,} rows ({100 * figures.done_rows / figures.total_rows:.0f}%)"
        else:
            done += " rows"
        left = f", about {figures.seconds_left:,.0f} s left" if figures.seconds_left is not None else ""
        return f"{self.name} of table {self.table!r}: {done}, {figures.rows_per_second:,.0f} rows/s{left}"


class _NoJob:
    """A job nobody follows (the default of the checkpoint functions)."""

    def advance(self, rows: int) -> None:
        pass

    def finish(self) -> None:
        pass


class Progress:
    """The jobs of one shard: the running ones and the last one of each (job, table), for :meth:`figures`.

    Args:
        where: how log lines name the shard (``"shard 0/2"``).
        interval_s: seconds between two log lines of a job.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, where: str = "shard", interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.where, self.interval_s, self._clock = where, interval_s, clock
        self._jobs: Dict[Tuple[str, str], Job] = {}
        self._lock = threading.Lock()

    def begin(self, name: str, table: str, total_rows: Optional[int]) -> Job:
        """A new job ``name`` (one of :data:`JOBS`) on ``table``, replacing the last one of that pair."""
        if name not in JOBS:
            raise ValueError(f"unknown job {name!r}; expected one of {JOBS}")
        job = Job(name, table, total_rows, self.where, self.interval_s, self._clock)
        with self._lock:
            self._jobs[(name, table)] = job
        return job

    def figures(self) -> List[JobFigures]:
        with self._lock:
            jobs = list(self._jobs.values())
        return [job.figures() for job in jobs]


#: The job of the checkpoint functions when no :class:`Progress` follows them.
NO_JOB = _NoJob()


def begin(progress: Optional[Progress], name: str, table: str, total_rows: Optional[int]) -> "Job | _NoJob":
    """``progress.begin(...)``, or :data:`NO_JOB` when ``progress`` is ``None``."""
    return NO_JOB if progress is None else progress.begin(name, table, total_rows)
