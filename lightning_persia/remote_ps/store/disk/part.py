"""A table's disk part: what a table does with the rows its memory does not hold.

The table keeps its rows in memory and its lock, and hands the lock to its part. A table of ``storage="disk"`` has
a :class:`DiskPart`, which owns the disk tier (``tier.py``) and the work that only such a table does: a lookup's
misses read ahead without the lock and filled from disk, the rows read brought into memory or queued for the
demoter (``promotions.py``), an update's absent rows promoted first, evicted rows written to disk (demoted), room
made, and the demoter's steps (promotions, demotion, compaction, mapping). A memory table has :class:`NoDisk`,
which answers each of these with "nothing on disk", so the table calls its part without asking which it has.

A lookup hands its part (its parts: one per table of the request) the misses of its memory probe and the tables'
locks in one call, :func:`look_up`, which reads what is on disk with the locks let go and fills the rows from it.
The part asks its table's rows in memory through :class:`Memory` (``memory_rows.MemoryRows`` is one), never through
the table's privates.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Iterator, Optional, Protocol, Sequence

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
from lightning_persia.remote_ps.store.thread_clock import DiskOperation, DiskWork, HeldLocks
from lightning_persia.remote_ps.table_config import TableConfig


class Memory(Protocol):
    """What a disk part asks of its table's memory (the table's lock held for each call but :meth:`cold_estimate`)."""

    config: TableConfig
    lock: object

    @property
    def memory_rows(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def inserted(self) -> int: ...

    def find_rows(self, ids: torch.Tensor) -> torch.Tensor: ...

    def find_again(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool) -> None: ...

    def place(self, ids: torch.Tensor, values: dict[str, torch.Tensor], step: Optional[int],
              keep: Optional[torch.Tensor]) -> torch.Tensor: ...

    def evict_coldest(self, count: int, estimated: Optional[tuple[int, float]] = None,
                      keep: Optional[torch.Tensor] = None) -> None: ...

    def cold_estimate(self, count: int) -> Optional[tuple[int, float]]: ...


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

    def gap(self, ids: torch.Tensor, rows: torch.Tensor, train: bool) -> Optional[Gap]:
        return None

    def rejoin(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, gap: Optional[Gap],
               inserted: int) -> None:
        """Back under the lock that another table's lookup let go: the misses probed again where the memory took in
        ids meanwhile (``inserted``: its count when the lock was let go)."""
        if self.memory.inserted != inserted:
            self.memory.find_again(ids, torch.nonzero(rows < 0).squeeze(1), rows, out, train)

    def fill(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, missing: int,
             gap: Optional[Gap]) -> int:
        return missing

    def promote_absent(self, ids: torch.Tensor) -> None:
        pass

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
    rows it read from disk to :meth:`promote_pending` (the shard's demoter calls it) instead of bringing them into
    memory itself (``promotions.py``).
    """

    def __init__(self, memory: Memory, directory: str, field_specs: dict[str, FieldSpec], mapped_bytes: int,
                 promote_later: bool) -> None:
        self.memory = memory
        self.config = memory.config
        self.lock = memory.lock
        self._tier = DiskTier(directory, field_specs, memory.lock, mapped_bytes)
        self.record_bytes = self._tier.record_bytes  # of a record on disk: a table's memory demotes where it is not 0
        self._pending = PendingPromotions() if promote_later else None
        self._work = DiskWork()
        self._counters = dict(demoted=0, promoted=0)

    @property
    def map_bytes(self) -> int:
        return self._tier.map_bytes

    def check_request(self, n: int) -> None:
        """A training request must fit in the table's memory budget: every row it touches comes into memory."""
        if n > self.config.capacity:
            raise InvalidRequestError(f"table {self.config.name!r}: a request of {n} ids is larger than the table's memory "
                                      f"budget of {self.config.capacity} rows a shard (its capacity); split the request or raise it")

    def operation(self, kind: str) -> ContextManager[None]:
        """One operation of the table's of ``kind`` (a request, a step of the demoter): the disk work within it is
        timed, and kept among the worst (:class:`DiskWork`)."""
        return self._work.operation(kind)

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
        (:meth:`demote`): of those it may bring into memory (one per id it missed), the ones beyond the free rows
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
             gap: Optional[Gap]) -> int:
        """Fills the rows of ``out`` that the memory did not hold (``missing`` of them) from disk (the records read
        ahead where still valid); a training lookup brings them into memory (their ``rows`` set), or queues them for
        the demoter to (``promotions.py``). Rows read from disk and left there are -2. Returns the ids still missing
        (-1). The lock held."""
        if not self._tier.rows:
            return missing
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
            if at.numel():
                read = take_records(records, at)
                values = self._tier.unpack(read)
                where = positions[at]
                out[where] = values["weights"]
                if not train:
                    rows[where] = -2
                else:
                    self._bring_in(wanted[at], slots[at], read, values, where, rows, repeats=ahead is None or ahead.repeats)
            return int((rows[positions] == -1).sum())

    def _bring_in(self, ids: torch.Tensor, slots: torch.Tensor, records: torch.Tensor, values: dict[str, torch.Tensor],
                  where: torch.Tensor, rows: torch.Tensor, repeats: bool) -> None:
        """Promotes the rows a training lookup read from disk (at ``where`` of its ``rows``), or queues them for the
        demoter while its queue has room. An id the request ``repeats`` is promoted once. The lock held."""
        first = inverse = None
        if repeats:
            ids, inverse = torch.unique(ids, return_inverse=True)
            first = torch.empty(ids.numel(), dtype=torch.int64).scatter_(0, inverse, torch.arange(inverse.numel()))
            slots, records = slots[first], take_records(records, first)
        if self._pending is not None and self._pending.has_room(ids.numel()):
            self._pending.add(PendingPromotion(ids, slots, records, self.memory.step, self._tier.generation))
            rows[where] = -2
            return
        if first is not None:
            values = {name: v[first] for name, v in values.items()}
        promoted = self._promote(ids, slots, values)
        rows[where] = promoted if inverse is None else promoted[inverse]

    # ---- rows between the tiers -------------------------------------------------------------------

    def promote_pending(self, limit: int) -> int:
        """Promotes the oldest batch of rows that training lookups read from disk and left to the demoter (at most
        ``limit`` rows of it; see ``promotions.py``), those still on disk at the slot they were read from; returns
        how many were taken from the queue. The demoter calls it between requests, the lock held for one call."""
        if self._pending is None:
            return 0
        with self.lock, self._work.operation("promotion"), self._work.timed():
            batch = self._pending.take(limit)
            if batch is None:
                return 0
            if self._tier.closed or batch.generation != self._tier.generation:  # dropped: the rows stay where they are
                return batch.ids.numel()
            still = self._tier.still_holds(batch.ids, batch.slots, batch.records)  # so not in memory either (promotions.py)
            at = torch.nonzero(still).squeeze(1)
            if at.numel():
                self._promote(batch.ids[at], batch.slots[at], self._tier.unpack(take_records(batch.records, at)), batch.step)
            return batch.ids.numel()

    def promote_absent(self, ids: torch.Tensor) -> None:
        """Brings the rows of ``ids`` (unique) that are on disk into memory (an update applies to them). The lock held."""
        if not self._tier.rows:
            return
        found = self.memory.find_rows(ids)
        absent = torch.unique(ids[found < 0])
        if not absent.numel():
            return
        with self._work.operation("update"), self._work.timed():
            slots, records = self._tier.find(absent)
            hit = slots >= 0
            if bool(hit.any()):
                self._promote(absent[hit], slots[hit], self._tier.unpack(take_records(records, hit)), keep=found[found >= 0])

    def _promote(self, ids: torch.Tensor, slots: torch.Tensor, values: dict[str, torch.Tensor], step: Optional[int] = None,
                 keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Moves rows read from disk (``ids`` unique, at ``slots``) into memory; returns their rows. ``step``: the
        lookup step that read them (LRU; the table's step now by default); ``keep``: rows the operation under way
        goes on to write, which the room made for these must not demote. The lock held."""
        rows = self.memory.place(ids, values, step, keep)  # may demote colder rows: written to disk first
        self._tier.forget(ids, slots)
        self._counters["promoted"] += ids.numel()
        return rows

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

    def demote(self, count: int, estimated: Optional[tuple[int, float]] = None, of: str = "demotion") -> int:
        """Moves ``count`` of the coldest rows of the table's memory to disk; returns how many moved (0: closed).
        Selects them by ``estimated`` (:meth:`cold_estimate`; made now if None). The shard's demoter calls it between
        requests, a slice at a time; a lookup whose rows the demoter left no room for, between its two holds of the
        lock. Its disk work counts as an operation ``of`` that kind (:class:`DiskWork`).

        :data:`SLICE_ROWS` at a time, the lock taken for each slice and let go between: one request demoting all it
        needs with the lock held kept every other request of the table waiting for all of it (a lookup that
        inserted 131,072 ids held a billion-row table's lock for 0.378 s of demoting so)."""
        if count <= 0:
            return 0
        if estimated is None:
            estimated = self.memory.cold_estimate(count)
        moved = 0
        while moved < count:
            with self.lock, self._work.operation(of):
                if self._tier.closed:
                    return moved
                before = self._counters["demoted"]
                self.memory.evict_coldest(min(count - moved, SLICE_ROWS, self.memory.memory_rows), estimated)
                step = self._counters["demoted"] - before
            if not step:
                return moved
            moved += step
        return moved

    def cold_estimate(self, count: int) -> Optional[tuple[int, float]]:
        """The access value at or below which the ``count`` coldest rows in memory lie (the table's estimate)."""
        return self.memory.cold_estimate(count)

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
_NONE_OPEN = contextlib.nullcontext()  # a lookup's disk operations where none was opened (reusable)


def look_up(parts: Sequence[Part], ids: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
            train: bool, locks: HeldLocks) -> tuple[list[Optional[int]], ContextManager]:
    """The rest of a lookup of one or more tables once their memory was probed, every table's lock held (``locks``):
    for each table, its part, the ``ids`` it was asked, the ``rows`` its memory probe found (-1 where it missed) and
    its ``outs``. The records of the misses that are on disk are read with the locks let go, and the room a training
    lookup needs is made meanwhile (:meth:`DiskPart.demote`); the locks taken again, each table probes its memory
    again where it changed meanwhile (:meth:`DiskPart.rejoin`), then fills its misses from disk (a training lookup
    brings those rows into memory: :meth:`DiskPart.fill`).

    Returns, for each table, the ids still missing (-1 in its ``rows``; None: its memory held every id), and the
    parts' disk operations of the lookup, still open: the caller admits the missing ids within them (what that
    demotes is the lookup's disk work), then closes them."""
    gaps: list[Optional[Gap]] = []
    try:
        for part, wanted, found in zip(parts, ids, rows):
            gaps.append(part.gap(wanted, found, train))
    except BaseException:  # the reads the others began end before the error goes on up
        _end_reads(parts, gaps)
        raise
    if any(gaps):
        inserted = []  # each memory's count of ids taken in, before the locks are let go
        for part in parts:
            inserted.append(part.memory.inserted)
        try:
            with locks.let_go():
                for gap in gaps:
                    if gap is not None and gap.ahead is not None:
                        gap.ahead.read()
                for part, gap in zip(parts, gaps):
                    if gap is not None:
                        part.demote(gap.shortfall, of="a lookup's demotion, a slice")
        finally:  # the locks taken again: every read ends, also when one failed, before any table's rejoin may fail
            _end_reads(parts, gaps)
        for part, wanted, found, out, gap, before in zip(parts, ids, rows, outs, gaps, inserted):
            part.rejoin(wanted, found, out, train, gap, before)  # every table's, before any changes a row
    operations = None  # made for the first miss: a lookup its memory answered whole opens none
    left: list[Optional[int]] = []
    try:
        for part, wanted, found, out, gap in zip(parts, ids, rows, outs, gaps):
            missing = int((found < 0).sum())
            if not missing:
                left.append(None)
                continue
            if operations is None:
                operations = contextlib.ExitStack()
            operations.enter_context(part.operation("lookup"))
            left.append(part.fill(wanted, found, out, train, missing, gap))
    except BaseException:
        if operations is not None:
            operations.close()
        raise
    return left, operations if operations is not None else _NONE_OPEN


def _end_reads(parts: Sequence[Part], gaps: Sequence[Optional[Gap]]) -> None:
    """Ends the reads ahead of ``gaps`` (their tables' locks held)."""
    for part, gap in zip(parts, gaps):
        if gap is not None:
            part.end_read(gap)

