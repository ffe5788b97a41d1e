"""How many bytes of its disk tables' records a shard with a memory limit keeps mapped: what the limit leaves.

A read of a mapped record is a memory copy; a read of any other is a ``pread``, whose page-cache lookup was most of
the 2.6 ms a Zipf(1.1) request at 100M rows, 40M in memory, spent in the kernel (0.5 ms on the memory table). Where
the tier's files fit in the machine's memory, the page cache holds their pages whether they are mapped or not: mapping them
changes what the shard's resident memory counts, not what the machine holds. So a shard given a memory limit
(``PSConfig.memory_limit_mb``) maps records up to it, and gives mapped pages back as its rows and id maps grow:
each pass of the demoter, the room left under the limit, less :data:`MARGIN` of it (the requests' own short-lived
memory), is shared out among the disk tables (``SegmentMapping.set_budget``). Without a limit, each table keeps a
fixed budget (``PSConfig.disk_mapped_mb``).
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

MARGIN = 1 / 16
"""Of the memory limit, kept free of mapped records for what requests allocate while they run."""


def resident_bytes() -> int:
    """This process's resident memory (Linux's ``/proc/self/statm``): its mapped records included."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MappedBudget:
    """Shares out the room a shard's ``limit_bytes`` leaves among its disk tables' mappings.

    Example::

        budget = MappedBudget(16 << 30)
        budget.apply(disk_parts)   # each disk part's mapping may hold its share of the room (DiskPart.set_mapped_budget)
    """

    def __init__(self, limit_bytes: int, resident: Callable[[], int] = resident_bytes) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"a memory limit must be > 0 bytes, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._resident = resident

    def apply(self, tables: Sequence) -> None:
        """Sets each table's mapped budget: what it maps now, and an equal share of the room under the limit (its
        share of the excess where the shard is over it: the mappings give back the memory the rest took)."""
        if not tables:
            return
        mapped = [table.mapped_bytes for table in tables]
        others = self._resident() - sum(mapped)  # rows, id maps, buffers: what the mappings must leave room for
        room = int(self.limit_bytes * (1 - MARGIN)) - others - sum(mapped)
        share = room // len(tables)
        for table, held in zip(tables, mapped):
            table.set_mapped_budget(max(0, held + share))
