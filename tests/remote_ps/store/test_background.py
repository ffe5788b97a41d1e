"""The shard's background passes over its tables: run every interval on their thread, stopped on demand and at exit."""
import threading

from lightning_persia.remote_ps.store import background
from lightning_persia.remote_ps.store.background import TablePass


class _Counting(TablePass):
    def __init__(self) -> None:
        super().__init__(lambda: ["t"], 0.001, "test-pass")
        self.passes = 0
        self.ran = threading.Event()

    def run_once(self) -> int:
        self.passes += 1
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
