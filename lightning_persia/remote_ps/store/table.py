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

**Parts.** The table keeps the rows in memory and the lock; what it does beyond them is a part with one entry
point, each called without asking which kind the table has: its disk part (``disk/part.py``: the rows its memory
does not hold, or none), its admission (``admission.py``) and its time to live (``expiry.py``).
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, ContextManager, Iterable, Optional, Sequence

import torch

from lightning_persia.remote_ps.store import eviction
from lightning_persia.remote_ps.store.admission import Admission
from lightning_persia.remote_ps.store.chunked_rows import ChunkedRows, FieldSpec
from lightning_persia.remote_ps.store.disk import part as disk_part
from lightning_persia.remote_ps.store.disk.part import DiskPart, Gap, NoDisk
from lightning_persia.remote_ps.store.disk.segment_mapping import MAPPED_BYTES
from lightning_persia.remote_ps.store.errors import StoreError
from lightning_persia.remote_ps.store.expiry import SLICE_ROWS as EXPIRY_SLICE_ROWS, TimeToLive
from lightning_persia.remote_ps.store.free_rows import FreeRows
from lightning_persia.remote_ps.store.index import NativeIdIndex, make_index
from lightning_persia.remote_ps.store.initializers import initial_rows, table_key
from lightning_persia.remote_ps.store.native import jobs as native
from lightning_persia.remote_ps.store.optimizers import make_rule
from lightning_persia.remote_ps.store.removal_log import RemovalLog
from lightning_persia.remote_ps.store.table_journal import Journal, Recording
from lightning_persia.remote_ps.store.table_snapshot import SAVED_FIELDS, Preimages, SnapshotPoint, TableSnapshot
from lightning_persia.remote_ps.store.thread_clock import Held, LockWaits, WorstHeld
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
        ``promote_later``: a training lookup leaves the rows it read from disk to the shard's demoter
        (:meth:`DiskPart.promote_pending`) instead of bringing them into memory itself (``promotions.py``)."""
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
        self._admission = Admission(config, seed)
        self._ttl = TimeToLive(config)
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
        self._counters = dict(lookups=0, lookup_rows=0, inserted=0, evicted=0, not_admitted=0, updates=0, update_rows=0,
                              dropped_update_rows=0, expired=0)
        self._disk: DiskPart | NoDisk = NoDisk(config)
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

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.field_specs["weights"].dtype

    @property
    def step(self) -> int:
        """The table's lookup step (an LRU access value)."""
        return self._step

    @property
    def memory_rows(self) -> int:
        """Rows in memory now (read without the lock: a moment's value)."""
        return self._live

    # ---- lookups -----------------------------------------------------------------------------------

    def lookup(self, ids: torch.Tensor, train: bool, dtype: torch.dtype = torch.float32, journal: Optional[Journal] = None) -> torch.Tensor:
        """Rows of ``ids`` as ``[n, dim]`` of ``dtype``; training lookups admit unseen ids.

        ``journal`` hears of the ids the lookup admitted or evicted, if any (see :data:`Journal`). A disk table reads
        the records of the ids its memory lacks without the lock (:meth:`DiskPart.gap`), then takes it again to finish."""
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
        parts = [table._disk for table in tables]
        for part, (_, ids) in zip(parts if train else (), requests):
            part.check_request(ids.numel())
        outs = [torch.empty(ids.numel(), table.config.dim, dtype=table.storage_dtype) for table, ids in requests]
        with _all_locked(tables):
            held = Held.now(sum(ids.numel() for _, ids in requests), train)
            rows = Table._probe(requests, outs, train)
            gaps: list[Optional[Gap]] = []
            try:
                for part, (_, ids), found in zip(parts, requests, rows):
                    gaps.append(part.gap(ids, found, train))
            except BaseException:
                disk_part.end_reads(parts, gaps)
                raise
            if not any(gaps):
                Table._finish_together(requests, rows, outs, train, journal, held, gaps)
                return [out.to(dtype) for out in outs]
            inserted = [table._index.inserted for table in tables]
            for table in tables if train else ():
                table._worst_held.record(held)
        disk_part.between_locks(parts, gaps, lambda: _all_locked(tables))
        with _all_locked(tables):
            held = Held.now(sum(ids.numel() for _, ids in requests), train)
            disk_part.end_reads(parts, gaps)  # every read ended before any table's rejoin may fail
            for (table, ids), found, out, before, gap in zip(requests, rows, outs, inserted, gaps):
                table._rejoin(ids, found, out, train, before, gap)
            Table._finish_together(requests, rows, outs, train, journal, held, gaps)
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
    def _finish_together(requests, rows, outs, train, journal, held, gaps) -> None:
        """The rest of each table's lookup once its memory was probed: its misses from disk or admitted, the counters,
        the journal; every lock held."""
        tables = [table for table, _ in requests]
        for table in tables:
            table._start_recording(journal if train else None)
        for (table, ids), found, out, gap in zip(requests, rows, outs, gaps):
            table._finish_lookup(ids, found, out, train, held, int((found < 0).sum()), gap)
        _journal(tables, journal, always=False)

    def _rejoin(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, inserted: int,
                gap: Optional[Gap]) -> None:
        """Back under the lock after it was let go: where ids were inserted since the index counted ``inserted``,
        the ids the first probe missed that may be in memory now (:meth:`DiskPart.rejoin`) are probed again
        (another request, or the demoter's promotions, may have brought them in meanwhile)."""
        absent = self._disk.rejoin(gap, rows if self._index.inserted != inserted else None)
        if absent is None or not absent.numel():
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
                       missing: int, gap: Optional[Gap]) -> None:
        """The rows of the ``missing`` ids the probe did not find (read from disk, or admitted when training), and the
        counters; lock held."""
        self._counters["lookups"] += 1
        self._counters["lookup_rows"] += ids.numel()
        if not missing:
            return
        with self._disk.operation("lookup"):
            left = self._disk.fill(ids, rows, out, train, missing, gap)
            if train and left and self._admits_natively(left):
                self._admit_natively(ids, rows, out, left)
            elif left:
                absent = rows == -1  # -2: read from disk, left there (an evaluation lookup, or a promotion queued)
                out[absent] = self._fill_missing(ids[absent], train)
        if train:
            self._worst_held.record(held)

    # ---- updates -----------------------------------------------------------------------------------

    def update(self, ids: torch.Tensor, grads: torch.Tensor, journal: Optional[Journal] = None) -> int:
        """Applies the optimizer to the rows of ``ids``; returns how many rows were present and updated.

        ``journal`` hears of the rows' new values (see :data:`Journal`)."""
        self._disk.check_request(ids.numel())
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
            table._disk.check_request(ids.numel())
        applied = 0
        with _all_locked(tables):
            for table, ids, _ in requests:
                table._disk.promote_absent(ids)
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
        self._disk.promote_absent(ids)
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
                block = self._disk.spill(block, self.config.capacity - self._live)
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
        self._disk.remove(ids)  # the delta's row replaces the one on disk
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
                              removed=removed, disk=self._disk.freeze() if not since else None)
        self._preimages.begin(state)
        self._version += 1
        return TableSnapshot(self.config, self.field_specs, state, self._preimages, self._disk.record_bytes)

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
                bytes=self._size * self._rows.record_bytes + self._index.nbytes + self._disk.map_bytes,
                storage=self.config.storage,
                **self._disk.stats(),
                saving_preimage_rows=snapshot.preimage_rows if snapshot is not None else 0,
                **self._worst_held.stats(),
            )

    # ---- time to live ------------------------------------------------------------------------------

    def expire(self, now: float, journal: Optional[Journal] = None) -> int:
        """Deletes the rows no training lookup touched within the table's TTL (see :mod:`expiry`); returns how many.

        Sweeps the rows a slice at a time, the lock held for one slice; then the disk tier's rows a block at a time.
        ``journal`` hears of the ids each slice deleted: a replay that missed them would bring the rows back with
        their old values.
        """
        if not self._ttl.enabled:
            return 0
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
                    _journal([self], journal, always=False)
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

    # ---- what the disk part asks of the memory (DiskPart's Memory) -----------------------------------

    def find_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The row of each of ``ids`` in memory, -1 where absent. The lock held."""
        return self._index.find(ids)

    def place(self, ids: torch.Tensor, values: dict[str, torch.Tensor], step: Optional[int] = None,
              keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Writes rows read from disk (``ids`` unique and absent from memory, their ``values`` by field) into memory;
        returns their rows. ``step``: the lookup step that read them (LRU; the table's step now by default);
        ``keep``: rows the operation under way goes on to write, which the room made for these must not demote. The
        lock held."""
        n = ids.numel()
        rows = self._take_rows(n, keep)  # may demote colder rows: written to disk before anything else changes
        self._preserve(rows)
        access = (torch.full((n,), self._step if step is None else step, dtype=torch.int32) if self.config.eviction == "lru"
                  else values["access"] + 1)
        written = {"ids": ids, "weights": values["weights"], "access": access,
                   "version": torch.full((n,), self._version, dtype=torch.int32)}
        if "state" in self._rows.fields:
            written["state"] = values["state"]
        self._rows.scatter_fields(rows, written)
        self._index.insert(ids, rows)
        self._live += n
        return rows

    def cold_estimate(self, count: int) -> Optional[tuple[int, float]]:
        """The access value at or below which the ``count`` coldest rows lie, from a sample read without the lock
        (:func:`eviction.estimate`): what a demotion selects by. One estimate serves several demotions: the
        coldest :data:`eviction.BULK_FRACTION` of the rows lie below it, and an access value only grows."""
        with self.lock:
            access = self._access_in_use()
        return eviction.estimate(access, count, self._demotion_sample)

    def demote_coldest(self, count: int, estimated: Optional[tuple[int, float]]) -> None:
        """Evicts ``count`` of the coldest rows (those in memory at most), selected by ``estimated``: the disk part
        keeps them (:meth:`DiskPart.demote`). The lock held."""
        self._evict(min(count, self._live), estimated)

    def close(self) -> None:
        """Deletes the table's disk tier, if any (a table replaced or dropped; a checkpoint keeps the files it linked)."""
        self._disk.close()

    # ---- internals ---------------------------------------------------------------------------------

    def _admits_natively(self, missing: int) -> bool:
        """Whether the ``missing`` ids of a training lookup are admitted in one native pass: every one of them is
        admitted (no admission draw, room for all), no save keeps pre-images, and their first rows are Uniform
        (the initialiser the pass draws; a Normal or Constant one takes the tensor path)."""
        return (isinstance(self._index, NativeIdIndex) and isinstance(self.config.init, Uniform) and self._preimages.active is None
                and self._admission.admits_all and missing <= self.config.capacity)

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
        keep = self._admission.admitted(ids)
        if not bool(keep.all()):
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
            self._evict(self._disk.evict_count(n - room), keep=keep)

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
        # a disk table demotes: the rows are written to disk first (a failure changes nothing), and stay there, so
        # they are no removal (neither the journal's nor a serving delta's)
        demoted = self._disk.keep_evicted(gone, lambda fields: self._rows.gather_fields(victims, fields))
        self._preserve(victims)
        if not demoted:
            if self._recording is not None:
                self._recording.removed.append(gone)
            self._removals.add(self._version, gone)
        self._index.remove(gone)
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


def _journal(tables: Sequence[Table], journal: Optional[Journal], always: bool) -> None:
    """Hands the tables' recorded changes to ``journal`` (when there are any, or ``always``); their locks held."""
    if journal is None:
        return
    changes = [table._take_recording() for table in tables if table._recording is not None]
    if always or any(changes):
        journal(changes)
