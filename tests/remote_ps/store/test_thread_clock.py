"""A thread's wall time split into running, waiting for a core, and blocked; the worst disk-tier work of one operation."""
import threading
import time

import pytest

from lightning_persia.remote_ps.store import thread_clock
from lightning_persia.remote_ps.store.thread_clock import DiskWork, HeldLocks, LockWaits, WorstHeld, thread_times


def _busy(seconds: float, clock=time.perf_counter) -> None:
    end = clock() + seconds
    while clock() < end:
        pass


def test_a_busy_thread_counts_running_time_and_a_sleeping_one_does_not():
    before = thread_times()
    _busy(0.2)
    busy = thread_times() - before
    assert busy.cpu_s + busy.runnable_s >= 0.15  # ran, or waited for a core on a loaded machine
    before = thread_times()
    time.sleep(0.2)
    asleep = thread_times() - before
    assert asleep.cpu_s + asleep.runnable_s < 0.1  # blocked: neither running nor runnable


def test_each_thread_has_its_own_times():
    seen = {}

    def sleeper() -> None:
        before = thread_times()
        time.sleep(0.2)
        seen["sleeper"] = thread_times() - before

    worker = threading.Thread(target=sleeper)
    worker.start()
    _busy(0.2)
    worker.join()
    assert seen["sleeper"].cpu_s < 0.1


def test_without_the_kernels_statistics_the_cpu_time_stands_and_no_wait_is_counted(monkeypatch, tmp_path):
    monkeypatch.setattr(thread_clock, "_SCHEDSTAT", str(tmp_path / "absent"))
    before = thread_times()
    _busy(0.1)
    spent = thread_times() - before
    assert spent.runnable_s == 0.0 and spent.cpu_s > 0.0


def test_the_worst_operation_sums_its_sections_and_nesting_counts_once():
    work = DiskWork()
    with work.operation("demotion"):
        with work.timed():
            _busy(0.02, time.thread_time)
            with work.timed():  # nested: already counted by the outer section
                _busy(0.02, time.thread_time)
        _busy(0.05, time.thread_time)  # not disk work
        with work.timed():
            _busy(0.02, time.thread_time)
    first, ended = work.worst.cpu_s, time.time()
    assert 0.06 <= first < 0.11
    assert ended - 1.0 <= work.worst.at <= ended and first <= work.worst.wall_s < 1.0  # its end and its wall time
    at = work.worst.at
    with work.operation("lookup"):
        with work.timed():
            _busy(0.01, time.thread_time)
    assert work.worst.cpu_s == first and work.worst.of == "demotion"  # a lighter operation keeps the worst, and its kind
    assert work.worst.at == at
    kept = work.worst_operations
    assert [o["of"] for o in kept] == ["demotion", "lookup"] and kept[0]["cpu_s"] == first and kept[0]["at"] == at


def test_the_worst_operations_kept_are_the_heaviest_each_with_its_time(monkeypatch):
    clock = iter(range(10**6))
    monkeypatch.setattr(thread_clock.time, "thread_time", lambda: float(next(clock)))  # each reading a second on
    work = DiskWork()
    for cost in [3, 1, 9, 4, 7, 2, 8, 6, 5, 10, 1]:  # an operation timed once, `cost` readings long
        with work.operation(f"op{cost}"):
            with work.timed():
                for _ in range(cost - 1):
                    time.thread_time()
    with work.operation("no disk work"):
        pass
    kept = work.worst_operations
    assert [o["cpu_s"] for o in kept] == [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0][:thread_clock.WORST_KEPT]
    assert [o["of"] for o in kept][:2] == ["op10", "op9"] and work.worst.of == "op10"
    assert all(o["wall_s"] >= 0.0 and o["at"] > 0.0 and o["demoting_s"] == 0.0 for o in kept)
    with work.operation("demotion"):
        with work.timed(demoting=True):
            for _ in range(19):
                time.thread_time()
    assert work.worst_operations[0]["of"] == "demotion" and work.worst_operations[0]["demoting_s"] == 20.0


@pytest.mark.skipif(thread_clock._RUSAGE_THREAD is None,
                    reason="Python offers a thread's kernel time only on Linux (resource.RUSAGE_THREAD); elsewhere the "
                           "stats report 0 for it, and there is nothing to measure")
