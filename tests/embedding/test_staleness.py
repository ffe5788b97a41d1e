"""The staleness window: acknowledgements in any order, the lag of a lookup, timeouts and failures that say why."""
from __future__ import annotations

import threading

import pytest

from lightning_persia.embedding.staleness import StalenessTimeout, StalenessWindow


def test_acknowledgements_count_from_the_first_batch_in_any_order():
    window = StalenessWindow(staleness=2)
    window.acknowledge(1)
    window.acknowledge(2)
    assert window.acknowledged == 0 and window.lag(3) == 3  # batch 0 is still out
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
