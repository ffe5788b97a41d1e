"""Promotions off the request path: the rows a training lookup read from a disk table's tier, brought into memory
by the shard's demoter thread instead of by the request.

A training lookup that misses memory reads the row's record from disk and answers with it. Bringing the row into
memory as well (a free row taken, the id indexed, its disk entry removed) cost the request about a quarter of its
CPU in process, and nothing of the answer needs it.
Where the shard runs a demoter, the lookup instead queues what it read (:class:`PendingPromotion`), and the demoter
promotes it between requests. An update of such a row before then promotes it itself (the table promotes an
update's absent rows first); a lookup of it before then reads its record again. The queue is bounded
(:data:`PENDING_ROWS`): past it, a lookup promotes what it read itself, as a table without a demoter always does.

A queued record is promoted only if it is still the row's: the slot it was read from is still live
(:meth:`DiskTier.still_holds`: an id is on disk at most once, so a live slot that held its record still does),
and the tier's :attr:`DiskTier.generation` is the one it was read in (a slot's record never changes while its
segment's number is not written anew). The id is then not in memory either: a row is in memory or on disk, never
both (bringing it in forgets its slot; demoting it writes a new one). Any other is dropped from the queue: the row
stays where it is, on disk or in memory. The live bits answer from 12.5 MB at 100M slots, where the id map (about
12 bytes an id) would take a probe of memory far larger than the caches for each row.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Optional

import torch

PENDING_ROWS = 1 << 18
"""Rows queued for promotion a table, at most (a few requests' worth; 12 MB of records at 48 bytes a record)."""


@dataclass(frozen=True)
class PendingPromotion:
    """Rows a training lookup read from disk: their ``ids`` (distinct), the ``slots`` and ``records`` read, the
    table's lookup ``step`` then (their access value under LRU) and the tier's ``generation`` then."""

    ids: torch.Tensor
    slots: torch.Tensor
    records: torch.Tensor
    step: int
    generation: int


class PendingPromotions:
    """The promotions a table's lookups left to its demoter, first queued first; at most ``limit`` rows.

    Example::

        queue = PendingPromotions()
        if queue.has_room(ids.numel()):
            queue.add(PendingPromotion(ids, slots, records, step, generation))
        batch = queue.take(16384)   # the oldest (at most 16,384 rows of it), or None
    """

    def __init__(self, limit: int = PENDING_ROWS) -> None:
        self._batches: deque[PendingPromotion] = deque()
        self._rows = 0
        self._limit = limit

    def has_room(self, n: int) -> bool:
        """Whether ``n`` more rows fit in the queue."""
        return self._rows + n <= self._limit

    def add(self, batch: PendingPromotion) -> None:
        self._batches.append(batch)
        self._rows += batch.ids.numel()

    def take(self, limit: int) -> Optional[PendingPromotion]:
        """The oldest batch, or its first ``limit`` rows (the rest stays first in the queue), no longer queued; None
        when the queue is empty."""
        if not self._batches:
            return None
        batch = self._batches[0]
        if batch.ids.numel() <= limit:
            self._batches.popleft()
        else:
            self._batches[0] = replace(batch, ids=batch.ids[limit:], slots=batch.slots[limit:], records=batch.records[limit:])
            batch = replace(batch, ids=batch.ids[:limit], slots=batch.slots[:limit], records=batch.records[:limit])
        self._rows -= batch.ids.numel()
        return batch

    def clear(self) -> None:
        self._batches.clear()
        self._rows = 0

    def __len__(self) -> int:
        """Rows queued."""
        return self._rows
