"""Demotion off the request path: a shard's thread keeps each disk table's memory tier below its budget.

A request that needs rows the memory tier does not have free would otherwise demote colder rows itself, with the
table's lock held: a lookup that inserted 131,072 new ids into a full 100M-row table spent up to 1.5 s of CPU so.
:class:`Demoter` instead demotes a table's coldest rows whenever its memory tier holds
more than its budget less half of :data:`HEADROOM_FRACTION`, down to the budget less all of it, :data:`SLICE_ROWS` at a
time, the table's lock held for one slice only. A request then finds free rows, and demotes only when the rows
it brings in exceed the headroom left (the budget is a hard limit: it demotes what it needs, no more): a slice at
most with its lock held, more a slice at a time between its two holds of the lock (``Table.demote``).

Before demoting, it promotes the rows training lookups read from disk and queued for it (``promotions.py``): the
lookup answered with them, and bringing them into memory is left to this thread, :data:`SLICE_ROWS` with the lock held.

Between demotions it maps the segments that reads hit most into the shard's page tables, a step at a time
(``DiskTier.map_step``; with a memory limit, first sharing out what the limit leaves, ``mapped_budget.py``): a read
of a mapped record is a memory copy instead of a ``pread``; and it compacts a
segment that holds more garbage than live rows, once the tier holds more than its bound of garbage, a step a pass
(``DiskTier.compact_step``).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Optional

from lightning_persia.remote_ps.store.background import TablePass
from lightning_persia.remote_ps.store.disk.mapped_budget import MappedBudget

HEADROOM_FRACTION = 1 / 16
"""Of a disk table's memory budget, kept free for the rows requests bring in (demotion starts at half of it used)."""
SLICE_ROWS = 1 << 14
"""Rows demoted with a table's lock held, at most. A request that waits for the lock waits for what is left of a
slice, so slices are kept short; the cold threshold is estimated once every few slices, not once a slice."""
_SLICES_AN_ESTIMATE = 8  # slices demoted by one estimate of the cold threshold (a sample of 65,536 access values)
_PROMOTIONS_A_PASS = 16  # slices of queued promotions a pass (SLICE_ROWS each at most), the lock taken for each
_MAP_STEPS = 8  # map steps of a table a pass (16 MB each), the lock taken for each
_log = logging.getLogger(__name__)


def demotion_target(capacity: int, memory_rows: int) -> int:
    """How many rows to demote from a disk table of ``capacity`` rows a shard holding ``memory_rows`` in memory: 0
    until it holds more than its budget less half the headroom; then down to the budget less all of it."""
    headroom = int(capacity * HEADROOM_FRACTION)
    if memory_rows <= capacity - headroom // 2:
        return 0
    return memory_rows - (capacity - headroom)


class Demoter(TablePass):
    """Demotes the rows of each of ``tables()`` (its disk tables, ``table.py``) beyond :func:`demotion_target`, every
    ``interval_s``, on a daemon thread, until :meth:`stop`; with a ``mapped_budget``, sizes their mappings to it."""

    def __init__(self, tables: Callable[[], Iterable], interval_s: float = 0.01, mapped_budget: Optional[MappedBudget] = None) -> None:
        super().__init__(tables, interval_s, "persia-ps-demoter")
        self._mapped_budget = mapped_budget

    def run_once(self) -> int:
        """One pass over the tables: the promotions its lookups queued (``promotions.py``), then the rows each needs
        demoted, a slice at a time, then a few steps of mapping its most read segments and a step of compacting its
        sparsest one; returns the rows demoted."""
        demoted = 0
        tables = list(self._tables())
        if self._mapped_budget is not None:
            self._mapped_budget.apply([table.disk for table in tables])
        for table in tables:
            part = table.disk
            try:
                for _ in range(_PROMOTIONS_A_PASS):
                    if not table.promote_pending(SLICE_ROWS):
                        break
                    time.sleep(0)
                target = demotion_target(table.config.capacity, table.memory_rows)
                slices = 0
                while target > 0 and not self.stopping:
                    if slices % _SLICES_AN_ESTIMATE == 0:  # the rows requests touched meanwhile left the cold ones
                        estimated = table.cold_estimate(target)
                    moved = table.demote(min(target, SLICE_ROWS), estimated)
                    if not moved:
                        break
                    demoted, target, slices = demoted + moved, target - moved, slices + 1
                    time.sleep(0)  # a request waiting for the lock gets it between two slices
                for _ in range(_MAP_STEPS):
                    if not part.map_pages():
                        break
                    time.sleep(0)
                if not self.stopping:
                    part.compact()
            except Exception:  # noqa: BLE001 - a failed demotion (a full disk) is retried; requests demote what they must
                self.errors += 1
                _log.exception("the demoter's pass over table %r failed; retried in %.2f s", table.config.name, self._interval_s)
        return demoted
