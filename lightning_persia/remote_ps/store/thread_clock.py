"""Where a thread's wall time went: on a core, waiting for a core, or blocked.

A request that holds a table's lock longer than its CPU time either waited for a core (the machine is busy) or
was blocked (on the GIL, the process's memory-map lock, a page the kernel was clearing for another thread). The
two call for different remedies, and only the first is the machine's: Linux counts, per thread, the time spent
running and the time spent runnable but waiting for a core (``/proc/thread-self/schedstat``); what is left of the
wall time was spent blocked. The running time is read from the thread's CPU clock instead: the statistics' figure
for a running thread is only as recent as the scheduler's last tick, while its wait ends when it last got a core.
"""
from __future__ import annotations

import contextlib
import heapq
import time
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Sequence

try:
    import resource
except ImportError:  # Windows has no per-thread counts
    resource = None

_SCHEDSTAT = "/proc/thread-self/schedstat"
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None


@dataclass(frozen=True)
class ThreadTimes:
    """Seconds the calling thread ran (``cpu_s``) and waited runnable for a core (``runnable_s``), since it began."""

    cpu_s: float
    runnable_s: float

    def __sub__(self, other: "ThreadTimes") -> "ThreadTimes":
        return ThreadTimes(self.cpu_s - other.cpu_s, self.runnable_s - other.runnable_s)


def thread_times() -> ThreadTimes:
    """The calling thread's times; without the kernel's scheduler statistics, no wait is counted."""
    try:
        with open(_SCHEDSTAT, "rb") as stats:
            waiting_ns = int(stats.read().split()[1])
    except (OSError, ValueError, IndexError):
        waiting_ns = 0
    return ThreadTimes(time.thread_time(), waiting_ns / 1e9)


WORST_KEPT = 8
"""The disk tier's worst operations a table keeps, each with its time (:attr:`DiskWork.worst_operations`)."""
_TIMED_INSERT = 4096  # training lookups of at least this many ids have their thread's times read (see Held)


@dataclass(frozen=True)
class Held:
    """When a lookup took its table's lock, and, for a training lookup large enough to time, its thread's times then.

    A thread's times are a file read and a system call (tens of microseconds; hundreds in some virtual machines):
    read only around lookups that may insert many rows, whose held time is what growing costs the other requests.
    """

    wall: float
    times: ThreadTimes | None

    @staticmethod
    def now(num_ids: int, train: bool) -> "Held":
        return Held(time.perf_counter(), thread_times() if train and num_ids >= _TIMED_INSERT else None)


class WorstHeld:
    """The longest a lookup that inserted (or brought rows back from disk) held its table: what growing costs the
    table's other requests. Split into the thread's CPU time, its wait for a core, and the rest (blocked), each the
    worst of its own."""

    def __init__(self) -> None:
        self.wall_s = self.cpu_s = self.runnable_s = self.blocked_s = 0.0

    def record(self, held: Held) -> None:
        """A lookup holding the lock since ``held`` ends now."""
        spent = thread_times() - held.times if held.times is not None else None  # read inside the wall time's span
        wall = time.perf_counter() - held.wall
        self.wall_s = max(self.wall_s, wall)
        if spent is not None:
            self.cpu_s = max(self.cpu_s, spent.cpu_s)
            self.runnable_s = max(self.runnable_s, spent.runnable_s)
            self.blocked_s = max(self.blocked_s, wall - spent.cpu_s - spent.runnable_s)

    def stats(self) -> dict[str, float]:
        return dict(worst_insert_s=self.wall_s, worst_insert_cpu_s=self.cpu_s, worst_insert_runnable_s=self.runnable_s,
                    worst_insert_blocked_s=self.blocked_s)