def test_the_worst_operation_keeps_its_kernel_time_and_its_demotions_apart():
    work = DiskWork()
    with work.operation("lookup"):
        with work.timed():
            _busy(0.02, time.thread_time)
            with work.timed(demoting=True):  # nested, and counted as demoting too
                _busy(0.03, time.thread_time)
                start = thread_clock._kernel_time()
                with open("/dev/zero", "rb") as zeros:  # the kernel's time: copying out zeros
                    while thread_clock._kernel_time() - start < 0.01:
                        zeros.read(1 << 20)
    assert 0.06 <= work.worst.cpu_s < 0.2
    assert 0.04 <= work.worst.demoting_s <= work.worst.cpu_s - 0.02
    assert 0.01 <= work.worst.sys_s <= work.worst.cpu_s
    demoting, kernel = work.worst.demoting_s, work.worst.sys_s
    with work.operation("update"):
        with work.timed():
            _busy(0.005, time.thread_time)
    assert (work.worst.demoting_s, work.worst.sys_s, work.worst.of) == (demoting, kernel, "lookup")


class _Clock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _ContendedLock:
    """A lock whose taking costs ``wait`` seconds of ``clock`` (another thread held it meanwhile)."""

    def __init__(self, clock: _Clock, wait: float) -> None:
        self._clock, self._wait = clock, wait

    def acquire(self) -> None:
        self._clock.now += self._wait

    def release(self) -> None:
        pass


def test_lock_waits_count_the_time_spent_waiting_for_the_lock_not_the_time_it_is_held():
    clock = _Clock()
    waits = LockWaits(clock)
    with waits.holding(_ContendedLock(clock, wait=0.0)):
        clock.now += 7.0  # held, not waited for
    assert waits.seconds == 0.0
    with waits.holding(_ContendedLock(clock, wait=5.0)):
        clock.now += 7.0
    with waits.holding(_ContendedLock(clock, wait=2.0)):
        pass
    assert waits.seconds == 7.0


def test_lock_waits_hold_a_real_lock_for_the_block_and_let_it_go_after_it_or_an_error():
    waits, lock = LockWaits(), threading.Lock()
    with waits.holding(lock):
        assert lock.locked()
    assert not lock.locked()
    with pytest.raises(RuntimeError):
        with waits.holding(lock):
            raise RuntimeError("the block failed")
    assert not lock.locked()


def _held_locks(train: bool):
    locks = [(threading.Lock(), LockWaits(), WorstHeld()) for _ in range(2)]
    return locks, HeldLocks(locks, asked=10, train=train)


def test_held_locks_are_let_go_for_a_block_and_taken_again_the_hold_before_it_among_the_worst():
    locks, held = _held_locks(train=True)
    with held:
        assert all(lock.locked() for lock, _, _ in locks)
        first = held.held
        time.sleep(0.01)
        with held.let_go():
            assert not any(lock.locked() for lock, _, _ in locks)
        assert all(lock.locked() for lock, _, _ in locks) and held.held.wall > first.wall  # held anew since
    assert not any(lock.locked() for lock, _, _ in locks)
    assert all(worst.wall_s >= 0.01 for _, _, worst in locks)


def test_held_locks_of_an_evaluation_record_no_hold_and_are_taken_again_after_an_error():
    locks, held = _held_locks(train=False)
    with pytest.raises(RuntimeError, match="the read failed"):
        with held:
            with held.let_go():
                raise RuntimeError("the read failed")
            pytest.fail("the error goes on up")  # pragma: no cover
    assert not any(lock.locked() for lock, _, _ in locks)
    assert all(worst.wall_s == 0.0 for _, _, worst in locks)


def test_held_locks_taken_partly_let_the_taken_ones_go_on_an_error():
    class Refusing:
        def acquire(self):
            raise KeyboardInterrupt

    first = threading.Lock()
    held = HeldLocks([(first, LockWaits(), WorstHeld()), (Refusing(), LockWaits(), WorstHeld())])
    with pytest.raises(KeyboardInterrupt):
        with held:
            pass  # pragma: no cover
    assert not first.locked()
