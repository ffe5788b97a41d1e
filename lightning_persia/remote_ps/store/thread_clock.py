"""Where a thread's wall time went: on a core, waiting for a core, or blocked.

A request that holds a table's lock longer than its CPU time either waited for a core (the machine is busy) or
was blocked (on the GIL, the process's memory-map lock, a page the kernel was clearing for another thread). The
two call for different remedies, and only the first is the machine's: Linux counts, per thread, the time spent
running and the time spent runnable but waiting for a core (``/proc/thread-self/schedstat``); what is left of the
wall time was spent blocked. The running time is read from the thread's CPU clock instead: the statistics' figure
for a running thread is only as recent as the scheduler's last tick, while its wait ends when it last got a core.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

_SCHEDSTAT = "/proc/thread-self/schedstat"


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
