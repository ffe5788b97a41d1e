"""Which of a table's holders of its lock go first: its requests, before the shard's background work.

A disk table's demoter does its work (promotions, demotions, compaction) a step at a time with the table's lock
held. A step taken while a request is in the table makes the request wait for it, and, on a machine of few cores,
takes a core from it. Between two requests of a trainer the shard is busy elsewhere (gRPC, the client), and the
table is free. :class:`RequestGate` counts the requests in the table (from their first hold of the lock to their
return, their reads between two holds included) and lets the background work wait, a bounded time, for none to be.

The wait is bounded so that the work never falls behind requests that keep the table busy without a pause (several
clients, or a caller in the same process): then it runs as it did without the gate, between two holds of a request.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Sequence


class RequestGate:
    """The requests in one table now; background work waits for none (:meth:`wait_quiet`)."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._inside = 0
        self.waited_s = 0.0
        """Seconds the background work spent waiting for the table to be quiet (read by the table's stats)."""

    @property
    def inside(self) -> int:
        """Requests in the table now."""
        return self._inside

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """A request's time in the table."""
        with self._changed:
            self._inside += 1
        try:
            yield
        finally:
            with self._changed:
                self._inside -= 1
                if not self._inside:
                    self._changed.notify_all()

    def wait_quiet(self, timeout_s: float) -> bool:
        """Waits until no request is in the table, ``timeout_s`` at most; returns whether none is."""
        with self._changed:
            if not self._inside:
                return True
            began = time.perf_counter()
            quiet = self._changed.wait_for(lambda: not self._inside, timeout_s)
            self.waited_s += time.perf_counter() - began
            return quiet


@contextlib.contextmanager
def all_inside(gates: Sequence[RequestGate]) -> Iterator[None]:
    """One request's time in several tables at once."""
    with contextlib.ExitStack() as stack:
        for gate in gates:
            stack.enter_context(gate.request())
        yield
