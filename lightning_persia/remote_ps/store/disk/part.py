"""A table's disk part: what a table does with the rows its memory does not hold.

The table keeps its rows in memory and its lock, and hands the lock to its part. A table of ``storage="disk"`` has
a :class:`DiskPart`, which owns the disk tier (``tier.py``) and the work that only such a table does: a lookup's
misses read ahead without the lock and filled from disk, the rows read handed to the table to bring into memory
(:class:`Promotion`) or queued for the demoter (``promotions.py``), an update's absent rows read, evicted rows written
to disk (demoted: :meth:`DiskPart.keep_evicted`), and the demoter's steps (compaction, mapping). A memory table has
:class:`NoDisk`, which answers each of these with "nothing on disk", so the table calls its part without asking
which it has.

The part never moves rows into or out of memory itself: it reads and writes the tier, and the table (which holds
the lock and orchestrates its parts) makes room through its memory limit, places the rows and tells the part they
moved (:meth:`DiskPart.promoted`). So a request goes down through the table to the part once. The part asks its
table's rows in memory through :class:`Memory` (``memory_rows.MemoryRows`` is one), never through the table's
privates.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator, Optional, Protocol

import torch

from lightning_persia.remote_ps.store import eviction
from lightning_persia.remote_ps.store.chunked_rows import FieldSpec
from lightning_persia.remote_ps.store.disk.demoter import SLICE_ROWS
from lightning_persia.remote_ps.store.disk.promotions import PendingPromotion, PendingPromotions
from lightning_persia.remote_ps.store.disk.read_ahead import ReadAhead
from lightning_persia.remote_ps.store.disk.records import take_records
from lightning_persia.remote_ps.store.disk.frozen_tier import FrozenTier
from lightning_persia.remote_ps.store.disk.tier import DiskTier
from lightning_persia.remote_ps.store.errors import InvalidRequestError, StoreError
from lightning_persia.remote_ps.store.thread_clock import DiskOperation, DiskWork
from lightning_persia.remote_ps.table_config import TableConfig


class Memory(Protocol):
    """What a disk part asks of its table's memory (the table's lock held for each call)."""

    config: TableConfig
    lock: object

    @property
    def memory_rows(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def inserted(self) -> int: ...

    def find_again(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool) -> None: ...


@dataclass(frozen=True)
class Promotion:
    """Rows read from disk that the table brings into memory: ``ids`` (unique), at
    ``slots`` on disk, their ``values`` by field; ``step``: the lookup step that read them (LRU; None: the table's
    step now); ``keep``: rows the operation under way goes on to write, which the room made for these must not
    demote. A lookup's: ``where``, its positions of the rows, and ``inverse``, the id of each (None: no id repeated)."""

    ids: torch.Tensor
    slots: torch.Tensor
    values: dict[str, torch.Tensor]
    step: Optional[int] = None
    keep: Optional[torch.Tensor] = None
    where: Optional[torch.Tensor] = None
    inverse: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Gap:
    """What a lookup does between its two holds of the table's lock: the records it reads (``ahead``), the rows it
    demotes (``shortfall``)."""

    ahead: Optional[ReadAhead]
    shortfall: int