class LockWaits:
    """The wall time requests waited to take a table's lock, in all: behind the shard's demoter, its expiry, a
    checkpoint's copy of the rows, or another request. What the table's background work costs its requests beyond
    their own CPU: at 100M rows, 40M of them in memory, a steady Zipf lookup waited 0.8 ms of its 11.4 ms through the
    shard."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = 0.0
        self._clock = clock

    @contextlib.contextmanager
    def holding(self, lock) -> Iterator[None]:
        """``lock`` held for the block, the wait to take it counted."""
        self.take(lock)
        try:
            yield
        finally:
            lock.release()

    def take(self, lock) -> None:
        """Takes ``lock``, the wait to take it counted; the caller releases it."""
        began = self._clock()
        lock.acquire()
        self.seconds += self._clock() - began  # the lock held: no other request adds meanwhile


class HeldLocks:
    """The locks of the tables one request holds, as a context manager: taken in the tables' name order (so that two
    requests never wait on each other), the wait to take each counted (:class:`LockWaits`). :meth:`let_go` lets them
    go for a while (a lookup's disk part reads without them) and takes them again.

    ``locks``: each table's ``(lock, its LockWaits, its WorstHeld)``, in name order; ``asked`` and ``train``: the
    request's ids and kind. :attr:`held`: when the locks were last taken (:class:`Held`); a training lookup's hold
    before it lets them go is among each table's worst (:class:`WorstHeld`).
    """

    __slots__ = ("_locks", "_asked", "_train", "held")

    def __init__(self, locks: Sequence[tuple[object, "LockWaits", WorstHeld]], asked: int = 0, train: bool = False) -> None:
        self._locks = locks
        self._asked, self._train = asked, train
        self.held: Held | None = None

    def __enter__(self) -> "HeldLocks":
        self._take()
        return self

    def __exit__(self, *exc) -> None:
        self._release()

    @contextlib.contextmanager
    def let_go(self) -> Iterator[None]:
        """The locks let go for the block, and taken again after it (also when it fails)."""
        if self._train:
            for _, _, worst in self._locks:
                worst.record(self.held)
        self._release()
        try:
            yield
        finally:
            self._take()

    def _take(self) -> None:
        taken = 0
        try:
            for lock, waits, _ in self._locks:
                waits.take(lock)
                taken += 1
        except BaseException:
            for lock, _, _ in reversed(self._locks[:taken]):
                lock.release()
            raise
        self.held = Held.now(self._asked, self._train)

    def _release(self) -> None:
        for lock, _, _ in reversed(self._locks):
            lock.release()


class DiskOperation(NamedTuple):
    """One operation's disk work: its CPU, when it ended (Unix time), its wall time, its kind, and of its CPU the
    kernel's part and the part that demoted rows. Ordered by CPU first (a tuple)."""

    cpu_s: float = 0.0
    at: float = 0.0
    wall_s: float = 0.0
    of: str = ""
    sys_s: float = 0.0
    demoting_s: float = 0.0


class DiskWork:
    """The CPU a table's lock holder spends in the disk tier's work (reads from disk, promotions, demotions) during
    one operation (a request, or one step of the shard's demoter), and the :data:`WORST_KEPT` worst such operations
    so far (:attr:`worst_operations`; the worst, :attr:`worst`): how long the disk tier held the table's other
    requests, on a core of its own. Of each, ``sys_s`` is the kernel's part (page faults, reclaim,
    ``pread``/``pwrite``) and ``demoting_s`` the part that demoted rows (a request demotes what it needs when the
    demoter lags): the two remedies differ. The kernel's part is as fine as the kernel's split of a thread's time, by
    its scheduler ticks (1 to 4 ms): it says something of operations of tens of ms, nothing of shorter ones. ``at``
    (when it ended) and ``wall_s`` place it in time, to compare with what else the machine did then (a stall of the
    whole machine slows every thread's memory accesses alike): keeping several, an operation a stall inflated does
    not hide the worst one of the table's own. Called holding the table's lock."""

    def __init__(self) -> None:
        self._spent = self._sys = self._demoting = 0.0
        self._depth = 0
        self._started = (0.0, 0.0)
        self._kept: list[DiskOperation] = []  # a min-heap by CPU

    @contextlib.contextmanager
    def operation(self, kind: str) -> Iterator[None]:
        """One operation of ``kind`` (what it was, e.g. ``"lookup"``): the disk work timed within it is summed, and
        the sum kept if it is among the worst."""
        self._spent = self._sys = self._demoting = 0.0
        began = time.perf_counter()
        try:
            yield
        finally:
            if self._spent > 0.0 and (len(self._kept) < WORST_KEPT or self._spent > self._kept[0].cpu_s):
                kept = DiskOperation(self._spent, time.time(), time.perf_counter() - began, kind,
                                     min(self._sys, self._spent), min(self._demoting, self._spent))
                (heapq.heappush if len(self._kept) < WORST_KEPT else heapq.heapreplace)(self._kept, kept)
            self._spent = self._sys = self._demoting = 0.0

    @property
    def worst(self) -> DiskOperation:
        """The worst operation so far (all zeros before any did disk work)."""
        return max(self._kept, default=DiskOperation())

    @property
    def worst_operations(self) -> list[dict[str, float | str]]:
        """The :data:`WORST_KEPT` worst operations so far, the worst first, each as the fields of :class:`DiskOperation`."""
        return [operation._asdict() for operation in sorted(self._kept, reverse=True)]

    @contextlib.contextmanager
    def timed(self, demoting: bool = False) -> Iterator[None]:
        """Disk work (nested calls count once); ``demoting``: it demotes rows."""
        started = time.thread_time()
        if self._depth == 0:
            self._started = (started, _kernel_time())
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            now = time.thread_time()
            if demoting:
                self._demoting += now - started
            if self._depth == 0:
                self._spent += now - self._started[0]
                self._sys += _kernel_time() - self._started[1]


def _kernel_time() -> float:
    """Seconds the calling thread ran in the kernel (0 where the platform does not count it per thread)."""
    if _RUSAGE_THREAD is None:
        return 0.0
    return resource.getrusage(_RUSAGE_THREAD).ru_stime
