"""A table's rows in memory: where each id's row is, which rows are free, which leave when the memory is full.

The fields live in a chunked row store (``chunked_rows.py``), so the table grows without copying or pausing;
the id index (``index.py``) maps ids to rows. Rows are stored in the table's ``storage_dtype`` (fp16 halves
the memory of the values); the optimizer state stays float32 whatever it is, and every update runs in float32.

**Versions.** Every row records the table's *version* at its last change (insert, update, eviction). A
checkpoint or a serving delta advances the version, so "changed since point P" is ``version > P``. That gives a
streamed checkpoint its consistent point (:meth:`MemoryRows.begin_snapshot`, copied chunk by chunk while training
goes on: ``table_snapshot.py``). Only the access statistics (LRU step / LFU count) may be newer than the point. A
snapshot *since* an earlier point holds only the rows changed after it, and the ids evicted after it
(``removal_log.py``): a delta for serving. What a journaled operation changed is collected for the shard's
write-ahead log (``table_journal.py``).

**The memory limit.** Rows are taken only from free ones (:meth:`MemoryRows._take_rows` evicts nothing): whoever
brings rows in makes room first, through the limit's one entry point, :meth:`MemoryRows.evict_coldest` (the rows
to evict: :meth:`MemoryRows.rows_to_evict`). It selects the coldest rows (``eviction.py``), hands them to the disk
part to keep where the table has one (``disk/part.py``: demoted to disk), else removes them, and frees their rows.
The table brings rows back from disk through :meth:`MemoryRows.place`; an id that neither tier holds enters as the
table's admission part (``admission.py``) decides, the table writing it through :meth:`MemoryRows.admit_in_one_pass`
or :meth:`MemoryRows.write_admitted`.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Optional, Sequence

import torch

from lightning_persia.remote_ps.store import eviction
from lightning_persia.remote_ps.store.admission import FirstRows
from lightning_persia.remote_ps.store.chunked_rows import ChunkedRows, FieldSpec
from lightning_persia.remote_ps.store.disk.part import DiskPart, NoDisk
from lightning_persia.remote_ps.store.disk.records import DISK_FIELDS
from lightning_persia.remote_ps.store.errors import StoreError
from lightning_persia.remote_ps.store.free_rows import FreeRows
from lightning_persia.remote_ps.store.index import NativeIdIndex, make_index
from lightning_persia.remote_ps.store.initializers import initial_rows
from lightning_persia.remote_ps.store.native import jobs as native
from lightning_persia.remote_ps.store.optimizers import make_rule
from lightning_persia.remote_ps.store.removal_log import RemovalLog
from lightning_persia.remote_ps.store.table_journal import Journal, Recording
from lightning_persia.remote_ps.store.table_snapshot import SAVED_FIELDS, Preimages, SnapshotPoint, TableSnapshot
from lightning_persia.remote_ps.store.wal.changes import TableChange
from lightning_persia.remote_ps.table_config import STORAGE_DTYPES, TableConfig


class MemoryRows:
    """The rows of one table in memory, and ``lock``, which guards them: :class:`~.table.Table` is one, and serves
    the requests over them; its disk part asks them through :class:`~.disk.part.Memory`.

    The private methods, and those that say so, are called holding ``lock``.
    """

    def __init__(self, config: TableConfig, seed: int) -> None:
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
        self._eviction = eviction.Eviction(self._rows["access"], seed)
        self._size = 0  # rows allocated so far (live or free)
        self._live = 0
        self._free = FreeRows()
        self._step = 0
        self._version = 1  # written into every changed row; never-written rows read 0
        self._preimages = Preimages(self._rows, self.field_specs, self.lock)
        self._recording: Optional[Recording] = None  # the changes of the journaled operation under way
        self._removals = RemovalLog(config.name)
        self._counters = dict(lookups=0, lookup_rows=0, inserted=0, evicted=0, updates=0, update_rows=0,
                              dropped_update_rows=0, expired=0)
        self._disk: DiskPart | NoDisk = NoDisk(self)  # where evicted rows go: nowhere, or to disk

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

    @property
    def inserted(self) -> int:
        """Ids the index took in so far (a lookup that let the lock go probes again where it changed meanwhile)."""
        return self._index.inserted

    # ---- rows written from outside a request: a checkpoint, a delta, the log ---------------------

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
            self.evict_coldest(self.rows_to_evict(fresh.numel()), keep=found[present])
            new_rows = self._take_rows(fresh.numel())
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
        if rows.numel():
            self._free_rows(rows, self._rows["ids"].gather(rows))

    def restore_step(self, step: int) -> None:
        """The lookup step counter of a checkpoint (LRU access values are relative to it)."""
        with self.lock:
            self._step = max(self._step, step)

    # ---- checkpoints -------------------------------------------------------------------------------

    def begin_snapshot(self, since: int = 0, disk_map: bool = True, slot_mask: Optional[torch.Tensor] = None) -> TableSnapshot:
        """Takes the table's consistent point for a checkpoint; call it holding :attr:`lock`.

        The rows are then read chunk by chunk with :meth:`TableSnapshot.chunks`, while the table keeps serving.
        ``since`` (the :attr:`TableSnapshot.point` of an earlier snapshot) keeps only what changed after it: the
        rows written since, and the ids evicted since (:attr:`TableSnapshot.removed`). Raises :class:`StoreError`
        when the evictions since then are no longer remembered (then only a full snapshot is possible).
        ``disk_map``: a disk table's id map is saved as at the point too (a checkpoint keeps it; a live move, which
        reads the point's rows alone, does not). ``slot_mask``: the memory rows the snapshot holds, by their ids' routing
        slots (bool, one per slot of ``ops/shard_map.py``; default: every row; neither the removed ids nor the disk
        tier's rows are filtered).
        """
        if self._preimages.active is not None:
            raise StoreError(f"table {self.config.name!r} is already being saved")
        removed = self._removals.since(since) if since else torch.empty(0, dtype=torch.int64)
        state = SnapshotPoint(point=self._version, since=since, size=self._size, live=self._live, step=self._step,
                              removed=removed, disk=self._disk.freeze(disk_map) if not since else None, slot_mask=slot_mask)
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

    def _drop(self, rows: torch.Tensor) -> None:
        """Deletes live ``rows`` (expired); the lock held."""
        self._preserve(rows)
        gone = self._rows["ids"].gather(rows)
        self._removed(gone)
        self._free_rows(rows, gone)

    def _removed(self, ids: torch.Tensor) -> None:
        """``ids`` leave the table: the journal (if one listens) and a later serving delta name them."""
        if self._recording is not None:
            self._recording.removed.append(ids)
        self._removals.add(self._version, ids)

    def _free_rows(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Frees live ``rows``, whose ids are ``ids``: unindexed, marked free and changed at this version."""
        self._index.remove(ids)
        self._rows["access"].fill(rows, eviction.FREE)
        self._rows["version"].fill(rows, self._version)
        self._free.push(rows)
        self._live -= rows.numel()

    # ---- a lookup's rows in memory ------------------------------------------------------------------

    def _touch(self, train: bool, advance: bool = True) -> Optional[tuple]:
        """What a lookup writes into its rows' access values (a training one; an evaluation one leaves them); the
        lookup step advances unless ``advance`` is False (a lookup's second probe, after a read ahead: the table's
        step now, which other lookups may have advanced meanwhile)."""
        if not train:
            return None
        if advance:
            self._step += 1
        return (self._rows["access"], *eviction.touch_value(self.config.eviction, self._step))

    # ---- what admission asks of the memory (Admission's NewRows), and the rows it admits ---------------------

    @property
    def indexed_natively(self) -> bool:
        """Whether the id index is the native one (which can admit ids in one pass)."""
        return isinstance(self._index, NativeIdIndex)

    @property
    def saving(self) -> bool:
        """Whether a save is in progress (it keeps the pre-images of rows about to change)."""
        return self._preimages.active is not None

    def admit_in_one_pass(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, count: int, first: FirstRows) -> None:
        """Admits the absent ids of a training lookup into ``count`` free rows (the caller made room:
        :meth:`evict_coldest`) and fills their rows of ``out`` (``jobs.c``'s ``lp_admit``), their first records drawn
        from ``first`` (as the table's admission decided: :class:`~.admission.Admitted`). No save may be in progress
        (the pass keeps no pre-image). Only the ids at -1 are absent: a row at -2 was read from disk and queued for
        promotion, and stays the id's. The rows an id repeated in the request took beyond its first go back to the
        free list.
        """
        fresh = self._take_rows(count)
        weights, access, version = self._rows["weights"], self._rows["access"], self._rows["version"]
        state = self._rows.fields.get("state")
        fields = native.AdmitFields(
            weights=(weights.offset, weights.spec.dtype),
            access=(access.offset, eviction.first_access(self.config.eviction, self._step)),
            version=(version.offset, self._version),
            state=first.state,
            state_offset=state.offset if state is not None else 0,
        )
        job: Optional[native.AdmitJob] = None
        try:
            job = self._index.admit_job(ids.contiguous(), rows, out, fresh, fields, first.key, first.uniform)
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

    def write_admitted(self, ids: torch.Tensor, initial: torch.Tensor) -> None:
        """Writes the rows of ``ids`` (unique, absent, admitted: at most the capacity) into free rows (the caller made
        room: :meth:`evict_coldest`), ``initial`` their weights in the storage dtype, with a first access and the
        rule's initial state."""
        n = ids.numel()
        fields = {"weights": initial,
                  "access": torch.full((n,), eviction.first_access(self.config.eviction, self._step), dtype=torch.int32)}
        if "state" in self._rows.fields:
            fields["state"] = self.rule.initial_state(n)
        self._write_new(ids, fields)
        if self._recording is not None:
            self._recording.admitted(ids, fields["access"])
        self._counters["inserted"] += n

    # ---- what the disk part asks of the memory (DiskPart's Memory) -----------------------------------

    def saved_rows_locked(self, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``({field: values} of the ids (unique) present, in memory or on disk, the ids absent)``, the saved fields as a
        checkpoint holds them (a handover's round of changed rows); the lock held."""
        found = self.find_rows(ids)
        present = found >= 0
        rows = found[present]
        fields = [name for name in SAVED_FIELDS if name in self._rows.fields]
        values = {name: torch.empty(self.field_specs[name].shape(rows.numel()), dtype=self.field_specs[name].dtype) for name in fields}
        values = self._rows.gather_fields(rows, values)
        on_disk, absent = self._disk.saved_rows(ids[~present])
        if on_disk:
            values = {name: torch.cat([values[name], on_disk[name]]) for name in values}
        return values, absent

    def find_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The row of each of ``ids`` in memory, -1 where absent. The lock held."""
        return self._index.find(ids)

    def find_again(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool) -> None:
        """A lookup's second probe, back under the lock after it let it go: of ``ids`` at ``positions`` (those its
        first probe missed that may be in memory now: another request, or the demoter's promotions, may have brought
        them in meanwhile), those found get their row in ``rows`` and their values in ``out``, touched at the
        table's step now."""
        if not positions.numel():
            return
        again = torch.empty(positions.numel(), self.config.dim, dtype=self.storage_dtype)
        found = self._index.find(ids[positions], copy=(self._rows["weights"], again), touch=self._touch(train, advance=False))
        hit = found >= 0
        rows[positions[hit]] = found[hit]
        out[positions[hit]] = again[hit]

    def place(self, ids: torch.Tensor, values: dict[str, torch.Tensor], step: Optional[int] = None) -> torch.Tensor:
        """Writes rows read from disk (``ids`` unique and absent from memory, their ``values`` by field) into free
        rows (the caller made room: :meth:`evict_coldest`); returns their rows. ``step``: the lookup step that read
        them (LRU; the table's step now by default). The lock held."""
        n = ids.numel()
        fields = {"weights": values["weights"],
                  "access": (torch.full((n,), self._step if step is None else step, dtype=torch.int32)
                             if self.config.eviction == "lru" else values["access"] + 1)}
        if "state" in self._rows.fields:
            fields["state"] = values["state"]
        return self._write_new(ids, fields)

    def _write_new(self, ids: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        """Writes the rows of ``ids`` (unique, absent) into free rows, ``fields`` their values and this version
        theirs, in one pass; indexes them and returns their rows."""
        n = ids.numel()
        rows = self._take_rows(n)
        self._preserve(rows)
        self._rows.scatter_fields(rows, {"ids": ids, **fields, "version": torch.full((n,), self._version, dtype=torch.int32)})
        self._index.insert(ids, rows)
        self._live += n
        return rows

    def cold_estimate(self, count: int) -> Optional[tuple[int, float]]:
        """The access value at or below which the ``count`` coldest rows lie, from a sample read without the lock
        (:meth:`~.eviction.Eviction.cold_estimate`): what a demotion selects by. One estimate serves several
        demotions: the coldest :data:`eviction.BULK_FRACTION` of the rows lie below it, and an access value only
        grows."""
        with self.lock:
            access = self._access_in_use()
        return self._eviction.cold_estimate(access, count)

    def close(self) -> None:
        """Deletes the table's disk tier, if any (a table replaced or dropped; a checkpoint keeps the files it linked)."""
        self._disk.close()

    def remember_removals(self) -> None:
        """Starts logging evicted ids (from now on), so that snapshots since a later point can name them."""
        with self.lock:
            self._removals.start(self._version - 1)

    # ---- internals ---------------------------------------------------------------------------------

    def rows_to_evict(self, n: int) -> int:
        """How many rows :meth:`evict_coldest` must free before ``n`` more rows are taken: 0 where they fit in the
        table's capacity; else a bulk of them, or, for a disk table (whose demoter keeps room ahead, ``demoter.py``),
        what they need, no more (:meth:`DiskPart.evict_count`)."""
        room = self.config.capacity - self._live
        return self._disk.evict_count(n - room) if n > room else 0

    def _take_rows(self, n: int) -> torch.Tensor:
        """``n`` free rows (reused, else appended): nothing is evicted here; the caller made room first
        (:meth:`evict_coldest`), or the table holds more than its capacity until the demoter catches up."""
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

    def evict_coldest(self, count: int, estimated: Optional[tuple[int, float]] = None, keep: Optional[torch.Tensor] = None) -> int:
        """The memory limit's one entry point: evicts ``count`` cold rows (none where ``count`` <= 0), none of ``keep``:
        the rows the operation under way goes on to write (an evicted row it then wrote into would leave its id with
        the old value on disk and the new one in a row another id may take: a replay that made room so lost 632 of
        5,000 rows). A disk table's part keeps them on disk (demoted). ``estimated``: their threshold
        (:meth:`cold_estimate`). Returns how many rows it evicted. The lock held.

        A request calls it before it takes rows for what it brings in (:meth:`rows_to_evict` of them); a disk table's
        demoter, between requests (:meth:`~.table.Table.demote`)."""
        if count <= 0:
            return 0
        victims = self._eviction.victims(self._access_in_use(), count, estimated, keep)
        gone = self._rows["ids"].gather(victims)
        # a disk table demotes: the rows are written to disk first (a failure changes nothing), and stay there, so
        # they are no removal (neither the journal's nor a serving delta's)
        demoted = bool(self._disk.record_bytes)
        if demoted:
            fields = {name: torch.empty(self.field_specs[name].shape(victims.numel()), dtype=self.field_specs[name].dtype)
                      for name in DISK_FIELDS[1:] if name in self._rows.fields}
            self._disk.keep_evicted(gone, self._rows.gather_fields(victims, fields))
        self._preserve(victims)
        if not demoted:
            self._removed(gone)
        self._free_rows(victims, gone)
        self._counters["evicted"] += victims.numel()
        return victims.numel()


def journal_changes(tables: Sequence[MemoryRows], journal: Optional[Journal], always: bool) -> None:
    """Hands the tables' recorded changes to ``journal`` (when there are any, or ``always``); their locks held."""
    if journal is None:
        return
    changes = [table._take_recording() for table in tables if table._recording is not None]
    if always or any(changes):
        journal(changes)