class NoDisk:
    """The disk part of a memory table: no row is ever on disk, and an evicted row is gone."""

    record_bytes = 0
    map_bytes = 0
    rows = 0
    closed = False
    promotes_later = False

    def __init__(self, memory: Memory) -> None:
        self.memory = memory
        self._config = memory.config

    def check_request(self, n: int) -> None:
        """A memory table takes a request of any size: it evicts what does not fit."""

    def evict_count(self, needed: int) -> int:
        """Rows to evict when ``needed`` more must fit: a bulk of them (:func:`eviction.bulk_size`)."""
        return eviction.bulk_size(needed, self._config.capacity)

    def operation(self, kind: str) -> ContextManager[None]:
        return contextlib.nullcontext()

    def timed(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def gap(self, ids: torch.Tensor, rows: torch.Tensor, train: bool) -> Optional[Gap]:
        return None

    def rejoin(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, gap: Optional[Gap],
               inserted: int) -> None:
        """Back under the lock that another table's lookup let go: the misses probed again where the memory took in
        ids meanwhile (``inserted``: its count when the lock was let go)."""
        if self.memory.inserted != inserted:
            self.memory.find_again(ids, torch.nonzero(rows < 0).squeeze(1), rows, out, train)

    def fill(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, missing: int,
             gap: Optional[Gap]) -> tuple[int, Optional[Promotion]]:
        return missing, None

    def remove(self, ids: torch.Tensor) -> None:
        pass

    def saved_rows(self, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """No row is on disk: ``({}, ids)``."""
        return {}, ids

    def spill(self, block: dict[str, torch.Tensor], room: int) -> dict[str, torch.Tensor]:
        return block

    def expire(self, limit: int, dropped: Callable[[torch.Tensor], None]) -> int:
        return 0

    def freeze(self, with_map: bool = True) -> Optional[FrozenTier]:
        return None

    def attach(self, segments: Iterable, adopt_map: Optional[Callable] = None) -> None:
        raise StoreError(f"table {self._config.name!r} has no disk tier")

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        """The keys of :meth:`DiskPart.stats`, each zero."""
        return dict(demoted=0, promoted=0, disk_rows=0, disk_bytes=0, disk_map_bytes=0, disk_mapped_bytes=0,
                    disk_mapped_budget_bytes=0, pending_promotions=0,
                    **{f"worst_disk_work_{name}": value for name, value in DiskOperation()._asdict().items()},
                    worst_disk_works=[])


class DiskPart:
    """The disk tier of one table, under ``directory`` (its own), and the requests' work on it.

    ``memory``: the table's rows in memory, whose ``lock`` (the table's) this part holds for its work; ``mapped_bytes``: of its records, how many
    bytes the shard keeps mapped at most (``segment_mapping.py``); ``promote_later``: a training lookup leaves the
    rows it read from disk to the shard's demoter (:meth:`take_pending`) instead of handing them to the table to bring
    into memory (``promotions.py``).
    """

    def __init__(self, memory: Memory, directory: str, field_specs: dict[str, FieldSpec], mapped_bytes: int,
                 promote_later: bool) -> None:
        self.memory = memory
        self.config = memory.config
        self.lock = memory.lock
        self._tier = DiskTier(directory, field_specs, memory.lock, mapped_bytes)
        self.record_bytes = self._tier.record_bytes  # of a record on disk: a table's memory demotes where it is not 0
        self.promotes_later = promote_later
        """Whether a training lookup leaves the rows it read from disk to the demoter (:meth:`take_pending`)."""
        self._pending = PendingPromotions() if promote_later else None
        self._work = DiskWork()
        self._counters = dict(demoted=0, promoted=0)

    @property
    def map_bytes(self) -> int:
        return self._tier.map_bytes

    @property
    def rows(self) -> int:
        """Rows on disk (live)."""
        return self._tier.rows

    @property
    def closed(self) -> bool:
        """Whether the tier was deleted (the table dropped)."""
        return self._tier.closed


    def check_request(self, n: int) -> None:
        """A training request must fit in the table's memory budget: every row it touches comes into memory."""
        if n > self.config.capacity:
            raise InvalidRequestError(f"table {self.config.name!r}: a request of {n} ids is larger than the table's memory "
                                      f"budget of {self.config.capacity} rows a shard (its capacity); split the request or raise it")

    def operation(self, kind: str) -> ContextManager[None]:
        """One operation of the table's of ``kind`` (a request, a step of the demoter): the disk work within it is
        timed, and kept among the worst (:class:`DiskWork`)."""
        return self._work.operation(kind)

    def timed(self) -> ContextManager[None]:
        """Disk work of the operation under way, timed (:meth:`DiskWork.timed`): the table's promotions count so."""
        return self._work.timed()

    def evict_count(self, needed: int) -> int:
        """Rows to demote when ``needed`` more must fit: the demoter keeps room ahead (``demoter.py``), so no more."""
        return needed

    # ---- a lookup ---------------------------------------------------------------------------------

    def gap(self, ids: torch.Tensor, rows: torch.Tensor, train: bool) -> Optional[Gap]:
        """What a lookup whose memory probe found ``rows`` does without the lock: the records of its misses that are
        on disk to read (:meth:`DiskTier.begin_read`), the rows to demote for it (:meth:`_room_to_make`); None: it
        finishes holding the lock. The lock held."""
        ahead = None
        if self._tier.rows:
            positions = torch.nonzero(rows < 0).squeeze(1)
            if positions.numel():
                with self._work.operation("lookup's id map probe"), self._work.timed():
                    ahead = self._tier.begin_read(positions, ids[positions])
        shortfall = self._room_to_make(rows) if train else 0
        return None if ahead is None and not shortfall else Gap(ahead, shortfall)

    def _room_to_make(self, rows: torch.Tensor) -> int:
        """The rows a training lookup that found ``rows`` demotes between its two holds of the lock
        (:meth:`~.table.Table.demote`): of those it may bring into memory (one per id it missed), the ones beyond the free rows
        now, where they are more than a slice; else 0 (up to a slice is demoted with the lock held)."""
        free = self.config.capacity - self.memory.memory_rows
        if free + SLICE_ROWS >= rows.numel():  # the usual case, the demoter's headroom free: no count
            return 0
        short = int((rows < 0).sum()) - free
        return short if short > SLICE_ROWS else 0

    def end_read(self, gap: Gap) -> None:
        """Ends the read ahead of ``gap``, if any (the lock held)."""
        if gap.ahead is not None:
            self._tier.end_read()

    def rejoin(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, gap: Optional[Gap],
               inserted: int) -> None:
        """Back under the lock after a lookup let it go (its read ended): where the memory took in ids meanwhile
        (``inserted``: its count when the lock was let go), the misses that may be in memory now are probed again
        (:meth:`Memory.find_again`). Of the positions whose records ``gap`` read, those no longer on disk at the slot
        read (another request, or the demoter's promotions, brought the row in meanwhile), as a row is in memory or
        on disk, never both; else every miss. Raises :class:`StoreError` where the table was dropped meanwhile."""
        if self._tier.closed:
            raise StoreError(f"table {self.config.name!r} was dropped during the lookup")
        if self.memory.inserted == inserted:
            return
        ahead = gap.ahead if gap is not None else None
        if ahead is None or ahead.records is None:
            positions = torch.nonzero(rows < 0).squeeze(1)
        else:
            positions = ahead.positions[~self._tier.still_holds(ahead.ids, ahead.slots, ahead.records)]
        self.memory.find_again(ids, positions, rows, out, train)

    def fill(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, missing: int,
             gap: Optional[Gap]) -> tuple[int, Optional[Promotion]]:
        """Fills the rows of ``out`` that the memory did not hold (``missing`` of them) from disk (the records read
        ahead where still valid); a training lookup hands them to the table to bring into memory (the
        :class:`Promotion` returned, whose ``where`` the table sets in ``rows``), or queues them for the demoter to
        (``promotions.py``). Rows read from disk and left there are -2. Returns the ids still missing (-1 in ``rows``,
        the promotion's aside) and the promotion, if any. The lock held."""
        if not self._tier.rows:
            return missing, None
        ahead = gap.ahead if gap is not None else None
        with self._work.timed():
            if ahead is None:
                positions = torch.nonzero(rows < 0).squeeze(1)
                wanted = ids[positions]
                slots, records = self._tier.find(wanted)
            else:
                positions, wanted = ahead.positions, ahead.ids
                slots, records = self._tier.find(wanted, ahead)
            hit = slots >= 0
            if ahead is not None:
                hit &= rows[positions] < 0  # the second probe found the others in memory
            at = torch.nonzero(hit).squeeze(1)
            promotion = None
            if at.numel():
                read = take_records(records, at)
                values = self._tier.unpack(read)
                where = positions[at]
                out[where] = values["weights"]
                if train:
                    promotion = self._bring_in(wanted[at], slots[at], read, values, where, repeats=ahead is None or ahead.repeats)
                if promotion is None:
                    rows[where] = -2
            left = int((rows[positions] == -1).sum())
            return (left - promotion.where.numel() if promotion is not None else left), promotion

    def _bring_in(self, ids: torch.Tensor, slots: torch.Tensor, records: torch.Tensor, values: dict[str, torch.Tensor],
                  where: torch.Tensor, repeats: bool) -> Optional[Promotion]:
        """The promotion of the rows a training lookup read from disk (at ``where`` of its rows), or None where they
        were queued for the demoter (while its queue has room). An id the request ``repeats`` is promoted once. The
        lock held."""
        first = inverse = None
        if repeats:
            ids, inverse = torch.unique(ids, return_inverse=True)
            first = torch.empty(ids.numel(), dtype=torch.int64).scatter_(0, inverse, torch.arange(inverse.numel()))
            slots, records = slots[first], take_records(records, first)
        if self._pending is not None and self._pending.has_room(ids.numel()):
            self._pending.add(PendingPromotion(ids, slots, records, self.memory.step, self._tier.generation))
            return None
        if first is not None:
            values = {name: v[first] for name, v in values.items()}
        return Promotion(ids, slots, values, where=where, inverse=inverse)

    # ---- rows between the tiers -------------------------------------------------------------------

    def take_pending(self, limit: int) -> tuple[int, Optional[Promotion]]:
        """The oldest batch of rows that training lookups read from disk and left to the demoter (at most ``limit``
        rows of it; see ``promotions.py``): how many were taken from the queue, and the promotion of those still on
        disk at the slot they were read from (None: none). The demoter's :meth:`~.table.Table.promote_pending` calls
        it, the lock held."""
        batch = self._pending.take(limit) if self._pending is not None else None
        if batch is None:
            return 0, None
        if self._tier.closed or batch.generation != self._tier.generation:  # dropped: the rows stay where they are
            return batch.ids.numel(), None
        still = self._tier.still_holds(batch.ids, batch.slots, batch.records)  # so not in memory either (promotions.py)
        at = torch.nonzero(still).squeeze(1)
        if not at.numel():
            return batch.ids.numel(), None
        return batch.ids.numel(), Promotion(batch.ids[at], batch.slots[at], self._tier.unpack(take_records(batch.records, at)),
                                            batch.step)

    def read(self, ids: torch.Tensor, keep: torch.Tensor) -> Optional[Promotion]:
        """The promotion of the rows of ``ids`` (unique, absent from memory) found on disk (an update applies to
        them), or None; ``keep``: the rows in memory the update goes on to write. The lock held, within the table's
        :meth:`operation` and :meth:`timed`."""
        slots, records = self._tier.find(ids)
        hit = slots >= 0
        if not bool(hit.any()):
            return None
        return Promotion(ids[hit], slots[hit], self._tier.unpack(take_records(records, hit)), keep=keep)

    def promoted(self, promotion: Promotion) -> None:
        """The rows of ``promotion`` are in memory now: their records on disk become garbage. The lock held."""
        self._tier.forget(promotion.ids, promotion.slots)
        self._counters["promoted"] += promotion.ids.numel()

    def keep_evicted(self, ids: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Writes the rows of ``ids`` being evicted to disk (demoted), ``values`` their fields of a record but the id,
        before anything else changes: a failure raises with the rows where they were. The rows stay (on disk), so
        they are no removal. (A memory table's :class:`NoDisk`, whose ``record_bytes`` are 0, keeps none: the table
        removes them.) The lock held."""
        if not ids.numel():
            return
        with self._work.timed(demoting=True):
            self._tier.write({"ids": ids, **values})
        self._counters["demoted"] += ids.numel()

    def spill(self, block: dict[str, torch.Tensor], room: int) -> dict[str, torch.Tensor]:
        """The rows of a loaded block that fit in ``room`` rows of memory; the others are written to disk."""
        if block["ids"].numel() <= room:
            return block
        room = max(room, 0)
        self._tier.write({name: values[room:] for name, values in block.items() if name in self._tier.specs})
        return {name: values[:room] for name, values in block.items()}

    def remove(self, ids: torch.Tensor) -> None:
        """Drops the rows of ``ids`` found on disk (a delta's row replaces them, or they were removed). The lock held."""
        self._tier.remove(ids)

    def saved_rows(self, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``({field: values} of the ids (unique) on disk, the ids not on disk)``, read and left there: a handover's
        round ships a changed row that was demoted since as it is on disk, not as a removal. The lock held."""
        if not ids.numel() or not self._tier.rows:
            return {}, ids
        with self._work.timed():
            slots, records = self._tier.find(ids)
        hit = slots >= 0
        return self._tier.unpack(take_records(records, hit)), ids[~hit]

    def expire(self, limit: int, dropped: Callable[[torch.Tensor], None]) -> int:
        """Drops the rows on disk whose access value is at or below ``limit`` (see :meth:`DiskTier.expire`)."""
        return self._tier.expire(limit, self.lock, dropped=dropped)

    # ---- the demoter's steps ----------------------------------------------------------------------

    def compact(self) -> int:
        """A step of compacting the disk tier's sparsest segment (see :meth:`DiskTier.compact_step`); returns the rows
        moved. The shard's demoter calls it between requests; its holds of the lock count as disk work."""
        return self._tier.compact_step(self._compaction_work)

    @contextlib.contextmanager
    def _compaction_work(self) -> Iterator[None]:
        with self._work.operation("compaction"), self._work.timed():
            yield

    def map_pages(self) -> int:
        """A step of mapping the disk tier's most read segments (see :meth:`DiskTier.map_step`); returns the bytes
        mapped. The shard's demoter calls it between requests; the lock is held only to choose and publish the pages."""
        return self._tier.map_step()

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the disk tier's records in the shard's page tables."""
        return self._tier.mapped_bytes

    def set_mapped_budget(self, nbytes: int) -> None:
        """How many bytes of the disk tier's records the next steps of :meth:`map_pages` may keep mapped
        (``mapped_budget.py``)."""
        self._tier.set_mapped_budget(nbytes)

    # ---- checkpoints, and the end -------------------------------------------------------------------

    def freeze(self, with_map: bool = True) -> FrozenTier:
        """The disk tier at a checkpoint's point (:meth:`DiskTier.freeze`); the lock held."""
        return self._tier.freeze(with_map)

    def attach(self, segments: Iterable, adopt_map: Optional[Callable] = None) -> None:
        """Takes the disk segments of a checkpoint saved by this shard, and its id map (see :meth:`DiskTier.attach`)."""
        with self.lock:
            self._tier.attach(segments, adopt_map)

    def close(self) -> None:
        """Deletes the disk tier (a table replaced or dropped; a checkpoint keeps the files it linked)."""
        with self.lock:
            if self._pending is not None:
                self._pending.clear()
            self._tier.destroy()

    def stats(self) -> dict:
        """The disk statistics of the table; the lock held."""
        tier = self._tier
        return dict(self._counters, disk_rows=tier.rows, disk_bytes=tier.disk_bytes, disk_map_bytes=tier.map_bytes,
                    disk_mapped_bytes=tier.mapped_bytes, disk_mapped_budget_bytes=tier.mapped_budget,
                    pending_promotions=len(self._pending) if self._pending is not None else 0,
                    **{f"worst_disk_work_{name}": value for name, value in self._work.worst._asdict().items()},
                    worst_disk_works=self._work.worst_operations)


Part = NoDisk | DiskPart
