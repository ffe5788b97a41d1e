"""The staleness window: acknowledgements in any order, the lag of a lookup, timeouts and failures that say why."""
from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future

import pytest

from lightning_persia.embedding.staleness import StalenessTimeout, StalenessWindow


def test_acknowledgements_count_from_the_first_batch_in_any_order():
    window = StalenessWindow(staleness=2)
    window.acknowledge(1)
    window.acknowledge(2)
    assert window.acknowledged == 0 and window.lag(3) == 1 and window.lag(2) == 1  # batch 0 is still out, 1 and 2 are in
    assert window.lag(4) == 2  # ... and 3
    window.acknowledge(0)
    assert window.acknowledged == 3 and window.lag(3) == 0 and window.lag(1) == 0


def test_a_lookup_may_go_once_all_but_the_last_staleness_updates_are_in():
    window = StalenessWindow(staleness=2)
    window.wait_for_lookup(2, timeout_s=0.1)  # batches 0 and 1 may be missed: nothing to wait for
    with pytest.raises(StalenessTimeout, match=r"update of batch 0 \(staleness 2\)"):
        window.wait_for_lookup(3, timeout_s=0.1)
    done = threading.Event()
    threading.Thread(target=lambda: (window.wait_for_lookup(3, timeout_s=5), done.set()), daemon=True).start()
    assert not done.wait(0.1)
    window.acknowledge(0)
    assert done.wait(5)


def test_a_failure_wakes_every_waiter_with_its_error():
    window = StalenessWindow(staleness=0)
    errors: list = []

    def wait() -> None:
        try:
            window.wait_until(5, timeout_s=10)
        except RuntimeError as error:
            errors.append(error)

    threads = [threading.Thread(target=wait, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    window.fail(RuntimeError("embedding update of step 3 failed"))
    for thread in threads:
        thread.join(5)
    assert [str(e) for e in errors] == ["embedding update of step 3 failed"] * 2
    assert window.failure is errors[0]


def test_staleness_must_not_be_negative():
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        StalenessWindow(-1)


def test_the_lag_at_an_answer_is_noted_before_whoever_waits_for_the_answer_wakes():
    window = StalenessWindow(staleness=3)
    answer: Future = Future()
    noted: list[int] = []
    passed = window.lag_when_done(answer, step=3, note=noted.append)
    passed.add_done_callback(lambda f: noted.append(-1))  # runs only after the lag was noted
    assert window.lag(3) == 3 and not passed.done()
    window.acknowledge(0)
    window.acknowledge(2)
    answer.set_result("rows")
    assert noted == [1, -1] and passed.result() == "rows"  # batch 1's update was still out when the rows came


def test_a_failed_or_cancelled_answer_passes_through_with_its_lag_noted():
    window = StalenessWindow(staleness=1)
    failed, cancelled = Future(), Future()
    noted: list[int] = []
    failing = window.lag_when_done(failed, step=1, note=noted.append)
    cancelling = window.lag_when_done(cancelled, step=2, note=noted.append)
    failed.set_exception(ConnectionError("shard 1 down"))
    cancelled.cancel()
    with pytest.raises(ConnectionError, match="shard 1 down"):
        failing.result()
    with pytest.raises(CancelledError):
        cancelling.result()
    assert noted == [1, 2]
