"""A shard's background work over its tables (demotion, expiry): a daemon thread that runs a pass every interval.

Every thread started is stopped at interpreter exit, before the interpreter tears down what a pass calls (a pass
caught mid-way by the teardown aborted the process with "terminate called" in the native kernels).
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Callable, Iterable


class TablePass:
    """Runs :meth:`run_once` every ``interval_s`` on a daemon thread named ``name``, until :meth:`stop`.

    ``tables()`` gives the tables of each pass; :attr:`errors` counts the passes' failures (a subclass logs them and
    goes on: a failed pass is retried at the next interval); :attr:`cpu_s`, the CPU its thread spent in passes."""

    def __init__(self, tables: Callable[[], Iterable], interval_s: float, name: str) -> None:
        self._tables = tables
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.errors = 0
        self.cpu_s = 0.0

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()

    def start(self) -> None:
        self._thread.start()
        _started.add(self)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def run_once(self) -> int:
        """One pass over the tables; returns how much it did (rows)."""
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            began = time.thread_time()
            try:
                self.run_once()
            finally:
                self.cpu_s += time.thread_time() - began


_started: "weakref.WeakSet[TablePass]" = weakref.WeakSet()


@atexit.register
def stop_all() -> None:
    """Stops every pass started in this process and waits for it: at interpreter exit, and where one process runs
    shard stores one after another (tests), so that no pass outlives its store's use."""
    for running in list(_started):
        running.stop()
