"""Time to live: the rows of a table that no training lookup touched for ``ttl_steps`` lookups or ``ttl_seconds``.

A table with a TTL keeps LRU access values (the table's lookup step of a row's last access). What has expired is
found by a sweep that reads the access values :data:`SLICE_ROWS` rows at a time, the table's lock held for one
slice only (so a request waits for a slice, never for the whole table), and deletes the rows of each slice in
bulk; a disk table's rows on disk are swept a segment at a time in the same way. :class:`Expirer` runs the sweeps of
a shard's tables on a thread of its own, every ``interval_s``: off the request path.

:class:`TimeToLive` is a table's part for it, with one entry point (:meth:`TimeToLive.limit`). Seconds become
steps through the steps the sweeps saw: the step of a table at a time is the last one a sweep
recorded at or before it, so a TTL in seconds is as precise as the sweeps are frequent.
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import time
from typing import Any, Callable, ContextManager, Iterable, Optional

from lightning_persia.remote_ps.store.background import TablePass
from lightning_persia.remote_ps.table_config import TableConfig

SLICE_ROWS = 1 << 18
"""Access values read with the table's lock held, at most, by one step of a sweep."""
_HISTORY = 4096  # (time, step) points kept per table
_log = logging.getLogger(__name__)


class StepClock:
    """The steps a table was at, at the times its sweeps ran: turns an age in seconds into a step."""

    def __init__(self) -> None:
        self._times: list[float] = []
        self._steps: list[int] = []

    def record(self, now: float, step: int) -> None:
        self._times.append(now)
        self._steps.append(step)
        if len(self._times) > _HISTORY:
            del self._times[: _HISTORY // 2], self._steps[: _HISTORY // 2]

    def step_at(self, when: float) -> Optional[int]:
        """The step at time ``when`` (the last recorded at or before it), or None if none was recorded that early."""
        position = bisect.bisect_right(self._times, when)
        return self._steps[position - 1] if position else None


def expiry_step(step: int, now: float, clock: StepClock, ttl_steps: Optional[int], ttl_seconds: Optional[float]) -> Optional[int]:
    """Rows whose last access is at or below the returned step have expired (None: none has)."""
    limits = []
    if ttl_steps is not None:
        limits.append(step - ttl_steps)
    if ttl_seconds is not None:
        then = clock.step_at(now - ttl_seconds)
        if then is not None:
            limits.append(then)
    return max(limits) if limits else None


class TimeToLive:
    """A table's time to live (``config.ttl_steps``, ``config.ttl_seconds``), and the steps its sweeps saw."""

    def __init__(self, config: TableConfig) -> None:
        self._steps, self._seconds = config.ttl_steps, config.ttl_seconds
        self._clock = StepClock()

    def limit(self, now: float, step: int) -> Optional[int]:
        """A sweep at time ``now`` of a table at lookup ``step``: rows whose last access is at or below the returned
        step have expired (None: none has, or the table has no TTL). The table's lock held."""
        if self._steps is None and self._seconds is None:
            return None
        self._clock.record(now, step)
        return expiry_step(step, now, self._clock, self._steps, self._seconds)


class Expirer(TablePass):
    """Calls ``expire(now)`` of each of ``tables()`` every ``interval_s`` on a daemon thread, until :meth:`stop`."""

    def __init__(self, tables: Callable[[], Iterable], interval_s: float, journal: Callable[[], Any] = lambda: None,
                 guard: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        """``journal()``: what each sweep tells the ids it deleted (the shard's write-ahead log), or None; ``guard()``:
        held around each table's sweep, as around a request (the shard's routing gate: a sweep never straddles a
        change of what the shard owns)."""
        super().__init__(tables, interval_s, "persia-ps-expiry")
        self._journal = journal
        self._guard = guard

    def run_once(self) -> int:
        expired = 0
        for table in self._tables():
            try:
                with self._guard():
                    expired += table.expire(time.monotonic(), self._journal())
            except Exception:  # noqa: BLE001 - a failed sweep is retried at the next interval; the table serves on
                self.errors += 1
                _log.exception("the expiry sweep of table %r failed; it is retried in %.1f s", table.config.name, self._interval_s)
        return expired
