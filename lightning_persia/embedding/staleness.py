"""The bounded-staleness window between embedding lookups and embedding updates.

Batch ``t``'s lookup may start only once the updates of batches ``0 .. t - staleness - 1`` are all
acknowledged by the shards, so the rows it reads miss the updates of at most ``staleness`` earlier
batches. ``staleness=0`` is exactly synchronous: batch ``t + 1`` reads after batch ``t``'s update.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")


class StalenessTimeout(TimeoutError):
    """An update was not acknowledged in time; the message says which batch the window waits for."""


class StalenessWindow:
    """Counts acknowledged updates (in any order) and lets lookups wait for their turn.

    Example::

        window = StalenessWindow(staleness=2)
        window.wait_for_lookup(step=3)   # returns once the update of batch 0 is acknowledged
        window.acknowledge(step=0)
    """

    def __init__(self, staleness: int, changed: threading.Condition | None = None) -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.staleness = staleness
        self._acknowledged = 0  # batches 0 .. _acknowledged - 1 are all acknowledged
        self._early: set[int] = set()
        self._failure: BaseException | None = None
        # Notified on every acknowledgement and failure; a scheduler that waits for more than the window
        # passes its own, so that one condition wakes it whatever changed.
        self._changed = changed if changed is not None else threading.Condition()

    @property
    def acknowledged(self) -> int:
        """How many batches, counted from the first, have their update acknowledged."""
        with self._changed:
            return self._acknowledged

    @property
    def failure(self) -> BaseException | None:
        """The error an update failed with for good (every wait raises it), if any."""
        with self._changed:
            return self._failure

    def acknowledge(self, step: int) -> None:
        """Marks the update of batch ``step`` as applied by every shard."""
        with self._changed:
            self._early.add(step)
            while self._acknowledged in self._early:
                self._early.remove(self._acknowledged)
                self._acknowledged += 1
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        """Wakes every waiter with ``error`` (an update failed for good)."""
        with self._changed:
            self._failure = error
            self._changed.notify_all()

    def lag(self, step: int) -> int:
        """How many earlier batches' updates a lookup for ``step`` issued now would miss (the unacknowledged ones
        among batches ``0 .. step - 1``; updates acknowledged out of order count as in)."""
        with self._changed:
            return max(0, step - self._acknowledged) - sum(1 for early in self._early if early < step)

    def lag_when_done(self, future: "Future[T]", step: int, note: Callable[[int], None]) -> "Future[T]":
        """``future``'s outcome, passed on only after ``note(lag)`` was told :meth:`lag` of ``step`` at the moment
        ``future`` completed: how many earlier batches' updates were still unacknowledged when a lookup was answered
        (whoever waits for the returned future reads the lag after it is noted)."""
        passed: Future = Future()

        def done(source: Future) -> None:
            note(self.lag(step))
            if source.cancelled():
                passed.cancel()
            elif source.exception() is not None:
                passed.set_exception(source.exception())
            else:
                passed.set_result(source.result())

        future.add_done_callback(done)
        return passed

    def wait_for_lookup(self, step: int, timeout_s: float | None = None) -> None:
        """Blocks until batch ``step`` may look up."""
        self.wait_until(step - self.staleness, timeout_s)

    def wait_until(self, count: int, timeout_s: float | None = None) -> None:
        """Blocks until the first ``count`` batches are acknowledged."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            while self._acknowledged < count:
                if self._failure is not None:
                    raise self._failure
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise StalenessTimeout(
                        f"waited {timeout_s:.1f} s for the embedding update of batch {self._acknowledged} "
                        f"(staleness {self.staleness}); is a parameter-server shard slow or down?"
                    )
                self._changed.wait(remaining)
            if self._failure is not None:
                raise self._failure
