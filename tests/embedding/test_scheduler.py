"""The lookup scheduler: a hybrid lookup goes out just early enough to hide its latency, never beyond the bound,
and a waiting lookup wakes on the event it waits for (one condition, no polling)."""
from __future__ import annotations

import threading

import pytest

from lightning_persia.embedding.scheduler import LookupScheduler, LookupStopped


class _Waiter:
    """``scheduler.wait_for_turn(step)`` on a thread of its own; ``done`` is set when it returns or raises."""

    def __init__(self, scheduler: LookupScheduler, step: int) -> None:
        self.stop = threading.Event()
        self.done = threading.Event()
        self.lag = None
        self.error = None

        def run() -> None:
            try:
                self.lag = scheduler.wait_for_turn(step, self.stop.is_set)
            except BaseException as error:  # noqa: BLE001 - checked by the test
                self.error = error
            self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


@pytest.mark.parametrize(
    "staleness, lookup_s, update_s, step_s, expected",
    [
        (0, None, None, None, 0), (4, None, None, None, 1), (4, 0.05, None, 0.1, 1), (4, 0.25, None, 0.1, 3),
        (4, 1.0, None, 0.1, 4), (1, 1.0, None, 0.1, 1),
        (4, 0.04, 0.04, 0.1, 1), (4, 0.095, 0.094, 0.146, 2), (8, 0.25, 0.25, 0.1, 6),  # the update's ack counts too
    ],
)
def test_lookahead_hides_the_measured_latencies_within_the_bound(staleness, lookup_s, update_s, step_s, expected):
    scheduler = LookupScheduler(staleness)
    scheduler.lookup_seconds, scheduler.update_seconds, scheduler.step_seconds = lookup_s, update_s, step_s
    assert scheduler.lookahead() == expected


def test_a_lookup_waits_until_the_trainer_is_lookahead_steps_away_and_the_update_before_is_acknowledged():
    scheduler = LookupScheduler(staleness=4)  # nothing measured yet: lookahead 1
    waiter = _Waiter(scheduler, step=2)
    assert not waiter.done.wait(0.2)  # the trainer has begun no step yet
    scheduler.step_begun(0)
    assert not waiter.done.wait(0.2)  # step 2 waits for the trainer to begin step 1
    scheduler.step_begun(1)
    assert not waiter.done.wait(0.2)  # ... and for the update of step 0 (pushed by now) to be acknowledged
    scheduler.window.acknowledge(0)
    assert waiter.done.wait(5) and waiter.error is None
    assert waiter.lag == 1  # it misses only the update of step 1, which is not computed yet


def test_a_measured_latency_widens_the_lookahead_and_wakes_the_waiting_lookup():
    scheduler = LookupScheduler(staleness=4)
    for step in range(4):
        scheduler.step_begun(step)
    for step in range(3):
        scheduler.window.acknowledge(step)
    waiter = _Waiter(scheduler, step=6)  # lookahead 1: waits for step 5 to begin
    assert not waiter.done.wait(0.2)
    scheduler.step_seconds = 0.1
    scheduler.observe("lookup", 0.25)  # lookahead 3: step 3 has begun, steps 0..2 are acknowledged
    assert waiter.done.wait(5) and waiter.error is None and waiter.lag == 3


def test_at_staleness_zero_a_lookup_waits_for_the_previous_update_only():
    scheduler = LookupScheduler(staleness=0)
    waiter = _Waiter(scheduler, step=1)  # no step begun: the trainer's progress does not matter
    assert not waiter.done.wait(0.2)
    scheduler.window.acknowledge(0)
    assert waiter.done.wait(5) and waiter.lag == 0


def test_a_stopped_lookup_leaves_the_wait_when_woken():
    scheduler = LookupScheduler(staleness=4)
    waiter = _Waiter(scheduler, step=5)
    waiter.stop.set()
    scheduler.wake()
    assert waiter.done.wait(5) and isinstance(waiter.error, LookupStopped)
    assert "stopped before its lookup" in str(waiter.error)


def test_a_failed_update_fails_the_waiting_lookup():
    scheduler = LookupScheduler(staleness=1)
    waiter = _Waiter(scheduler, step=3)
    scheduler.window.fail(RuntimeError("embedding update of step 0 failed: shard 1 is gone"))
    assert waiter.done.wait(5) and "shard 1 is gone" in str(waiter.error)
