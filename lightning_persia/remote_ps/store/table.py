"""One embedding table on one shard: the requests over its rows, each under the table's one lock.

The table keeps its rows in memory (:class:`~.memory_rows.MemoryRows`: ids, rows, optimizer state, access
statistics and change versions, and the ids admitted into them) and the lock. What it does beyond them is a part
with one entry point, called without asking which kind the table has: its disk part (``disk/part.py``: the rows its
memory does not hold, or none), to which it hands its lock; its admission of unseen ids (``admission.py``); its time
to live (``expiry.py``); its memory limit (``MemoryRows.evict_coldest``, choosing by ``eviction.py``).

The table orchestrates its parts, each called once a step, so that a request goes down one pass: a lookup probes
the memory, asks the disk part what to read for the misses, lets the lock go while it reads (and makes the room a
large lookup needs meanwhile, :meth:`Table.demote`), takes the lock again and has the part fill the misses; the rows
the part read for memory come back to the table (a :class:`~.disk.part.Promotion`), which makes room through the
memory limit (colder rows demoted: handed to the disk part to keep), places them in free rows and tells the part
they moved; then it asks its admission what to admit of the ids neither tier holds, makes room and writes them. An
update promotes its absent rows so first. A disk table's demoter asks the table for its queued promotions and
demotions (:meth:`Table.promote_pending`, :meth:`Table.demote`), the lock held for a slice at a time.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator, Optional, Sequence

import torch

from lightning_persia.remote_ps.store import eviction
from lightning_persia.remote_ps.store.admission import Admission, make_admission
from lightning_persia.remote_ps.store.disk.demoter import SLICE_ROWS as DEMOTION_SLICE_ROWS
from lightning_persia.remote_ps.store.disk.part import DiskPart, Gap, NoDisk, Promotion
from lightning_persia.remote_ps.store.disk.segment_mapping import MAPPED_BYTES
from lightning_persia.remote_ps.store.errors import StoreError
from lightning_persia.remote_ps.store.expiry import SLICE_ROWS as EXPIRY_SLICE_ROWS, TimeToLive
from lightning_persia.remote_ps.store.index import NativeIdIndex
from lightning_persia.remote_ps.store.memory_rows import MemoryRows, journal_changes
from lightning_persia.remote_ps.store.native import jobs as native
from lightning_persia.remote_ps.store.table_journal import Journal
from lightning_persia.remote_ps.store.thread_clock import HeldLocks, LockWaits, WorstHeld
from lightning_persia.remote_ps.table_config import TableConfig


class Table(MemoryRows):
    """Thread-safe store of one table's rows on one shard.

    ``lock`` serialises every read and write of the table; a caller that needs one consistent point over several
    tables holds all their locks while it calls :meth:`begin_snapshot` on each.
    """

    def __init__(self, config: TableConfig, seed: int, disk_dir: Optional[str] = None, disk_mapped_bytes: int = MAPPED_BYTES,
                 promote_later: bool = False) -> None:
        """``disk_dir``: the folder of the table's disk tier, for a table of ``storage="disk"`` (created; its own);
        ``disk_mapped_bytes``: of its records, how many bytes the shard keeps mapped at most (``segment_mapping.py``);
        ``promote_later``: a training lookup leaves the rows it read from disk to the shard's demoter
        (:meth:`promote_pending`) instead of bringing them into memory itself (``promotions.py``)."""
        super().__init__(config, seed)
        self._admission: Admission = make_admission(config, seed, self)
        self._ttl = TimeToLive(config)
        self._worst_held = WorstHeld()
        self._lock_waits = LockWaits()
        if config.storage == "disk":
            if disk_dir is None:
                raise StoreError(f"table {config.name!r} has storage 'disk' but its shard has no disk folder (PSConfig.disk_dir, "
                                 "`ps serve disk_dir=...`)")
            self._disk = DiskPart(self, disk_dir, self.field_specs, disk_mapped_bytes, promote_later)

    def locked(self) -> ContextManager[None]:
        """The table's lock held for a request, the wait to take it counted (``lock_wait_s`` in :meth:`stats`)."""
        return self._lock_waits.holding(self.lock)

    @property
    def disk(self) -> DiskPart | NoDisk:
        """The table's disk part: a :class:`DiskPart` for a table of ``storage="disk"`` (the demoter's steps), else
        :class:`NoDisk`."""
        return self._disk

    # ---- lookups -----------------------------------------------------------------------------------

    def lookup(self, ids: torch.Tensor, train: bool, dtype: torch.dtype = torch.float32, journal: Optional[Journal] = None) -> torch.Tensor:
        """Rows of ``ids`` as ``[n, dim]`` of ``dtype``; training lookups admit unseen ids.

        ``journal`` hears of the ids the lookup admitted or evicted, if any (see :data:`Journal`). A disk table reads
        the records of the ids its memory lacks without the lock, then takes it again to finish (:meth:`_from_disk`)."""
        return Table.lookup_together([(self, ids)], train, dtype, journal)[0]

    @staticmethod
    def lookup_together(requests: Sequence[tuple["Table", torch.Tensor]], train: bool, dtype: torch.dtype,
                        journal: Optional[Journal] = None) -> list[torch.Tensor]:
        """:meth:`lookup` of several tables (distinct), every table's lock held, their probes in one native call
        where every index is native."""
        tables = [table for table, _ in requests]
        if len(tables) > 1 and (len({id(t) for t in tables}) < len(tables)
                                or not all(isinstance(t._index, NativeIdIndex) for t in tables)):
            return [Table.lookup_together([request], train, dtype, journal)[0] for request in requests]
        for table, ids in requests if train else ():
            table._disk.check_request(ids.numel())
        outs = [torch.empty(ids.numel(), table.config.dim, dtype=table.storage_dtype) for table, ids in requests]
        with _all_locked(tables, sum(out.shape[0] for out in outs), train) as locks:
            rows = Table._probe(requests, outs, train)
            with Table._between_locks(requests, rows, outs, train, locks) as gaps:
                for table, gap in zip(tables, gaps):  # the room a large training lookup needs, made without the lock
                    if gap is not None:
                        table.demote(gap.shortfall, of="a lookup's demotion, a slice")
            left, promotions, disk_work = Table._from_disk(requests, rows, outs, train, gaps)
            with disk_work:
                for (table, ids), found, out, missing, promotion in zip(requests, rows, outs, left, promotions):
                    if promotion is not None:  # rows the disk part read for memory
                        promoted = table._promote(promotion)
                        found[promotion.where] = promoted if promotion.inverse is None else promoted[promotion.inverse]
                    table._start_recording(journal if train else None)
                    table._counters["lookups"] += 1
                    table._counters["lookup_rows"] += ids.numel()
                    if missing is None:  # the memory held every id
                        continue
                    admitted = table._admission.fill_missing(ids, found, out, train, missing) if missing else None
                    if admitted is not None:  # the admission decided: the table makes room and writes the rows
                        table.evict_coldest(table.rows_to_evict(admitted.count))
                        if admitted.first is not None:
                            table.admit_in_one_pass(ids, found, out, admitted.count, admitted.first)
                        else:
                            table.write_admitted(admitted.ids, admitted.initial)
                    if train:
                        table._worst_held.record(locks.held)
            journal_changes(tables, journal, always=False)
        return [out.to(dtype) for out in outs]

    @staticmethod
    def _probe(requests: Sequence[tuple["Table", torch.Tensor]], outs: list[torch.Tensor], train: bool) -> list[torch.Tensor]:
        """Each table's rows of its ids (-1: absent from memory), their values copied into its ``outs``; several
        tables' probes in one native call. Every lock held."""
        touches = [table._touch(train) for table, _ in requests]
        if len(requests) == 1:
            (table, ids), out = requests[0], outs[0]
            return [table._index.find(ids, copy=(table._rows["weights"], out), touch=touches[0])]
        rows = [torch.empty_like(ids) for _, ids in requests]
        native.find_many([table._index.find_job(ids, found, (table._rows["weights"], out), touch)
                          for (table, ids), found, out, touch in zip(requests, rows, outs, touches)])
        return rows

    @staticmethod
    @contextlib.contextmanager
    def _between_locks(requests: Sequence[tuple["Table", torch.Tensor]], rows: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                       train: bool, locks: HeldLocks) -> Iterator[list[Optional[Gap]]]:
        """What a lookup of one or more tables does between its two holds of their locks, once their memory was probed
        (``rows``: -1 where it missed), every lock held (``locks``). Each table's part says what to do without the
        lock (a :class:`Gap`, or None: :meth:`DiskPart.gap`); where any has something, the locks are let go, the
        records of the misses on disk read, and the block runs, given the gaps (the caller makes the room each
        names: :meth:`demote`); the locks taken again, each table's part probes its memory again where it changed
        meanwhile (:meth:`DiskPart.rejoin`). Where none has, the block runs with the locks held."""
        parts = [table._disk for table, _ in requests]
        gaps: list[Optional[Gap]] = []
        try:
            for part, (_, wanted), found in zip(parts, requests, rows):
                gaps.append(part.gap(wanted, found, train))
        except BaseException:  # the reads the others began end before the error goes on up
            _end_reads(parts, gaps)
            raise
        if not any(gaps):
            yield gaps
            return
        inserted = [table.inserted for table, _ in requests]  # each memory's count of ids taken in, before the let-go
        try:
            with locks.let_go():
                for gap in gaps:
                    if gap is not None and gap.ahead is not None:
                        gap.ahead.read()
                yield gaps
        finally:  # the locks taken again: every read ends, also when one failed, before any table's rejoin may fail
            _end_reads(parts, gaps)
        for part, (_, wanted), found, out, gap, before in zip(parts, requests, rows, outs, gaps, inserted):
            part.rejoin(wanted, found, out, train, gap, before)  # every table's, before any changes a row

    @staticmethod
    def _from_disk(requests: Sequence[tuple["Table", torch.Tensor]], rows: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                   train: bool, gaps: Sequence[Optional[Gap]]) -> tuple[list[Optional[int]], list[Optional[Promotion]], ContextManager]:
        """The rest of a lookup of one or more tables once their memory was probed and the records of their misses
        read (:meth:`_between_locks`), every table's lock held: each table's part fills its misses from disk
        (:meth:`DiskPart.fill`).

        Returns, for each table, the ids still missing (-1 in its ``rows``; None: its memory held every id) and the
        rows its part read for memory (a training lookup's :class:`Promotion`, else None), and the parts' disk
        operations of the lookup, still open: the caller brings those rows in and admits the missing ids within them
        (what that demotes is the lookup's disk work), then closes them."""
        parts = [table._disk for table, _ in requests]
        operations = None  # made for the first miss: a lookup its memory answered whole opens none
        left: list[Optional[int]] = []
        promotions: list[Optional[Promotion]] = []
        try:
            for part, (_, wanted), found, out, gap in zip(parts, requests, rows, outs, gaps):
                missing = int((found < 0).sum())
                if not missing:
                    left.append(None)
                    promotions.append(None)
                    continue
                if operations is None:
                    operations = contextlib.ExitStack()
                operations.enter_context(part.operation("lookup"))
                still, promotion = part.fill(wanted, found, out, train, missing, gap)
                left.append(still)
                promotions.append(promotion)
        except BaseException:
            if operations is not None:
                operations.close()
            raise
        return left, promotions, operations if operations is not None else _NONE_OPEN

    # ---- rows between the tiers ----------------------------------------------------------------------

    def _promote(self, promotion: Optional[Promotion]) -> Optional[torch.Tensor]:
        """Brings the rows of ``promotion`` (read from disk; None: none) into memory; returns their rows. Room is made
        first through the memory limit (:meth:`evict_coldest`: colder rows demoted, none of ``promotion.keep``), the
        rows placed in free rows, then dropped from disk. Timed as disk work. The lock held."""
        if promotion is None:
            return None
        with self._disk.timed():
            self.evict_coldest(self.rows_to_evict(promotion.ids.numel()), keep=promotion.keep)
            rows = self.place(promotion.ids, promotion.values, promotion.step)
            self._disk.promoted(promotion)
        return rows

    def _absent(self, ids: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Of ``ids`` (unique) that an update applies to, those absent from memory that the disk may hold (unique),
        and the rows in memory of the others, which bringing those in must not demote; None: none to look for on disk.
        The lock held."""
        if not self._disk.rows:
            return None
        found = self.find_rows(ids)
        absent = torch.unique(ids[found < 0])
        return (absent, found[found >= 0]) if absent.numel() else None

    def promote_pending(self, limit: int) -> int:
        """Promotes the oldest batch of rows that training lookups read from disk and left to the demoter (at most
        ``limit`` rows of it; :meth:`DiskPart.take_pending`); returns how many were taken from the queue. The shard's
        demoter calls it between requests, the lock held for one call."""
        if not self._disk.promotes_later:
            return 0
        with self.lock, self._disk.operation("promotion"), self._disk.timed():
            taken, promotion = self._disk.take_pending(limit)
            self._promote(promotion)
            return taken

    def demote(self, count: int, estimated: Optional[tuple[int, float]] = None, of: str = "demotion") -> int:
        """Moves ``count`` of the coldest rows of a disk table's memory to disk; returns how many moved (0: closed).
        Selects them by ``estimated`` (:meth:`cold_estimate`; made now if None). The shard's demoter calls it between
        requests, a slice at a time; a lookup whose rows the demoter left no room for, between its two holds of the
        lock. Its disk work counts as an operation ``of`` that kind (:class:`DiskWork`).

        :data:`~.disk.demoter.SLICE_ROWS` at a time, the lock taken for each slice and let go between: one request
        demoting all it needs with the lock held kept every other request of the table waiting for all of it (a
        lookup that inserted 131,072 ids held a billion-row table's lock for 0.378 s of demoting so)."""
        if count <= 0:
            return 0
        if estimated is None:
            estimated = self.cold_estimate(count)
        moved = 0
        while moved < count:
            with self.lock, self._disk.operation(of):
                if self._disk.closed:
                    return moved
                step = self.evict_coldest(min(count - moved, DEMOTION_SLICE_ROWS, self._live), estimated)
            if not step:
                return moved
            moved += step
        return moved

    # ---- updates -----------------------------------------------------------------------------------

    def update(self, ids: torch.Tensor, grads: torch.Tensor, journal: Optional[Journal] = None) -> int:
        """Applies the optimizer to the rows of ``ids``; returns how many rows were present and updated.

        ``journal`` hears of the rows' new values (see :data:`Journal`)."""
        self._disk.check_request(ids.numel())
        ids, grads = _summed_by_id(ids, grads)
        with self.locked():
            absent = self._absent(ids)
            if absent is not None:  # the rows on disk come into memory first
                with self._disk.operation("update"), self._disk.timed():
                    self._promote(self._disk.read(*absent))
            self._start_recording(journal)
            applied = self._update_locked(ids, grads)
            journal_changes([self], journal, always=True)
            return applied

    @staticmethod
    def update_together(requests: Sequence[tuple["Table", torch.Tensor, torch.Tensor]], journal: Optional[Journal] = None) -> int:
        """:meth:`update` of several tables (distinct), every table's lock held, their rules in one native call where
        the rule runs there (SGD, Adagrad) and no checkpoint is being taken; returns the rows updated in all.

        ``journal`` hears of every table's new rows at once (one call: the update is one record)."""
        tables = [table for table, _, _ in requests]
        if len({id(t) for t in tables}) < len(tables):
            raise ValueError("update_together: a table appears more than once")
        native_ones = [i for i, table in enumerate(tables) if isinstance(table._index, NativeIdIndex) and table.rule.native]
        if not native_ones and journal is None:  # one table's lock at a time
            return sum(table.update(ids, grads) for table, ids, grads in requests)
        for table, ids, _ in requests:
            table._disk.check_request(ids.numel())
        applied = 0
        with _all_locked(tables):
            for table, ids, _ in requests:
                absent = table._absent(ids)
                if absent is not None:  # the rows on disk come into memory first
                    with table._disk.operation("update"), table._disk.timed():
                        table._promote(table._disk.read(*absent))
                table._start_recording(journal)
            jobs = {}  # position -> (job, and the tensors whose memory it points at: alive until the call is done)
            for i in native_ones:
                table, ids, grads = requests[i]
                if table._preimages.active is None:  # a save in progress keeps pre-images: the tensor path does
                    ids, grads, rows = ids.contiguous(), grads.contiguous(), torch.empty_like(ids)
                    jobs[i] = (table._update_job(ids, rows, grads), ids, grads, rows)
            if jobs:
                native.update_many([job[0] for job in jobs.values()])
            for i, (table, ids, grads) in enumerate(requests):
                job = jobs.get(i)
                if job is not None and not job[0].not_unique:
                    applied += table._finish_update(job[0], job[3])
                    continue
                applied += table._update_locked(*_summed_by_id(ids, grads))
            journal_changes(tables, journal, always=True)
        return applied

    def _update_job(self, ids: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> native.UpdateJob:
        config = self.config.optimizer
        state = self._rows.fields.get("state")
        return self._index.update_job(
            ids, rows, grads, self.rule.native, self._rows["weights"], state.offset if state is not None else 0,
            (self._rows["version"], self._version), config.lr, getattr(config, "eps", 0.0), config.weight_decay,
            self.config.weight_bound,
        )

    def _finish_update(self, job: native.UpdateJob, rows: torch.Tensor) -> int:
        self._record_rows(rows[rows >= 0])
        self._counters["updates"] += 1
        self._counters["update_rows"] += job.applied
        self._counters["dropped_update_rows"] += job.absent
        return job.applied

    def _update_locked(self, ids: torch.Tensor, grads: torch.Tensor) -> int:
        """The rule on the rows of ``ids`` (unique, those on disk brought into memory) in tensor ops; the lock held."""
        rows = self._index.find(ids)
        present = rows >= 0
        if not bool(present.all()):
            self._counters["dropped_update_rows"] += int((~present).sum())
            rows, grads = rows[present], grads[present]
        # every field of the touched records in one pass each way (a record shares its cache lines)
        fields = {name: torch.empty(self.field_specs[name].shape(rows.numel()), dtype=self.field_specs[name].dtype)
                  for name in ("weights", "state") if name in self._rows.fields}
        self._rows.gather_fields(rows, fields)
        weights = fields["weights"].float()
        state = fields.get("state", torch.empty(rows.numel(), 0))
        self._preserve(rows)
        self.rule.apply(weights, state, grads)
        if self.config.weight_bound is not None:
            weights.clamp_(-self.config.weight_bound, self.config.weight_bound)
        written = {"weights": weights, "version": torch.full((rows.numel(),), self._version, dtype=torch.int32)}
        if state.shape[1]:
            written["state"] = state
        self._rows.scatter_fields(rows, written)
        self._record_rows(rows)
        self._counters["updates"] += 1
        self._counters["update_rows"] += rows.numel()
        return rows.numel()

    # ---- statistics --------------------------------------------------------------------------------

    def stats(self) -> dict[str, int | float | str | list]:
        with self.lock:
            snapshot = self._preimages.active
            return dict(
                self._counters,
                rows=self._live,
                capacity=self.config.capacity,
                dim=self.config.dim,
                step=self._step,
                version=self._version,
                storage_dtype=self.config.storage_dtype,
                row_bytes=self._rows.record_bytes,
                chunks=self._rows.num_chunks,
                rows_allocated=self._size,
                index_bytes=self._index.nbytes,
                lock_wait_s=self._lock_waits.seconds,
                bytes=self._size * self._rows.record_bytes + self._index.nbytes + self._disk.map_bytes,
                storage=self.config.storage,
                **self._disk.stats(),
                **self._admission.stats(),
                saving_preimage_rows=snapshot.preimage_rows if snapshot is not None else 0,
                **self._worst_held.stats(),
            )

    # ---- sightings of ids not admitted yet, moving with their slots (admission.py) ------------------------

    def sightings(self, slots: torch.Tensor) -> Optional[torch.Tensor]:
        """The admission filter's counters of ``slots``, or None where the table counts no sighting."""
        with self.lock:
            return self._admission.sightings(slots)

    def merge_sightings(self, slots: torch.Tensor, counters: torch.Tensor) -> None:
        """Takes another shard's :meth:`sightings` of ``slots`` (the larger count of each counter)."""
        with self.lock:
            self._admission.merge_sightings(slots, counters)

    # ---- time to live ------------------------------------------------------------------------------

    def expire(self, now: float, journal: Optional[Journal] = None) -> int:
        """Deletes the rows no training lookup touched within the table's TTL (see :mod:`expiry`); returns how many.

        Sweeps the rows a slice at a time, the lock held for one slice; then the disk tier's rows a block at a time.
        ``journal`` hears of the ids each slice deleted: a replay that missed them would bring the rows back with
        their old values.
        """
        with self.lock:
            limit = self._ttl.limit(now, self._step)
            size, step = self._size, min(EXPIRY_SLICE_ROWS, self._rows.chunk_rows)
        if limit is None:
            return 0
        expired = 0
        for start in range(0, size, step):
            with self.lock:
                chunk, offset = start >> self._rows.shift, start & (self._rows.chunk_rows - 1)
                values = self._rows["access"].chunk(chunk, offset + min(step, size - start))[offset:]
                rows = torch.nonzero((values <= limit) & (values != eviction.FREE)).squeeze(1) + start
                if rows.numel():
                    self._start_recording(journal)
                    self._drop(rows)
                    journal_changes([self], journal, always=False)
                    expired += rows.numel()
        expired += self._disk.expire(limit, dropped=lambda ids: self._journal_removed(ids, journal))
        with self.lock:
            self._counters["expired"] += expired
        return expired

    def _journal_removed(self, ids: torch.Tensor, journal: Optional[Journal]) -> None:
        """Tells ``journal`` of ``ids`` deleted from the disk tier (expired); the lock held."""
        self._start_recording(journal)
        if self._recording is not None:
            self._recording.removed.append(ids)
        journal_changes([self], journal, always=False)


def _summed_by_id(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` made unique, the gradients of a repeated id summed (unchanged when every id is already unique)."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    if unique.numel() == ids.numel():
        return ids, grads
    return unique, torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)


def _all_locked(tables: Sequence[Table], asked: int = 0, train: bool = False) -> HeldLocks:
    """Every table's lock, taken in name order (so that two callers never wait on each other), for a request of
    ``asked`` ids, a training lookup's if ``train``."""
    ordered = tables if len(tables) == 1 else sorted(tables, key=lambda t: t.config.name)
    return HeldLocks([(table.lock, table._lock_waits, table._worst_held) for table in ordered], asked, train)


_NONE_OPEN = contextlib.nullcontext()  # a lookup's disk operations where none was opened (reusable)


def _end_reads(parts: Sequence[DiskPart | NoDisk], gaps: Sequence[Optional[Gap]]) -> None:
    """Ends the reads ahead of ``gaps`` (their tables' locks held)."""
    for part, gap in zip(parts, gaps):
        if gap is not None:
            part.end_read(gap)
