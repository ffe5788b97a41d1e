"""When each step's prefetched lookup goes out: the staleness window, and a lookahead just long enough.

Steps are numbered in the order the trainer consumes them. Step ``t``'s lookup may go out only once the
updates of steps ``0 .. t - staleness - 1`` are acknowledged (:class:`StalenessWindow`), so it misses the updates
of at most ``staleness`` earlier steps.

The window bounds staleness; it is not a target. A lookup issued as early as the window allows misses the
updates of ``staleness`` earlier steps every time, even when the shards answer well within one step, and on
tables that every batch touches (small vocabularies are updated by every step, like dense weights) those stale
gradients cost accuracy. So a lookup also waits until the trainer has begun step ``t - lookahead``, where
``lookahead`` (1 .. ``staleness``) is just enough to hide what the lookup waits for: the acknowledgement of the
update of step ``t - lookahead - 1``, pushed as step ``t - lookahead`` begins, then the lookup itself. So
``lookahead = ceil(1.2 * (update latency + lookup latency) / step time)``; fast shards give a staleness of 1
whatever the bound, far or slow ones use more of the window.

Everything a waiting lookup depends on (a step begun, an update acknowledged or failed, a latency measured,
the prefetch stopped) notifies one condition: the wait wakes exactly when its answer may have changed.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Callable, Optional

from lightning_persia.embedding.staleness import StalenessWindow

LOOKAHEAD_MARGIN = 1.2  # issue a lookup this many of its latencies ahead of its step (rounded up to whole steps)
_EMA = 0.2  # weight of the newest sample in the latency and step-time averages


class LookupStopped(RuntimeError):
    """The prefetch that waited to issue a lookup was stopped first (the epoch ended or was cut short)."""


class LookupScheduler:
    """The staleness window and the lookahead of one rank, on one condition.

    Example::

        scheduler = LookupScheduler(staleness=4)
        lag = scheduler.wait_for_turn(step=5, stopped=stop.is_set)   # in the prefetch thread
        scheduler.step_begun(4)                                      # in the trainer, as step 4 starts
        scheduler.window.acknowledge(0)                              # when step 0's update is applied
    """

    def __init__(self, staleness: int) -> None:
        self._changed = threading.Condition()
        self.window = StalenessWindow(staleness, self._changed)
        self._begun = -1  # the last step the trainer began
        self._last_begin: Optional[float] = None
        self.step_seconds: Optional[float] = None  # moving average of the time between two steps' starts
        self.lookup_seconds: Optional[float] = None  # ... of a lookup's latency (issue -> rows)
        self.update_seconds: Optional[float] = None  # ... of an update's latency (push -> acknowledged)

    @property
    def staleness(self) -> int:
        return self.window.staleness

    def lookahead(self) -> int:
        """How many steps before its own a step's lookup is issued: 1 .. staleness (0 when synchronous)."""
        with self._changed:
            return self._lookahead()

    def _lookahead(self) -> int:
        staleness, lookup, step = self.staleness, self.lookup_seconds, self.step_seconds
        if staleness <= 1 or lookup is None or not step:
            return min(staleness, 1)
        return max(1, min(staleness, math.ceil(LOOKAHEAD_MARGIN * ((self.update_seconds or 0.0) + lookup) / step)))

    def step_begun(self, step: int) -> None:
        """The trainer begins ``step``: the lookups waiting for it may go."""
        now = time.perf_counter()
        with self._changed:
            if self._last_begin is not None:
                interval = now - self._last_begin
                if self.step_seconds is None:
                    self.step_seconds = interval
                elif interval < 10 * self.step_seconds:  # not a pause (validation, a checkpoint)
                    self.step_seconds += _EMA * (interval - self.step_seconds)
            self._last_begin = now
            self._begun = max(self._begun, step)
            self._changed.notify_all()

    def observe(self, latency: str, seconds: float) -> None:
        """Folds one measured ``"lookup"`` or ``"update"`` latency into its moving average."""
        name = f"{latency}_seconds"
        with self._changed:
            average = getattr(self, name)
            setattr(self, name, seconds if average is None else average + _EMA * (seconds - average))
            self._changed.notify_all()

    def wake(self) -> None:
        """Makes every waiter check its ``stopped`` again."""
        with self._changed:
            self._changed.notify_all()

    def wait_for_turn(self, step: int, stopped: Callable[[], bool]) -> int:
        """Blocks until ``step``'s lookup may go out; returns how many earlier steps' updates it misses.

        Raises :class:`LookupStopped` once ``stopped()`` is true (call :meth:`wake` after making it so), and an
        update's failure for good.
        """
        with self._changed:
            while True:
                if stopped():
                    raise LookupStopped(f"the prefetch of step {step} was stopped before its lookup")
                failure = self.window.failure
                if failure is not None:
                    raise failure
                # staleness 0: the window alone orders lookups after updates
                lookahead = self._lookahead()
                begun = self.staleness == 0 or step - lookahead <= self._begun
                # Every update older than the lookahead has been pushed by the time its step begins: waiting for
                # its acknowledgement costs a fraction of a step and makes the lookup miss only `lookahead`
                # updates (the ones not computed yet), not up to `staleness`.
                if begun and self.window.acknowledged >= step - lookahead:
                    return self.window.lag(step)
                self._changed.wait()
