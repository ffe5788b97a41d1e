"""The shard's background passes over its tables: run every interval on their thread, stopped on demand and at exit."""
import logging
import os
import threading

from lightning_persia.remote_ps.store import background
from lightning_persia.remote_ps.store.background import TablePass


class _Counting(TablePass):
    def __init__(self, niceness: int = 0) -> None:
        super().__init__(lambda: ["t"], 0.001, "test-pass", niceness)
        self.passes = 0
        self.ran = threading.Event()
        self.nice = None

    def run_once(self) -> int:
        self.passes += 1
        self.nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        sum(range(10_000))  # some CPU for the pass to count
        if self.passes >= 3:
            self.ran.set()
        return 1


def test_passes_run_on_their_thread_until_stopped():
    runner = _Counting()
    assert not runner.started and runner.cpu_s == 0.0
    runner.start()
    assert runner.ran.wait(10) and runner.started
    runner.stop()
    after, cpu_s = runner.passes, runner.cpu_s
    assert runner.stopping and runner.passes == after  # no pass after stop returned
    assert cpu_s > 0.0 and runner.cpu_s == cpu_s  # the passes' CPU counted, none after the stop


def test_every_started_pass_is_stopped_by_stop_all_as_at_exit():
    runner = _Counting()
    runner.start()
    assert runner.ran.wait(10)
    background.stop_all()
    assert runner.stopping


def test_a_pass_with_a_niceness_runs_at_a_lower_priority_than_the_rest_of_the_process():
    runner = _Counting(niceness=3)
    runner.start()
    assert runner.ran.wait(10)
    runner.stop()
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert runner.nice == min(19, own + 3)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the calling thread's is its own


def test_a_thread_the_system_refuses_a_priority_keeps_its_own_and_says_so(monkeypatch, caplog):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(background.os, "setpriority", refuse)
    runner = _Counting(niceness=3)
    with caplog.at_level(logging.WARNING, logger=background.__name__):
        runner.start()
        assert runner.ran.wait(10)
        runner.stop()
    assert runner.nice == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert "thread test-pass keeps its priority" in caplog.text
