"""One embedding table on one shard: ids, rows, optimizer state, access statistics and change versions.

The fields live in a chunked row store (``chunked_rows.py``), so the table grows without copying or pausing;
the id index (``index.py``) maps ids to rows. Rows are stored in the table's ``storage_dtype`` (fp16 halves
the memory of the values); the optimizer state stays float32 whatever it is, and every update runs in float32.

**Versions.** Every row records the table's *version* at its last change (insert, update, eviction). A
checkpoint or a serving delta advances the version, so "changed since point P" is ``version > P``. That gives a
streamed checkpoint its consistent point (:meth:`Table.begin_snapshot`, copied chunk by chunk while training goes
on: ``table_snapshot.py``). Only the access statistics (LRU step / LFU count) may be newer than the point. A
snapshot *since* an earlier point holds only the rows changed after it, and the ids evicted after it
(``removal_log.py``): a delta for serving. What a journaled operation changed is collected for the shard's
write-ahead log (``table_journal.py``).

Over 500 lines on purpose: lookups, updates, admission, eviction and the disk tier's promotion and demotion all
run under the table's one lock on the same records, and that discipline is read in one place.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, ContextManager, Iterable, Iterator, Optional, Sequence

import torch

from lightning_persia.ops.hashing import name_hash
from lightning_persia.remote_ps.store import eviction, expiry
from lightning_persia.remote_ps.store.admission import CountingFilter
from lightning_persia.remote_ps.store.chunked_rows import ChunkedRows, FieldSpec
from lightning_persia.remote_ps.store.disk.demoter import SLICE_ROWS
from lightning_persia.remote_ps.store.disk.read_ahead import ReadAhead
from lightning_persia.remote_ps.store.disk.records import take_records
from lightning_persia.remote_ps.store.disk.tier import DiskTier
from lightning_persia.remote_ps.store.errors import InvalidRequestError, StoreError
from lightning_persia.remote_ps.store.free_rows import FreeRows
from lightning_persia.remote_ps.store.index import NativeIdIndex, make_index
from lightning_persia.remote_ps.store.initializers import initial_rows, table_key
from lightning_persia.remote_ps.store.native import jobs as native
from lightning_persia.remote_ps.store.optimizers import make_rule
from lightning_persia.remote_ps.store.disk.promotions import PendingPromotion, PendingPromotions
from lightning_persia.remote_ps.store.removal_log import RemovalLog
from lightning_persia.remote_ps.store.disk.segment_mapping import MAPPED_BYTES
from lightning_persia.remote_ps.store.table_journal import Journal, Recording
from lightning_persia.remote_ps.store.table_snapshot import SAVED_FIELDS, Preimages, SnapshotPoint, TableSnapshot
from lightning_persia.remote_ps.store.thread_clock import DiskWork, Held, LockWaits, WorstHeld
from lightning_persia.remote_ps.store.wal.changes import TableChange
from lightning_persia.remote_ps.table_config import STORAGE_DTYPES, TableConfig, Uniform


class Table:
    """Thread-safe store of one table's rows on one shard.

    ``lock`` serialises every read and write of the table; a caller that needs one consistent point over several
    tables holds all their locks while it calls :meth:`begin_snapshot` on each.
    """

    def __init__(self, config: TableConfig, seed: int, disk_dir: Optional[str] = None, disk_mapped_bytes: int = MAPPED_BYTES,
                 promote_later: bool = False) -> None:
        """``disk_dir``: the folder of the table's disk tier, for a table of ``storage="disk"`` (created; its own);
        ``disk_mapped_bytes``: of its records, how many bytes the shard keeps mapped at most (``segment_mapping.py``);
        ``promote_later``: a training lookup leaves the rows it read from disk to :meth:`promote_pending` (the shard's
        demoter calls it) instead of bringing them into memory itself (``promotions.py``)."""
        self.config = config
        self.seed = seed
        self.rule = make_rule(config.optimizer, config.dim)
        self.lock = threading.Lock()
        self.field_specs = {
            "ids": FieldSpec(torch.int64),
            "weights": FieldSpec(STORAGE_DTYPES[config.storage_dtype], config.dim),
            "state": FieldSpec(torch.float32, self.rule.state_width),
            "access": FieldSpec(torch.int32),
            "version": FieldSpec(torch.int32),
        }
        self._rows = ChunkedRows({name: spec for name, spec in self.field_specs.items() if spec.row_bytes > 0})
        self._index = make_index(self._rows)
        # What admitting an id in one native pass needs (see _admits_natively): the generator's key, one record's
        # initial optimizer state.
        self._init_key = table_key(seed, config.name)
        self._initial_state = self.rule.initial_state(1).reshape(-1)
        self._admission = torch.Generator().manual_seed((seed ^ name_hash(config.name)) & ((1 << 63) - 1))
        self._eviction_sample = torch.Generator().manual_seed(seed)
        self._demotion_sample = torch.Generator().manual_seed(seed + 1)  # the demoter's, used without the lock
        self._evict_from = 0  # the row where the next eviction's sweep starts (eviction.select_victims)
        self._size = 0  # rows allocated so far (live or free)
        self._live = 0
        self._free = FreeRows()
        self._step = 0
        self._version = 1  # written into every changed row; never-written rows read 0
        self._preimages = Preimages(self._rows, self.field_specs, self.lock)
        self._recording: Optional[Recording] = None  # the changes of the journaled operation under way
        self._removals = RemovalLog(config.name)
        self._worst_held = WorstHeld()
        self._lock_waits = LockWaits()
        self._disk_work = DiskWork()
        self._counters = dict(lookups=0, lookup_rows=0, inserted=0, evicted=0, not_admitted=0, updates=0, update_rows=0,
                              dropped_update_rows=0, demoted=0, promoted=0, expired=0)
        self._clock = expiry.StepClock()
        self._sightings = CountingFilter() if config.admit_after > 1 else None
        self._disk: Optional[DiskTier] = None
        if config.storage == "disk":
            if disk_dir is None:
                raise StoreError(f"table {config.name!r} has storage 'disk' but its shard has no disk folder (PSConfig.disk_dir, "
                                 "`ps serve disk_dir=...`)")
            self._disk = DiskTier(disk_dir, self.field_specs, self.lock, disk_mapped_bytes)
        self._pending = PendingPromotions() if self._disk is not None and promote_later else None

    def locked(self) -> ContextManager[None]:
        """The table's lock held for a request, the wait to take it counted (``lock_wait_s`` in :meth:`stats`)."""
        return self._lock_waits.holding(self.lock)

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.field_specs["weights"].dtype

    # ---- reads and writes ------------------------------------------------------------------------

    def lookup(self, ids: torch.Tensor, train: bool, dtype: torch.dtype = torch.float32, journal: Optional[Journal] = None) -> torch.Tensor:
        """Rows of ``ids`` as ``[n, dim]`` of ``dtype``; training lookups admit unseen ids.

        ``journal`` hears of the ids the lookup admitted or evicted, if any (see :data:`Journal`). A disk table reads
        the records of the ids its memory lacks without the lock (:meth:`_read_ahead`), then takes it again to finish."""
        if train:
            self._check_budget(ids.numel())
        out = torch.empty(ids.numel(), self.config.dim, dtype=self.storage_dtype)
        with self.locked():
            held = Held.now(ids.numel(), train)
            touch = self._touch(train)
            rows = self._index.find(ids, copy=(self._rows["weights"], out), touch=touch)
            ahead = self._read_ahead(ids, rows)
            short = self._room_to_make(rows) if train else 0
            if ahead is None and not short:
                self._finish(ids, rows, out, train, journal, held)
                return out.to(dtype)
            inserted = self._index.inserted
            if train:
                self._worst_held.record(held)
        _between_locks([self], [ahead], [short])
        with self.locked():
            held = Held.now(ids.numel(), train)
            _end_reads([self], [ahead])
            self._rejoin(ids, rows, out, train, inserted, ahead)
            self._finish(ids, rows, out, train, journal, held, ahead)
        return out.to(dtype)

    @staticmethod
    def lookup_together(requests: Sequence[tuple["Table", torch.Tensor]], train: bool, dtype: torch.dtype,
                        journal: Optional[Journal] = None) -> list[torch.Tensor]:
        """:meth:`lookup` of several tables (distinct), every table's lock held, their probes in one native call."""
        tables = [table for table, _ in requests]
        for table, ids in requests:
            if train:
                table._check_budget(ids.numel())
        if not all(isinstance(t._index, NativeIdIndex) for t in tables) or len({id(t) for t in tables}) < len(tables):
            return [table.lookup(ids, train, dtype, journal) for table, ids in requests]
        outs = [torch.empty(ids.numel(), table.config.dim, dtype=table.storage_dtype) for table, ids in requests]
        rows = [torch.empty_like(ids) for _, ids in requests]
        with _all_locked(tables):
            held = Held.now(sum(ids.numel() for _, ids in requests), train)
            touches = [table._touch(train) for table in tables]
            jobs = [table._index.find_job(ids, found, (table._rows["weights"], out), touch)
                    for (table, ids), found, out, touch in zip(requests, rows, outs, touches)]
            native.find_many(jobs)
            aheads: list[Optional[ReadAhead]] = []
            try:
                for (table, ids), found, job in zip(requests, rows, jobs):
                    aheads.append(table._read_ahead(ids, found) if job.missing else None)
            except BaseException:
                _end_reads(tables, aheads)
                raise
            shorts = [table._room_to_make(found) if train and job.missing else 0 for table, found, job in zip(tables, rows, jobs)]
            if not any(aheads) and not any(shorts):
                Table._finish_together(requests, rows, outs, train, journal, held, aheads)
                return [out.to(dtype) for out in outs]
            inserted = [table._index.inserted for table in tables]
            for table in tables if train else ():
                table._worst_held.record(held)
        _between_locks(tables, aheads, shorts)
        with _all_locked(tables):
            held = Held.now(sum(ids.numel() for _, ids in requests), train)
            _end_reads(tables, aheads)  # every read ended before any table's rejoin may fail
            for (table, ids), found, out, before, ahead in zip(requests, rows, outs, inserted, aheads):
                table._rejoin(ids, found, out, train, before, ahead)
            Table._finish_together(requests, rows, outs, train, journal, held, aheads)
        return [out.to(dtype) for out in outs]

    @staticmethod
    def _finish_together(requests, rows, outs, train, journal, held, aheads) -> None:
        """:meth:`_finish` of each table of :meth:`lookup_together`; every lock held."""
        tables = [table for table, _ in requests]
        for table in tables:
            table._start_recording(journal if train else None)
        for (table, ids), found, out, ahead in zip(requests, rows, outs, aheads):
            table._finish_lookup(ids, found, out, train, held, int((found < 0).sum()), ahead)
        _journal(tables, journal, always=False)

    def _finish(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, journal: Optional[Journal],
                held: Held, ahead: Optional[ReadAhead] = None) -> None:
        """The rest of a lookup once the memory was probed: its misses from disk or admitted, its journal; lock held."""
        self._start_recording(journal if train else None)
        self._finish_lookup(ids, rows, out, train, held, int((rows < 0).sum()), ahead)
        _journal([self], journal, always=False)

    def _read_ahead(self, ids: torch.Tensor, rows: torch.Tensor) -> Optional[ReadAhead]:
        """Where a disk table's probe missed ids that are on disk, their slots, to read without the lock; else None.
        The lock held."""
        if self._disk is None or not self._disk.rows:
            return None
        positions = torch.nonzero(rows < 0).squeeze(1)
        if not positions.numel():
            return None
        with self._disk_work.operation("lookup's id map probe"), self._disk_work.timed():
            return self._disk.begin_read(positions, ids[positions])

    def _rejoin(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, inserted: int,
                ahead: Optional[ReadAhead] = None) -> None:
        """Back under the lock after it was let go (a read ahead, ended: :meth:`DiskTier.end_read`; room made): where
        ids were inserted since the index counted ``inserted``, the ids the first probe missed are probed again
        (another request, or the demoter's promotions, may have brought them in meanwhile), except those whose record
        ``ahead`` read is still on disk (a row is in memory or on disk, never both)."""
        if self._disk is not None and self._disk.closed:
            raise StoreError(f"table {self.config.name!r} was dropped during the lookup")
        if self._index.inserted == inserted:
            return
        absent = torch.nonzero(rows < 0).squeeze(1)
        if ahead is not None and ahead.records is not None:
            absent = ahead.positions[~self._disk.still_holds(ahead.ids, ahead.slots, ahead.records)]
            if not absent.numel():
                return
        again = torch.empty(absent.numel(), self.config.dim, dtype=self.storage_dtype)
        found = self._index.find(ids[absent], copy=(self._rows["weights"], again), touch=self._touch(train, advance=False))
        hit = found >= 0
        rows[absent[hit]] = found[hit]
        out[absent[hit]] = again[hit]

    def _touch(self, train: bool, advance: bool = True) -> Optional[tuple]:
        """What a lookup writes into its rows' access values (a training one; an evaluation one leaves them); the
        lookup step advances unless ``advance`` is False (a lookup's second probe, after a read ahead: the table's
        step now, which other lookups may have advanced meanwhile)."""
        if not train:
            return None
        if advance:
            self._step += 1
        return (self._rows["access"], *eviction.touch_value(self.config.eviction, self._step))

    def _finish_lookup(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, held: Held,
                       missing: int, ahead: Optional[ReadAhead] = None) -> None:
        """The rows of the ``missing`` ids the probe did not find (admitted when training), and the counters; lock held."""
        self._counters["lookups"] += 1
        self._counters["lookup_rows"] += ids.numel()
        if not missing:
            return
        with self._disk_work.operation("lookup"):
            left = self._from_disk(ids, rows, out, train, ahead) if self._disk is not None and self._disk.rows else missing
            if train and left and self._admits_natively(left):
                self._admit_natively(ids, rows, out, left)
            elif left:
                absent = rows == -1  # -2: read from disk, left there (an evaluation lookup, or a promotion queued)
                out[absent] = self._fill_missing(ids[absent], train)
        if not train:
            return
        self._worst_held.record(held)

    def update(self, ids: torch.Tensor, grads: torch.Tensor, journal: Optional[Journal] = None) -> int:
        """Applies the optimizer to the rows of ``ids``; returns how many rows were present and updated.

        ``journal`` hears of the rows' new values (see :data:`Journal`)."""
        self._check_budget(ids.numel())
        ids, grads = _summed_by_id(ids, grads)
        with self.locked():
            self._start_recording(journal)
            applied = self._update_locked(ids, grads)
            _journal([self], journal, always=True)
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
            table._check_budget(ids.numel())
        applied = 0
        with _all_locked(tables):
            for table, ids, _ in requests:
                table._promote_absent(ids)
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
            _journal(tables, journal, always=True)
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
        """The rule on the rows of ``ids`` (unique) in tensor ops; the lock held."""
        self._promote_absent(ids)
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

    def append(self, rows: dict[str, torch.Tensor], expected_rows: int = 0) -> None:
        """Adds rows read from a checkpoint (``{field: values}`` of :data:`SAVED_FIELDS`; ids absent from the table).

        ``expected_rows``: how many rows the table will hold once the whole checkpoint is in (sizes the index once).
        """
        self.load([rows], expected_rows)

    def load(self, blocks: Iterable[dict[str, torch.Tensor]], expected_rows: int = 0) -> None:
        """:meth:`append` of a checkpoint's blocks of rows, one after the other.

        A block's ids are indexed on a thread of their own while the next block is read and written (the index
        insert is about a quarter of an in-place load's CPU, and runs without the GIL), so ``blocks`` must keep a block's
        tensors valid until the block after the next one is asked for (``checkpoint.TableSource.blocks`` does).
        """
        positions = [torch.empty(0, dtype=torch.int64)] * 2  # the rows of a block stay valid while it is indexed
        with self.lock, ThreadPoolExecutor(1, thread_name_prefix="persia-ps-index") as indexer:
            if expected_rows:
                self._index.reserve(expected_rows)
            indexed: Optional[Future] = None
            for number, block in enumerate(blocks):
                block = self._spill(block)
                n = block["ids"].numel()
                if positions[number % 2].numel() < n:
                    positions[number % 2] = torch.empty(n, dtype=torch.int64)
                rows = torch.arange(self._size, self._size + n, out=positions[number % 2][:n])
                # the memory of the blocks that follow is committed in the background while this one is written:
                # faulting it in row by row costs several times more (a fault per page, each trying for a huge page)
                self._rows.reserve(self._size + n, ahead_limit=max(expected_rows, self._size + n))
                self._rows.scatter_fields(rows, {name: block[name] for name in SAVED_FIELDS if name in self._rows.fields})
                self._size += n
                self._live += n
                if indexed is not None:
                    indexed.result()
                indexed = indexer.submit(self._index.insert, block["ids"], rows)  # after the scatter: it reads the ids
            if indexed is not None:
                indexed.result()

    def upsert_locked(self, rows: dict[str, torch.Tensor]) -> None:
        """Writes rows of a delta (``{field: values}`` of :data:`SAVED_FIELDS`): replaces the ids present, adds the
        others. Call it holding :attr:`lock`."""
        ids = rows["ids"]
        if self._disk is not None:  # the delta's row replaces the one on disk
            self._disk.remove(ids)
        found = self._index.find(ids)
        present = found >= 0
        fresh = torch.nonzero(~present).squeeze(1)
        positions = found.clone()
        if fresh.numel():
            new_rows = self._take_rows(fresh.numel(), keep=found[present])
            positions[fresh] = new_rows
            self._rows["ids"].scatter(new_rows, ids[fresh])
        for name in SAVED_FIELDS[1:]:
            if name in self._rows.fields:
                self._rows[name].scatter(positions, rows[name])
        self._rows["version"].fill(positions, self._version)
        if fresh.numel():
            self._index.insert(ids[fresh], positions[fresh])
            self._live += fresh.numel()

    def remove_ids_locked(self, ids: torch.Tensor) -> None:
        """Drops the rows of ``ids`` (those present, in memory or on disk). Call it holding :attr:`lock`."""
        if self._disk is not None:
            self._disk.remove(ids)
        rows = self._index.find(ids)
        rows = rows[rows >= 0]
        if not rows.numel():
            return
        self._index.remove(self._rows["ids"].gather(rows))
        self._rows["access"].fill(rows, eviction.FREE)
        self._rows["version"].fill(rows, self._version)
        self._free.push(rows)
        self._live -= rows.numel()

    def restore_step(self, step: int) -> None:
        """The lookup step counter of a checkpoint (LRU access values are relative to it)."""
        with self.lock:
            self._step = max(self._step, step)

    # ---- checkpoints -------------------------------------------------------------------------------

    def begin_snapshot(self, since: int = 0) -> TableSnapshot:
        """Takes the table's consistent point for a checkpoint; call it holding :attr:`lock`.

        The rows are then read chunk by chunk with :meth:`TableSnapshot.chunks`, while the table keeps serving.
        ``since`` (the :attr:`TableSnapshot.point` of an earlier snapshot) keeps only what changed after it: the
        rows written since, and the ids evicted since (:attr:`TableSnapshot.removed`). Raises :class:`StoreError`
        when the evictions since then are no longer remembered (then only a full snapshot is possible).
        """
        if self._preimages.active is not None:
            raise StoreError(f"table {self.config.name!r} is already being saved")
        removed = self._removals.since(since) if since else torch.empty(0, dtype=torch.int64)
        state = SnapshotPoint(point=self._version, since=since, size=self._size, live=self._live, step=self._step,
                              removed=removed, disk=self._disk.freeze() if self._disk is not None and not since else None)
        self._preimages.begin(state)
        self._version += 1
        return TableSnapshot(self.config, self.field_specs, state, self._preimages,
                             self._disk.record_bytes if self._disk is not None else 0)

    # ---- the write-ahead log's view ----------------------------------------------------------------

    def _preserve(self, rows: torch.Tensor) -> None:
        """Keeps the pre-image of ``rows`` about to change, for the checkpoint in progress (if any)."""
        self._preimages.keep(rows, self._version)

    def _start_recording(self, journal: Optional[Journal]) -> None:
        """Collects what the operation under way changes, for ``journal`` (none: nothing is collected); lock held."""
        self._recording = Recording() if journal is not None else None

    def _record_rows(self, rows: torch.Tensor) -> None:
        """The new values of ``rows`` (just written by an update) for the journal, if one listens; lock held."""
        if self._recording is None:
            return
        fields = [name for name in SAVED_FIELDS if name in self._rows.fields]
        values = {name: torch.empty(self.field_specs[name].shape(rows.numel()), dtype=self.field_specs[name].dtype) for name in fields}
        self._recording.rows.append(self._rows.gather_fields(rows, values))

    def _take_recording(self) -> TableChange:
        recording, self._recording = self._recording, None
        assert recording is not None
        return recording.change(self.config.name, self._step)

    def replay_locked(self, change: TableChange) -> None:
        """Applies a change read back from the write-ahead log: the evictions, the admissions (first rows from
        (seed, table, id)), then the rows' values. Call it holding :attr:`lock`."""
        if change.removed.numel():
            self.remove_ids_locked(change.removed)
        if change.admitted.numel():
            n = change.admitted.numel()
            rows = {"ids": change.admitted, "access": change.admitted_access,
                    "weights": initial_rows(self.config.init, self.seed, self.config.name, change.admitted, self.config.dim)
                    .to(self.storage_dtype)}
            if "state" in self._rows.fields:
                rows["state"] = self.rule.initial_state(n)
            self.upsert_locked(rows)
        if change.rows and change.rows["ids"].numel():
            self.upsert_locked(change.rows)
        self._step = max(self._step, change.step)

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
                bytes=self._size * self._rows.record_bytes + self._index.nbytes + (self._disk.map_bytes if self._disk else 0),
                storage=self.config.storage,
                disk_rows=self._disk.rows if self._disk else 0,
                disk_bytes=self._disk.disk_bytes if self._disk else 0,
                disk_map_bytes=self._disk.map_bytes if self._disk else 0,
                disk_mapped_bytes=self._disk.mapped_bytes if self._disk else 0,
                disk_mapped_budget_bytes=self._disk.mapped_budget if self._disk else 0,
                pending_promotions=len(self._pending) if self._pending is not None else 0,
                saving_preimage_rows=snapshot.preimage_rows if snapshot is not None else 0,
                **self._worst_held.stats(),
                **{f"worst_disk_work_{name}": value for name, value in self._disk_work.worst._asdict().items()},
                worst_disk_works=self._disk_work.worst_operations,
            )

    # ---- time to live ------------------------------------------------------------------------------

    def expire(self, now: float, journal: Optional[Journal] = None) -> int:
        """Deletes the rows no training lookup touched within the table's TTL (see :mod:`expiry`); returns how many.

        Sweeps the rows a slice at a time, the lock held for one slice; then the disk tier's rows a block at a time.
        ``journal`` hears of the ids each slice deleted: a replay that missed them would bring the rows back with
        their old values.
        """
        config = self.config
        if config.ttl_steps is None and config.ttl_seconds is None:
            return 0
        with self.lock:
            self._clock.record(now, self._step)
            limit = expiry.expiry_step(self._step, now, self._clock, config.ttl_steps, config.ttl_seconds)
            size, step = self._size, min(expiry.SLICE_ROWS, self._rows.chunk_rows)
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
                    _journal([self], journal, always=False)
                    expired += rows.numel()
        if self._disk is not None:
            expired += self._disk.expire(limit, self.lock, dropped=lambda ids: self._journal_removed(ids, journal))
        with self.lock:
            self._counters["expired"] += expired
        return expired

    def _journal_removed(self, ids: torch.Tensor, journal: Optional[Journal]) -> None:
        """Tells ``journal`` of ``ids`` deleted from the disk tier (expired); the lock held."""
        self._start_recording(journal)
        if self._recording is not None:
            self._recording.removed.append(ids)
        _journal([self], journal, always=False)

    def _drop(self, rows: torch.Tensor) -> None:
        """Deletes live ``rows`` (expired); the lock held."""
        self._preserve(rows)
        gone = self._rows["ids"].gather(rows)
        if self._recording is not None:
            self._recording.removed.append(gone)
        self._index.remove(gone)
        self._removals.add(self._version, gone)
        self._rows["access"].fill(rows, eviction.FREE)
        self._rows["version"].fill(rows, self._version)
        self._free.push(rows)
        self._live -= rows.numel()

    # ---- the disk tier -----------------------------------------------------------------------------

    def _spill(self, block: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rows of a loaded block that fit in a disk table's memory budget; the others are written to disk."""
        room = self.config.capacity - self._live
        if self._disk is None or block["ids"].numel() <= room:
            return block
        room = max(room, 0)
        self._disk.write({name: values[room:] for name, values in block.items() if name in self._disk.specs})
        return {name: values[:room] for name, values in block.items()}

    @property
    def memory_rows(self) -> int:
        """Rows in memory now (read without the lock: a moment's value)."""
        return self._live

    def cold_estimate(self, count: int) -> Optional[tuple[int, float]]:
        """The access value at or below which the ``count`` coldest rows lie, from a sample read without the lock
        (:func:`eviction.estimate`): what :meth:`demote` selects by. One estimate serves several demotions: the
        coldest :data:`eviction.BULK_FRACTION` of the rows lie below it, and an access value only grows."""
        with self.lock:
            access = self._access_in_use()
        return eviction.estimate(access, count, self._demotion_sample)

    def demote(self, count: int, estimated: Optional[tuple[int, float]] = None) -> int:
        """Moves ``count`` of the coldest rows of a disk table's memory tier to disk (the shard's demoter calls it
        between requests); returns how many moved (0: not a disk table, or closed). Selects them by ``estimated``
        (:meth:`cold_estimate`; made now if None), holding the lock to choose and move the rows."""
        if self._disk is None or count <= 0:
            return 0
        if estimated is None:
            estimated = self.cold_estimate(count)
        return self._demote(count, estimated, "demotion")

    def _demote(self, count: int, estimated: Optional[tuple[int, float]], of: str) -> int:
        """:meth:`demote`, its disk work counted as an operation ``of`` that kind (:class:`DiskWork`)."""
        with self.lock, self._disk_work.operation(of):
            if self._disk.closed:
                return 0
            before = self._counters["demoted"]
            self._evict(min(count, self._live), estimated)
            return self._counters["demoted"] - before

    def _room_to_make(self, rows: torch.Tensor) -> int:
        """The rows a training lookup that found ``rows`` demotes between its two holds of the lock
        (:meth:`_make_room`): of those it may bring into memory (one per id it missed), the ones beyond a disk table's
        free rows now, where they are more than a slice; else 0 (up to a slice is demoted with the lock held; a table
        in memory evicts, it does not demote). The lock held."""
        free = self.config.capacity - self._live
        if self._disk is None or free + SLICE_ROWS >= rows.numel():  # the usual case, the demoter's headroom free: no count
            return 0
        short = int((rows < 0).sum()) - free
        return short if short > SLICE_ROWS else 0

    def _make_room(self, shortfall: int) -> None:
        """Demotes ``shortfall`` rows for a request (none if 0), :data:`SLICE_ROWS` at a time, the lock taken for each
        slice and let go between: the demoter fell behind the rows requests bring in, and one request demoting them
        all with the lock held kept every other request of the table waiting for all of it (a lookup that inserted
        131,072 ids held a billion-row table's lock for 0.378 s of demoting so)."""
        if shortfall <= 0:
            return
        estimated = self.cold_estimate(shortfall)
        while shortfall > 0:
            moved = self._demote(min(shortfall, SLICE_ROWS), estimated, "a lookup's demotion, a slice")
            if not moved:
                return
            shortfall -= moved

    def compact_disk(self) -> int:
        """A step of compacting the disk tier's sparsest segment (see :meth:`DiskTier.compact_step`); returns the rows
        moved. The shard's demoter calls it between requests; its holds of the lock count as disk work."""
        return 0 if self._disk is None else self._disk.compact_step(self._compaction_work)

    @contextlib.contextmanager
    def _compaction_work(self) -> Iterator[None]:
        with self._disk_work.operation("compaction"), self._disk_work.timed():
            yield

    def map_disk_pages(self) -> int:
        """A step of mapping the disk tier's most read segments (see :meth:`DiskTier.map_step`); returns the bytes
        mapped. The shard's demoter calls it between requests; the lock is held only to choose and publish the pages."""
        return 0 if self._disk is None else self._disk.map_step()

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the disk tier's records in the shard's page tables (0 without a disk tier)."""
        return 0 if self._disk is None else self._disk.mapped_bytes

    def set_mapped_budget(self, nbytes: int) -> None:
        """How many bytes of the disk tier's records the next steps of :meth:`map_disk_pages` may keep mapped
        (``mapped_budget.py``); a table without a disk tier has none to map."""
        if self._disk is not None:
            self._disk.set_mapped_budget(nbytes)

    def attach_disk(self, segments: Iterable, adopt_map: Optional[Callable] = None) -> None:
        """Takes the disk segments of a checkpoint saved by this shard, and its id map (see :meth:`DiskTier.attach`)."""
        if self._disk is None:
            raise StoreError(f"table {self.config.name!r} has no disk tier")
        with self.lock:
            self._disk.attach(segments, adopt_map)

    def _check_budget(self, n: int) -> None:
        """A disk table's training request must fit in its memory budget: every row it touches comes into memory."""
        if self._disk is not None and n > self.config.capacity:
            raise InvalidRequestError(f"table {self.config.name!r}: a request of {n} ids is larger than the table's memory "
                                      f"budget of {self.config.capacity} rows a shard (its capacity); split the request or raise it")

    def _from_disk(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, ahead: Optional[ReadAhead] = None) -> int:
        """Fills the rows of ``out`` that the memory did not hold from disk (the records of ``ahead`` where still
        valid); a training lookup brings them into memory (their ``rows`` set), or queues them for the demoter to
        (``promotions.py``). Rows read from disk and left there are -2. Returns the ids still missing (-1). The lock held."""
        with self._disk_work.timed():
            if ahead is None:
                positions = torch.nonzero(rows < 0).squeeze(1)
                wanted = ids[positions]
                slots, records = self._disk.find(wanted)
            else:
                positions, wanted = ahead.positions, ahead.ids
                slots, records = self._disk.find(wanted, ahead)
            hit = slots >= 0
            if ahead is not None:
                hit &= rows[positions] < 0  # the second probe found the others in memory
            at = torch.nonzero(hit).squeeze(1)
            if at.numel():
                read = take_records(records, at)
                values = self._disk.unpack(read)
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
            self._pending.add(PendingPromotion(ids, slots, records, self._step, self._disk.generation))
            rows[where] = -2
            return
        if first is not None:
            values = {name: v[first] for name, v in values.items()}
        promoted = self._promote(ids, slots, values)
        rows[where] = promoted if inverse is None else promoted[inverse]

    def promote_pending(self, limit: int) -> int:
        """Promotes the oldest batch of rows that training lookups read from disk and left to the demoter (at most
        ``limit`` rows of it; see ``promotions.py``), those still on disk at the slot they were read from; returns
        how many were taken from the queue. The demoter calls it between requests, the lock held for one call."""
        if self._pending is None:
            return 0
        with self.lock, self._disk_work.operation("promotion"), self._disk_work.timed():
            batch = self._pending.take(limit)
            if batch is None:
                return 0
            if self._disk.closed or batch.generation != self._disk.generation:  # dropped: the rows stay where they are
                return batch.ids.numel()
            still = self._disk.still_holds(batch.ids, batch.slots, batch.records)  # so not in memory either (promotions.py)
            at = torch.nonzero(still).squeeze(1)
            if at.numel():
                self._promote(batch.ids[at], batch.slots[at], self._disk.unpack(take_records(batch.records, at)), batch.step)
            return batch.ids.numel()

    def _promote_absent(self, ids: torch.Tensor) -> None:
        """Brings the rows of ``ids`` (unique) that are on disk into memory (an update applies to them). The lock held."""
        if self._disk is None or not self._disk.rows:
            return
        found = self._index.find(ids)
        absent = torch.unique(ids[found < 0])
        if not absent.numel():
            return
        with self._disk_work.operation("update"), self._disk_work.timed():
            slots, records = self._disk.find(absent)
            hit = slots >= 0
            if bool(hit.any()):
                self._promote(absent[hit], slots[hit], self._disk.unpack(take_records(records, hit)), keep=found[found >= 0])

    def _promote(self, ids: torch.Tensor, slots: torch.Tensor, values: dict[str, torch.Tensor], step: Optional[int] = None,
                 keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Moves rows read from disk (``ids`` unique, at ``slots``) into memory; returns their rows. ``step``: the
        lookup step that read them (LRU; the table's step now by default); ``keep``: rows the operation under way
        goes on to write, which the room made for these must not demote. The lock held."""
        n = ids.numel()
        rows = self._take_rows(n, keep)  # may demote colder rows: written to disk before anything else changes
        self._preserve(rows)
        policy = self.config.eviction
        access = (torch.full((n,), self._step if step is None else step, dtype=torch.int32) if policy == "lru"
                  else values["access"] + 1)
        written = {"ids": ids, "weights": values["weights"], "access": access,
                   "version": torch.full((n,), self._version, dtype=torch.int32)}
        if "state" in self._rows.fields:
            written["state"] = values["state"]
        self._rows.scatter_fields(rows, written)
        self._index.insert(ids, rows)
        self._live += n
        self._disk.forget(ids, slots)
        self._counters["promoted"] += n
        return rows

    def close(self) -> None:
        """Deletes the table's disk tier (a table replaced or dropped; a checkpoint keeps the files it linked)."""
        if self._disk is not None:
            with self.lock:
                if self._pending is not None:
                    self._pending.clear()
                self._disk.destroy()

    # ---- internals ---------------------------------------------------------------------------------

    def _admits_natively(self, missing: int) -> bool:
        """Whether the ``missing`` ids of a training lookup are admitted in one native pass: every one of them is
        admitted (no admission draw, room for all), no save keeps pre-images, and their first rows are Uniform
        (the initialiser the pass draws; a Normal or Constant one takes the tensor path)."""
        return (isinstance(self._index, NativeIdIndex) and isinstance(self.config.init, Uniform) and self._preimages.active is None
                and self.config.admit_probability >= 1.0 and self._sightings is None and missing <= self.config.capacity)

    def _admit_natively(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, missing: int) -> None:
        """Admits the absent ids of a training lookup and fills their rows of ``out`` (``jobs.c``'s ``lp_admit``).

        Rows are taken for every absent occurrence (a client sends each id once; an id repeated in a request takes
        one row and hands the others back to the free list), except where rows must be evicted for them. Only the
        ids at -1 are absent: a row at -2 was read from disk and queued for promotion, and stays the id's.
        """
        if missing > self.config.capacity - self._live:  # rows evicted for them: exactly one per new id, none more
            missing = int(torch.unique(ids[rows == -1]).numel())
        fresh = self._take_rows(missing)
        weights, access, version = self._rows["weights"], self._rows["access"], self._rows["version"]
        state = self._rows.fields.get("state")
        fields = native.AdmitFields(
            weights=(weights.offset, weights.spec.dtype),
            access=(access.offset, eviction.first_access(self.config.eviction, self._step)),
            version=(version.offset, self._version),
            state=self._initial_state,
            state_offset=state.offset if state is not None else 0,
        )
        job: Optional[native.AdmitJob] = None
        try:
            job = self._index.admit_job(ids.contiguous(), rows, out, fresh, fields, self._init_key, (self.config.init.low, self.config.init.high))
            native.admit(job)
        finally:  # what was admitted stays (also when the index could not grow); the rest of `fresh` is freed
            used = job.used if job is not None else 0
            if self._recording is not None and used:
                self._recording.admitted(self._rows["ids"].gather(fresh[:used]), access.gather(fresh[:used]))
            self._live += used
            self._counters["inserted"] += used
            unused = fresh[used:]
            if unused.numel():
                access.fill(unused, eviction.FREE)
                self._free.push(unused)

    def _fill_missing(self, ids: torch.Tensor, train: bool) -> torch.Tensor:
        unique, inverse = torch.unique(ids, return_inverse=True)
        initial = initial_rows(self.config.init, self.seed, self.config.name, unique, self.config.dim).to(self.storage_dtype)
        if train:
            self._admit(unique, initial)
        return initial[inverse]

    def _admit(self, ids: torch.Tensor, initial: torch.Tensor) -> None:
        p = self.config.admit_probability
        if p < 1.0:
            keep = torch.rand(ids.numel(), generator=self._admission) < p
            self._counters["not_admitted"] += int((~keep).sum())
            ids, initial = ids[keep], initial[keep]
        if self._sightings is not None:
            keep = self._sightings.add(ids) >= self.config.admit_after
            self._counters["not_admitted"] += int((~keep).sum())
            ids, initial = ids[keep], initial[keep]
        if ids.numel() > self.config.capacity:
            self._counters["not_admitted"] += ids.numel() - self.config.capacity
            ids, initial = ids[: self.config.capacity], initial[: self.config.capacity]
        if not ids.numel():
            return
        rows = self._take_rows(ids.numel())
        self._preserve(rows)
        n = ids.numel()
        written = {"ids": ids, "weights": initial,
                   "access": torch.full((n,), eviction.first_access(self.config.eviction, self._step), dtype=torch.int32),
                   "version": torch.full((n,), self._version, dtype=torch.int32)}
        if "state" in self._rows.fields:
            written["state"] = self.rule.initial_state(n)
        self._rows.scatter_fields(rows, written)  # the new records written in one pass
        if self._recording is not None:
            self._recording.admitted(ids, written["access"])
        self._index.insert(ids, rows)
        self._live += ids.numel()
        self._counters["inserted"] += ids.numel()

    def remember_removals(self) -> None:
        """Starts logging evicted ids (from now on), so that snapshots since a later point can name them."""
        with self.lock:
            self._removals.start(self._version - 1)

    def _take_rows(self, n: int, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``n`` free rows, cold ones evicted (a disk table: demoted) where the table is full, none of ``keep``: the
        rows the operation under way goes on to write. A demoted row it then wrote into would leave its id with the
        old value on disk and the new one in a row another id may take: a replay that made room so lost 632 of 5,000
        rows. Where only rows of ``keep`` are cold enough, the table holds more than its capacity until the demoter
        catches up."""
        room = self.config.capacity - self._live
        if n > room:  # a disk table's demoter keeps room ahead (demoter.py): demote what this request needs, no more
            self._evict(n - room if self._disk is not None else eviction.bulk_size(n - room, self.config.capacity), keep=keep)

        reused = self._free.take(n)
        appended = n - reused.numel()
        self._rows.reserve(self._size + appended, ahead_limit=self.config.capacity)
        fresh = torch.arange(self._size, self._size + appended)
        self._size += appended
        return torch.cat([reused, fresh])

    def _access_in_use(self) -> list[torch.Tensor]:
        """The access values of the rows allocated so far, a view a chunk (the lock held)."""
        access = self._rows["access"]
        return [access.chunk(c, min(self._rows.chunk_rows, self._size - (c << self._rows.shift)))
                for c in range((self._size + self._rows.chunk_rows - 1) >> self._rows.shift)]

    def _evict(self, count: int, estimated: Optional[tuple[int, float]] = None, keep: Optional[torch.Tensor] = None) -> None:
        """Evicts (a disk table: demotes) ``count`` cold rows, none of ``keep``; ``estimated``: their threshold
        (:func:`eviction.estimate`)."""
        access = self._rows["access"]
        in_use = self._access_in_use()
        victims = torch.empty(0, dtype=torch.int64)
        if in_use:
            with eviction.hidden(access, keep):
                victims, self._evict_from = eviction.select_victims(in_use, count, self._eviction_sample, self._evict_from, estimated)
            if keep is not None and keep.numel():
                victims = victims[~torch.isin(victims, keep)]
        gone = self._rows["ids"].gather(victims)
        if self._disk is not None and victims.numel():  # demoted: written to disk first (a failure changes nothing)
            with self._disk_work.timed(demoting=True):
                kept = {name: torch.empty(spec.shape(victims.numel()), dtype=spec.dtype)
                        for name, spec in self._disk.specs.items() if name != "ids"}
                self._disk.write({"ids": gone, **self._rows.gather_fields(victims, kept)})
            self._counters["demoted"] += victims.numel()
        self._preserve(victims)
        if self._recording is not None and self._disk is None:  # a demoted row stays (on disk): not a removal
            self._recording.removed.append(gone)
        self._index.remove(gone)
        if self._disk is None:  # a demoted row is not removed: a serving delta keeps it
            self._removals.add(self._version, gone)
        access.fill(victims, eviction.FREE)
        self._rows["version"].fill(victims, self._version)
        self._free.push(victims)
        self._live -= victims.numel()
        self._counters["evicted"] += victims.numel()


def _summed_by_id(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` made unique, the gradients of a repeated id summed (unchanged when every id is already unique)."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    if unique.numel() == ids.numel():
        return ids, grads
    return unique, torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)


def _all_locked(tables: Sequence[Table]) -> contextlib.ExitStack:
    """Every table's lock, taken in name order (so that two callers never wait on each other)."""
    held = contextlib.ExitStack()
    for table in sorted(tables, key=lambda t: t.config.name):
        held.enter_context(table.locked())
    return held


def _between_locks(tables: Sequence[Table], aheads: Sequence[Optional[ReadAhead]], shortfalls: Sequence[int]) -> None:
    """Reads the records of ``aheads`` (one or None per table) with no table's lock held, then makes the room of
    ``shortfalls`` in each table (:meth:`Table._room_to_make`, :meth:`Table._make_room`); on an error, ends every
    read (taking the locks) before it goes on up."""
    try:
        for ahead in aheads:
            if ahead is not None:
                ahead.read()
        for table, shortfall in zip(tables, shortfalls):
            table._make_room(shortfall)
    except BaseException:
        with _all_locked(tables):
            _end_reads(tables, aheads)
        raise


def _end_reads(tables: Sequence[Table], aheads: Sequence[Optional[ReadAhead]]) -> None:
    """Ends the reads ahead begun for ``tables`` (their locks held)."""
    for table, ahead in zip(tables, aheads):
        if ahead is not None:
            table._disk.end_read()


def _journal(tables: Sequence[Table], journal: Optional[Journal], always: bool) -> None:
    """Hands the tables' recorded changes to ``journal`` (when there are any, or ``always``); their locks held."""
    if journal is None:
        return
    changes = [table._take_recording() for table in tables if table._recording is not None]
    if always or any(changes):
        journal(changes)
