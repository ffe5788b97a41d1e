"""The disk tier of a table: the rows its memory budget does not hold, in immutable segment files.

A row leaves memory (a *demotion*) as one record, ``[id | weights | optimizer state | access]``, appended to the
table's open segment; a segment holds :data:`SEGMENT_ROWS` records and is never written again once full (a
checkpoint links it instead of copying it). Each segment has a sidecar of its ids, so the id map can be rebuilt
without reading the records. A row read back into memory (a *promotion*) leaves its record behind as garbage:
its slot is no longer live. A full segment whose live rows fell below :data:`compaction.COMPACT_BELOW` of its records is
*compacted* (:meth:`DiskTier.compact_step`, called by the shard's demoter): its live rows are written anew at the end
of the tier, into segments apart from the demotions', then its files are deleted, so that a workload that brings
the same rows in and out again and again does not grow the files without end.

The id map (``DiskMap``) keeps an 8-byte entry an id in memory (a fingerprint and the slot), at loads of 0.6
to 0.85: a billion rows on disk take ~12 GB of map, against ~60 bytes a row in memory. A lookup confirms each match against the id in
the record it reads, in file order, in one native call (``read_records``): a copy from a segment mapped
ahead of the reads (``segment_mapping.py``), a ``pread`` from any other.

Faults: a write that fails (a full disk) raises :class:`DiskTierError` before anything changes, so the rows stay
where they were; a segment that is missing or shorter than its rows raises :class:`DiskTierError` naming it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Optional

import numpy as np
import torch

from lightning_persia.remote_ps.store import native
from lightning_persia.remote_ps.store.chunked_rows import FieldSpec
from lightning_persia.remote_ps.store.disk import compaction
from lightning_persia.remote_ps.store.disk.frozen_tier import FrozenTier, segment_files
from lightning_persia.remote_ps.store.disk.read_ahead import ReadAhead
from lightning_persia.remote_ps.store.disk.records import (DISK_FIELDS, link, live_slots, packed_columns, pread_records,
                                                           record_ids, record_specs, take_records, unpack, write_all)
from lightning_persia.remote_ps.store.disk.segment_mapping import MAPPED_BYTES, SegmentMapping
from lightning_persia.remote_ps.store.errors import StoreError
from lightning_persia.remote_ps.store.native.disk_map import DiskMap
from lightning_persia.remote_ps.store.native.records import get_bits, read_records, set_bits

SEGMENT_SHIFT = 22
SEGMENT_ROWS = 1 << SEGMENT_SHIFT
"""Records a segment holds (~200 MB at dim 16 in fp16)."""
_SWEEP_ROWS = 1 << 18  # records an expiry sweep reads at a time
MAX_SEGMENTS = ((1 << 32) - 2) >> SEGMENT_SHIFT  # at once: slots are 32-bit in the id map (compaction frees numbers)


class DiskTierError(StoreError):
    """The disk tier could not write or read: a full disk, a missing, short or damaged segment."""


class DiskTier:
    """The rows of one table kept on disk under ``directory`` (created; its files belong to this tier alone).

    Example::

        tier = DiskTier(path, {"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float16, 16), ...})
        tier.write({"ids": ids, "weights": w, "state": s, "access": a})
        found, rows = tier.take(ids)     # read back and removed from disk
    """

    def __init__(self, directory: str | os.PathLike, specs: dict[str, FieldSpec], lock: Optional[threading.Lock] = None,
                 mapped_bytes: int = MAPPED_BYTES) -> None:
        """``lock``: the table's (a checkpoint copies the id map a part at a time holding it); a tier of its own by default.
        ``mapped_bytes``: records kept in the shard's page tables, at most (:class:`SegmentMapping`)."""
        if not native.available():
            raise StoreError("storage 'disk' needs the native kernels (see lightning_persia.remote_ps.store.native.available)")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.specs = record_specs(specs)
        self.record_bytes = sum(spec.row_bytes for spec in self.specs.values())
        self._lock = lock if lock is not None else threading.Lock()
        self._map = DiskMap()
        self._fds: list[int] = []  # the records' file of each segment (-1: gone)
        self._mapping = SegmentMapping(self.record_bytes, SEGMENT_ROWS * self.record_bytes, mapped_bytes)
        self._id_fds: list[int] = []
        self._live: list[torch.Tensor] = []  # a bit per slot of each segment: the slot holds a live row
        self._written: list[int] = []  # records written in each segment
        self._next = 0  # the next slot a demotion writes
        self._next_moved = 0  # the next slot compaction writes: a segment apart (see _append)
        self._fd_table = torch.empty(0, dtype=torch.int64)
        self._live_table = torch.empty(0, dtype=torch.int64)  # the address of each segment's live bits (0: none)
        self._live_counts = torch.empty(0, dtype=torch.int64)  # live rows of each segment
        self._saves = 0  # checkpoints being saved (freeze until FrozenTier.release): they link the segments
        self.written_bytes = 0
        self.closed = False
        self._readers = 0  # reads under way without the table's lock (begin_read)
        self._map_removals = self._map_inserts = 0  # calls that removed from (added to) the id map: a read ahead's slots
        # hold while no entry was removed; an added one may only name an id the read found nowhere
        self._close_deferred = False
        self._generation = 0  # segment numbers written anew so far: a slot's record holds while this stays

    # ---- writes ------------------------------------------------------------------------------------------

    def write(self, rows: dict[str, torch.Tensor]) -> None:
        """Appends the rows (``{field: values}``; their ids absent from the tier) and makes them findable.

        Raises :class:`DiskTierError` when the disk refuses the bytes: the tier is then as it was.
        """
        ids = rows["ids"]
        if not ids.numel():
            return
        slots, self._next = self._append(self._pack(rows), ids, self._next, "in memory")
        self._map.insert(ids, slots)
        self._map_inserts += 1  # an id a read ahead found nowhere may have been admitted and demoted meanwhile
        self._live_counts += set_bits(self._live_table, SEGMENT_SHIFT, slots, True)

    def _append(self, records: torch.Tensor, ids: torch.Tensor, at: int, rows_stay: str) -> tuple[torch.Tensor, int]:
        """Writes packed ``records`` of ``ids`` into the segment files from slot ``at`` on; returns their slots and
        the slot after them. The caller makes them findable (the id map, the live bits). ``rows_stay``: where the
        rows stay if the disk refuses them. A segment is written from its start only once the one before is full (or
        sealed by a save): the lowest number compaction deleted, unless a save is under way (it counts the slots past
        its point as later ones).

        Compaction writes into segments of its own, apart from the demotions' (:meth:`write` from its cursor,
        :meth:`compact_step` from another). The rows it moves are the ones left behind in their segment, cold; the
        rows just demoted are the ones reads find on disk most (those near memory's horizon). Mixed, compaction's
        moves made about half of the records of the newest segments, which the mapping (``segment_mapping.py``)
        keeps in the page tables as the most read."""
        n = ids.numel()
        chunks, position = [], 0
        try:
            while position < n:
                if not at & (SEGMENT_ROWS - 1):
                    at = self._segment_to_open() << SEGMENT_SHIFT
                segment, offset = at >> SEGMENT_SHIFT, at & (SEGMENT_ROWS - 1)
                count = min(n - position, SEGMENT_ROWS - offset)
                self._open_segment(segment)
                write_all(self._fds[segment], records[position : position + count], offset * self.record_bytes)
                write_all(self._id_fds[segment], ids[position : position + count].contiguous().view(torch.uint8), offset * 8)
                self._written[segment] = max(self._written[segment], offset + count)
                chunks.append(torch.arange(at, at + count))
                position, at = position + count, at + count
        except OSError as err:
            raise DiskTierError(f"the disk tier at {self.directory} could not write {n} rows: {err.strerror or err}"
                                f" (the rows stay {rows_stay})") from None
        self._mapping.changed()
        self.written_bytes += n * (self.record_bytes + 8)
        return torch.cat(chunks), at

    def _segment_to_open(self) -> int:
        """The segment to write next, the last one full: the lowest number compaction deleted (or a checkpoint left
        out) where no save is under way, else a new one."""
        if not self._saves:
            for segment, fd in enumerate(self._fds):
                if fd < 0:
                    return segment
        return len(self._fds)

    def _open_segment(self, segment: int) -> None:
        if segment < len(self._fds) and self._fds[segment] >= 0:
            return
        if segment >= MAX_SEGMENTS:
            raise OSError(0, f"the tier holds at most {MAX_SEGMENTS} segments at once")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        records = os.open(self._path(segment, "rows"), flags, 0o644)
        try:
            ids = os.open(self._path(segment, "ids"), flags, 0o644)
        except OSError:
            os.close(records)
            os.unlink(self._path(segment, "rows"))
            raise
        bits = torch.zeros(SEGMENT_ROWS >> 3, dtype=torch.uint8)
        if segment < len(self._fds):  # a number compaction deleted (or a checkpoint left out), written anew
            self._generation += 1
            self._fds[segment], self._id_fds[segment], self._live[segment], self._written[segment] = records, ids, bits, 0
        else:
            self._fds.append(records)
            self._id_fds.append(ids)
            self._live.append(bits)
            self._written.append(0)
        self._segments_changed()

    def _segments_changed(self) -> None:
        self._mapping.grow(len(self._fds))
        self._fd_table = torch.tensor(self._fds, dtype=torch.int64)
        self._live_table = torch.tensor([bits.data_ptr() if bits.numel() else 0 for bits in self._live], dtype=torch.int64)
        more = len(self._live) - self._live_counts.numel()
        if more > 0:
            self._live_counts = torch.cat([self._live_counts, torch.zeros(more, dtype=torch.int64)])

    def _path(self, segment: int, kind: str) -> Path:
        records, ids = segment_files(self.directory, segment)
        return records if kind == "rows" else ids

    # ---- reads -------------------------------------------------------------------------------------------

    def find(self, ids: torch.Tensor, ahead: Optional[ReadAhead] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, records)``: each id's slot (-1 when not on disk) and its record (uint8 ``[n, record_bytes]``,
        read for the ids found). ``ahead``: records of these same ``ids`` read without the lock (:meth:`begin_read`);
        an id whose slot is still the one read keeps its record (a written record never changes, and no segment is
        deleted while a read is under way), any other is read now."""
        if ahead is not None and ahead.records is not None:
            slots, records = ahead.slots, ahead.records
            unread = slots[:0]
            removals, inserts = ahead.map_changes
            if removals != self._map_removals or inserts != self._map_inserts:
                slots, unread = self._changed_since(ids, slots, removals != self._map_removals)
            pending = torch.nonzero(slots >= 0).squeeze(1)
        else:
            slots = self._map.find(ids)
            records = torch.empty(ids.numel(), self.record_bytes, dtype=torch.uint8)
            pending = unread = torch.nonzero(slots >= 0).squeeze(1)
        skip = None
        while pending.numel():
            if unread.numel():
                self._read(slots[unread], records, unread)
            stored = record_ids(records, pending)
            wrong = pending[stored != ids[pending]]
            if not wrong.numel():
                break
            if skip is None:
                skip, slots = torch.zeros_like(ids), slots.clone()  # the read ahead's slots stay as they were read
            skip[wrong] += 1  # a fingerprint shared with another id (odds ~2^-32): the next match, if any
            slots[wrong] = self._map.find(ids[wrong], skip[wrong])
            pending = unread = wrong[slots[wrong] >= 0]
        return slots, records

    def _changed_since(self, ids: torch.Tensor, slots: torch.Tensor, removed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, unread)`` of ``ids`` now, where a read ahead found ``slots`` and the id map changed since: the
        slots whose record left (``removed``: entries were removed meanwhile) or ids found nowhere then are looked up
        again; ``unread``, the positions whose slot is new. A slot still live is still its id's (an id is on disk at
        most once, and no segment is deleted while a read is under way), so only the others are probed: a Zipf
        request's promotions, which the demoter makes between requests, left most of them as they were."""
        again = slots < 0
        if removed:
            again |= ~get_bits(self._live_table, SEGMENT_SHIFT, slots)
        positions = torch.nonzero(again).squeeze(1)
        now = self._map.find(ids[positions])
        slots = slots.clone()
        slots[positions] = now
        return slots, positions[now >= 0]

    def still_holds(self, ids: torch.Tensor, slots: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
        """Whether each id is still on disk at the slot whose record (a row of uint8 ``records``) was read for it:
        the slot is live and the record is the id's (not another's whose fingerprint it shares). Call it holding the
        table's lock, while the :attr:`generation` of the read lasts: a segment deleted since has no live slot, and
        its number written anew would hold other records."""
        stored = record_ids(records)
        return get_bits(self._live_table, SEGMENT_SHIFT, slots) & (stored == ids)

    def begin_read(self, positions: torch.Tensor, ids: torch.Tensor) -> Optional[ReadAhead]:
        """The slots of ``ids`` (at ``positions`` of a request) on disk, to read with :meth:`ReadAhead.read` without
        the table's lock, or None (none of them on disk, or closed). Call it holding the lock, and :meth:`end_read`
        holding it once the read is used: the files stay open until then, whatever closes the tier meanwhile."""
        if self.closed:
            return None
        slots = self._map.find(ids)
        if not bool((slots >= 0).any()):
            return None
        self._mapping.changed()
        mapping = self._mapping
        ahead = ReadAhead(positions, ids, slots, (self._fd_table, mapping.bases, mapping.mapped, mapping.reads, SEGMENT_SHIFT),
                          self.record_bytes, (self._map_removals, self._map_inserts))
        self._readers += 1
        return ahead

    def end_read(self) -> None:
        """A read of :meth:`begin_read` is over (the table's lock held); the last one closes a tier closed meanwhile."""
        self._readers -= 1
        if self._close_deferred and not self._readers:
            self._close_files()

    @property
    def generation(self) -> int:
        """Changes whenever a segment's number is written anew: a record read from a slot stays that slot's while
        the generation it was read in lasts (slots are otherwise written once)."""
        return self._generation

    def take(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The rows of ``ids`` found on disk, removed from it: ``(positions in ids, {field: values})``."""
        slots, records = self.find(ids)
        found = torch.nonzero(slots >= 0).squeeze(1)
        rows = self.unpack(take_records(records, found))
        self.forget(ids[found], slots[found])
        return found, rows

    def remove(self, ids: torch.Tensor) -> int:
        """Drops the rows of ``ids`` found on disk; returns how many were."""
        slots, _ = self.find(ids)
        found = slots >= 0
        self.forget(ids[found], slots[found])
        return int(found.sum())

    def forget(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Drops the rows of ``ids`` at ``slots`` (as :meth:`find` gave them): their records become garbage."""
        self._map.remove(ids, slots)
        self._map_removals += 1
        self._live_counts -= set_bits(self._live_table, SEGMENT_SHIFT, slots, False)

    def _read(self, slots: torch.Tensor, records: torch.Tensor, positions: torch.Tensor) -> None:
        slots, order = torch.sort(slots)  # in file order: neighbouring records share the pages read
        try:
            self._mapping.changed()
            mapping = self._mapping
            read_records(self._fd_table, mapping.bases, mapping.mapped, mapping.reads, SEGMENT_SHIFT, slots, records,
                         into=positions[order])
        except OSError as err:
            raise DiskTierError(f"the disk tier at {self.directory} could not read: {err.strerror or err}") from None

    def map_step(self) -> int:
        """A step of mapping the segments ahead of their reads (see :class:`SegmentMapping`); returns the bytes
        mapped. Takes the table's lock to choose the pages and to publish them, not while it reads them in."""
        with self._lock:
            if self.closed:
                return 0
            job = self._mapping.plan(self._fd_table, torch.tensor(self._written, dtype=torch.int64))
        if job is None:
            return 0
        populated = False
        try:
            self._mapping.populate(job)
            populated = True
        finally:
            with self._lock:
                mapped = self._mapping.publish(job, populated)
        return mapped

    # ---- records -----------------------------------------------------------------------------------------

    def _pack(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        n = rows["ids"].numel()
        parts = [rows[name].to(spec.dtype).contiguous().view(torch.uint8).reshape(n, spec.row_bytes)
                 for name, spec in self.specs.items()]
        return torch.cat(parts, dim=1)

    def unpack(self, records: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{field: values}`` of uint8 records ``[n, record_bytes]``."""
        return unpack(records, self.specs)

    def expire(self, limit: int, lock, dropped: Callable[[torch.Tensor], None] = lambda ids: None) -> int:
        """Drops the live rows whose access value is at or below ``limit`` (see :mod:`expiry`); returns how many.

        Reads each segment's records a block at a time without ``lock`` (a written record never changes), then takes
        ``lock`` (the table's) only to drop the block's expired rows that are still live, and tells ``dropped`` their
        ids with it held.
        """
        with lock:
            if self.closed:
                return 0
            self._readers += 1  # the files stay open for the sweep, whatever closes the tier meanwhile
        try:
            return self._expire(limit, lock, dropped)
        finally:
            with lock:
                self.end_read()

    def _expire(self, limit: int, lock, dropped_ids: Callable[[torch.Tensor], None]) -> int:
        offset = sum(spec.row_bytes for name, spec in self.specs.items() if name in DISK_FIELDS[: DISK_FIELDS.index("access")])
        dropped = 0
        for segment in range(len(self._fds)):
            fd, written = self._fds[segment], self._written[segment]
            for start in range(0, written if fd >= 0 else 0, _SWEEP_ROWS):
                n = min(_SWEEP_ROWS, written - start)
                try:
                    records = pread_records(fd, start, n, self.record_bytes)
                except OSError as err:
                    if err.errno != errno.ENODATA:
                        raise
                    raise DiskTierError(f"disk segment {self._path(segment, 'rows')} ends before its {written} rows") from None
                access = packed_columns(records, offset, 4).view(torch.int32).reshape(-1)
                old = torch.nonzero(access <= limit).squeeze(1)
                if not old.numel():
                    continue
                with lock:
                    flags = np.unpackbits(self._live[segment].numpy(), count=written, bitorder="little")
                    old = old[torch.from_numpy(flags[(old + start).numpy()].astype(bool))]
                    ids = record_ids(records, old)
                    self.forget(ids, old + start + (segment << SEGMENT_SHIFT))
                    if ids.numel():
                        dropped_ids(ids)
                dropped += old.numel()
        return dropped

    # ---- compaction --------------------------------------------------------------------------------------

    def compact_step(self, holding: Callable[[], ContextManager] = contextlib.nullcontext) -> int:
        """Moves up to 16,384 live rows of the sealed segment with the fewest of them (see :meth:`_sparsest`) to the
        end of the tier, the first live rows of its first :data:`compaction._COMPACT_SPAN` records from its first live one;
        deletes the segments left without a live row (once no read is under way and no save holds them). Returns
        the rows moved. Takes the table's lock to choose and to move the rows, not while it reads their records (the
        span from the first to the last, in one read); a row that left the segment meanwhile is not moved. Each hold
        of the lock runs within ``holding()`` (the table times its disk work so)."""
        with self._lock, holding():
            if self.closed:
                return 0
            self._delete_emptied()
            segment = self._sparsest()
            if segment is None:
                return 0
            local = compaction.first_live(self._live[segment], self._written[segment])
            self._readers += 1  # the segment's file stays open for the read
            fd = self._fds[segment]
        first, count = int(local[0]), int(local[-1] - local[0]) + 1
        try:
            records = take_records(pread_records(fd, first, count, self.record_bytes), local - first)
        except OSError as err:
            raise DiskTierError(f"the disk tier at {self.directory} could not read segment {segment} to compact it: "
                                f"{err.strerror or err}") from None
        finally:
            with self._lock:
                self.end_read()
        slots = local + (segment << SEGMENT_SHIFT)
        with self._lock, holding():
            if self.closed:
                return 0
            local = slots & (SEGMENT_ROWS - 1)
            still = ((self._live[segment][local >> 3] >> (local & 7)) & 1).bool()
            slots, records = slots[still], take_records(records, still)
            if not slots.numel():
                return 0
            ids = record_ids(records)
            moved, self._next_moved = self._append(records, ids, self._next_moved, f"in segment {segment}")  # a failure changes nothing
            self._map.move(ids, slots, moved)  # every one present: their slots were live
            self._map_removals += 1  # a read ahead that found the old slots reads them again
            self._live_counts -= set_bits(self._live_table, SEGMENT_SHIFT, slots, False)
            self._live_counts += set_bits(self._live_table, SEGMENT_SHIFT, moved, True)
            return slots.numel()

    def _sparsest(self) -> Optional[int]:
        """The sealed segment to compact next, if any (:func:`compaction.sparsest`)."""
        return compaction.sparsest(self._written, self._live_counts, self._fd_table >= 0, self._sealed)

    def _sealed(self) -> torch.Tensor:
        """Which segments the tier writes no more (a mask): every one with files but those its demotions and its
        compaction write into next."""
        sealed = self._fd_table >= 0
        for at in (self._next, self._next_moved):
            if at & (SEGMENT_ROWS - 1):  # at a segment's start, a cursor's next rows open another: none is written now
                sealed[at >> SEGMENT_SHIFT] = False
        return sealed

    def _delete_emptied(self) -> None:
        """Deletes the files of the sealed segments without a live row, unless a read is under way (its tables name
        them) or a save holds them (it links them)."""
        if self._readers or self._saves:
            return
        empty = torch.nonzero(self._sealed() & (self._live_counts == 0)).squeeze(1).tolist()
        emptied = [segment for segment in empty if not self._mapping.in_flight(segment)]
        for segment in emptied:
            self._mapping.drop(segment)
            for fd in (self._fds[segment], self._id_fds[segment]):
                os.close(fd)
            self._fds[segment] = self._id_fds[segment] = -1
            self._live[segment] = torch.zeros(0, dtype=torch.uint8)
            for kind in ("rows", "ids"):
                self._path(segment, kind).unlink(missing_ok=True)
        if emptied:
            self._segments_changed()

    # ---- checkpoints -------------------------------------------------------------------------------------

    def freeze(self, with_map: bool = True) -> FrozenTier:
        """The tier at this point (its table's lock held): the open segments are sealed, later rows go to new ones.
        ``with_map``: the id map is saved as at the point too (a checkpoint's; a live move reads the segments alone,
        and a map save that no partition copy ends logs every removal until it ends)."""
        written = [(segment, rows) for segment, rows in enumerate(self._written) if self._fds[segment] >= 0 and rows]
        self._next = len(self._fds) << SEGMENT_SHIFT  # past every segment: no slot below it is written until the save ends
        self._next_moved = 0  # at a segment's start: compaction's next rows open one (past the point, while the save lasts)
        if with_map:
            self._map.save_begin(self._next)  # every slot written from now on is past the point
        self._saves += 1
        return FrozenTier(self.directory, written, [self._live[segment][: (rows + 7) >> 3].clone() for segment, rows in written],
                          self._map if with_map else None, self._lock, self._save_ended)

    def _save_ended(self) -> None:
        self._saves -= 1

    def attach(self, files: Iterator[tuple[int, int, Path, Path, torch.Tensor]],
               adopt_map: Optional[Callable[[DiskMap], None]] = None) -> None:
        """Takes segments of a checkpoint, ``(number, rows, records file, ids file, live bits)`` each: links their
        files into this (empty) tier, then indexes the ids of their live slots: ``adopt_map`` (the checkpoint's saved
        map: ``id_map_file.adopt``) maps them, else they are read from the ids files and inserted."""
        if self._fds:
            raise DiskTierError(f"the disk tier at {self.directory} is not empty")
        for segment, rows, records, ids, live in files:
            while len(self._fds) < segment:  # numbers not in the checkpoint: no file
                self._fds.append(-1)
                self._id_fds.append(-1)
                self._live.append(torch.zeros(0, dtype=torch.uint8))
                self._written.append(0)
            for source, target in ((records, self._path(segment, "rows")), (ids, self._path(segment, "ids"))):
                link(source, target)
            self._fds.append(os.open(self._path(segment, "rows"), os.O_RDWR))
            self._id_fds.append(os.open(self._path(segment, "ids"), os.O_RDWR))
            bits = torch.zeros(SEGMENT_ROWS >> 3, dtype=torch.uint8)
            bits[: live.numel()] = live
            self._live.append(bits)
            self._written.append(rows)
            self._next = (segment + 1) << SEGMENT_SHIFT
            if adopt_map is not None:
                continue
            stored = torch.from_numpy(np.fromfile(self._path(segment, "ids"), dtype="<i8", count=rows))
            if stored.numel() != rows:
                raise DiskTierError(f"disk segment {ids} holds {stored.numel()} ids, not {rows}")
            slots = live_slots(live, rows)
            self._map.insert(stored[slots], slots + (segment << SEGMENT_SHIFT))
        self._segments_changed()
        self._live_counts = torch.tensor([int(np.bitwise_count(bits.numpy()).sum()) for bits in self._live], dtype=torch.int64)
        if adopt_map is not None:
            adopt_map(self._map)
            live_rows = int(self._live_counts.sum())
            if self._map.info()[0] != live_rows:
                raise DiskTierError(f"the id map of the checkpoint holds {self._map.info()[0]} ids, its live bits {live_rows}")

    # ---- bookkeeping -------------------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        """Rows on disk (live)."""
        return self._map.info()[0]

    @property
    def map_bytes(self) -> int:
        return self._map.info()[1]

    @property
    def disk_bytes(self) -> int:
        """Bytes the tier's files take on the disk (garbage records included)."""
        return sum(os.fstat(fd).st_blocks * 512 for fd in self._fds + self._id_fds if fd >= 0)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of records in the shard's page tables (:meth:`map_step`)."""
        return self._mapping.bytes

    @property
    def mapped_budget(self) -> int:
        """Bytes of records :meth:`map_step` may keep in the shard's page tables."""
        return self._mapping.budget

    def set_mapped_budget(self, nbytes: int) -> None:
        """A new :attr:`mapped_budget`: later steps map up to it, or unmap the least read segments down to it."""
        self._mapping.set_budget(nbytes)

    def close(self) -> None:
        """Closes the files (the tier cannot be used after); with reads under way (:meth:`begin_read`), the last
        one's :meth:`end_read` does."""
        self.closed = True
        if self._readers:
            self._close_deferred = True
        else:
            self._close_files()

    def _close_files(self) -> None:
        self._close_deferred = False
        self._mapping.close()
        for fd in self._fds + self._id_fds:
            if fd >= 0:
                os.close(fd)
        self._fds, self._id_fds = [], []
        self._segments_changed()

    def destroy(self) -> None:
        """Closes and deletes the tier's files (a checkpoint that linked them keeps its own links)."""
        self.close()
        for path in self.directory.glob("segment-*"):
            path.unlink()
        try:
            self.directory.rmdir()
        except OSError:
            pass
