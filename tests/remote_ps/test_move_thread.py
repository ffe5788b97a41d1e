"""A shard's move threads (``remote_ps/move_thread.py``): a call runs on the thread, below the caller's priority,
and the caller hears its answer or its error."""
import os
import sys
import threading

import pytest

from lightning_persia.remote_ps.move_thread import MoveThread


def _where() -> tuple[str, int]:
    return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="only Linux gives a thread a nice value of its own: elsewhere a move runs as it did before move_nice, at the shard's priority (move_thread.py), so there is no lower one to check")
def test_a_call_runs_on_the_move_thread_at_its_lower_priority():
    mover = MoveThread("ps-give", 7)
    try:
        name, nice = mover.run(_where)
        assert name.startswith("ps-give") and name != threading.current_thread().name
        assert nice == min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + 7)
        assert mover.run(_where) == (name, nice)  # one thread, kept
    finally:
        mover.close()
    assert _where()[1] == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # the caller's own is unchanged


def test_nice_zero_keeps_the_callers_priority_and_a_call_answers_with_its_value():
    mover = MoveThread("ps-take", 0)
    try:
        assert mover.run(_where)[1] == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert mover.run(sum, [1, 2, 3]) == 6
    finally:
        mover.close()


def test_the_caller_hears_what_the_call_raises():
    mover = MoveThread("ps-take", 3)

    def refused():
        raise ValueError("the page does not parse")
    try:
        with pytest.raises(ValueError, match="the page does not parse"):
            mover.run(refused)
        assert mover.run(lambda: "still serving") == "still serving"
    finally:
        mover.close()
