"""The tables of one shard behind one lock-free facade: what the gRPC servicer calls."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Optional, Sequence

import torch

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.store import checkpoint
from lightning_persia.remote_ps.store.disk import checkpoint as disk_checkpoint, tier_folders
from lightning_persia.remote_ps.store.disk.demoter import Demoter
from lightning_persia.remote_ps.store.expiry import Expirer

from lightning_persia.remote_ps.store.errors import CheckpointError, InvalidRequestError, StoreError, UnknownTableError
from lightning_persia.remote_ps.store.disk.mapped_budget import MappedBudget
from lightning_persia.remote_ps.store.disk.part import DiskPart
from lightning_persia.remote_ps.store.disk.records import record_specs
from lightning_persia.remote_ps.store.progress import Progress
from lightning_persia.remote_ps.store.handover import SlotHandover
from lightning_persia.read_write_lock import ReadWriteLock
from lightning_persia.remote_ps.store.slot_moves import MapMovedError, MoveTally, OutgoingSlots, SlotsMovingError
from lightning_persia.remote_ps.store.disk.segment_mapping import MAPPED_BYTES
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.store.table_journal import Journal
from lightning_persia.remote_ps.store.table_snapshot import TableSnapshot
from lightning_persia.remote_ps.store.wal.changes import Change, TableChange
from lightning_persia.remote_ps.store.wal.shard_log import ShardLog
from lightning_persia.remote_ps.table_config import TableConfig


_DELTA_BASES = 16  # recent deltas a new one may start from


class ShardStore(SlotHandover):
    """All tables of shard ``shard_index`` of ``num_shards``.

    Tables come from :meth:`configure` or, on first use, from ``table_defaults`` (the tables declared in
    the PS config). Every method is thread-safe; reads and writes of one table are serialised by that
    table's lock, different tables proceed in parallel.

    With a write-ahead log (:attr:`log`, see ``wal/shard_log.py``) every change a caller could see is in the log
    before the call returns: an update's new rows, a training lookup's admissions and evictions, a new table. A
    save starts a log segment at its consistent point and deletes the older ones once it is complete.

    Example::

        store = ShardStore(shard_index=0, num_shards=1)
        store.configure(TableConfig("user", dim=16, optimizer=Adagrad(rowwise=True)))
        rows = store.lookup("user", torch.tensor([3, 7]), train=True)
        store.update("user", torch.tensor([3, 7]), torch.ones(2, 16))
    """

    def __init__(
        self, shard_index: int, num_shards: int, seed: int = 0, table_defaults: dict[str, TableConfig] | None = None,
        fault_save_delay_s: float = 0.0, disk_dir: Optional[str] = None, expiry_interval_s: float = 1.0,
        demotion_interval_s: Optional[float] = 0.01, disk_mapped_bytes: int = MAPPED_BYTES,
        memory_limit_bytes: Optional[int] = None, shard_map: Optional[ShardMap] = None,
    ) -> None:
        """``disk_dir``: where the disk tiers of the tables of ``storage="disk"`` live (a folder per tier under
        ``shard-<i>-of-<n>/``, deleted with its table; what earlier incarnations left there is deleted when this
        shard makes its first disk table: ``tier_folders.py``); ``None``: such tables are refused.
        ``expiry_interval_s``: how often the rows of tables with a TTL are swept (on a thread of the store's own,
        started with the first such table). ``demotion_interval_s``: how often the demoter looks for disk tables
        whose memory tier needs room (``demoter.py``; started with the first disk table); ``None``: no demoter, a
        request that needs room demotes it (the rows in memory then depend on the requests alone).
        ``disk_mapped_bytes``: of each disk table's records, how many bytes are kept mapped at most (``segment_mapping.py``).
        ``memory_limit_bytes``: the process's resident memory the disk tables' mappings may fill up to, instead of
        ``disk_mapped_bytes`` each (``mapped_budget.py``; sized by the demoter, so it needs one).
        ``shard_map``: which ids are this shard's (default: :meth:`ShardMap.uniform` of ``num_shards``)."""
        if memory_limit_bytes is not None and demotion_interval_s is None:
            raise ValueError("a memory limit sizes the disk tables' mappings in the demoter's passes: it needs a demoter "
                             "(demotion_interval_s)")
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
        self.shard_index = shard_index
        self.num_shards = num_shards
        self._shard_map = shard_map if shard_map is not None else ShardMap.uniform(num_shards)
        self._map_addresses: tuple[str, ...] = ()
        if self._shard_map.num_shards != num_shards:
            raise ValueError(f"a shard map of {self._shard_map.num_shards} shards for a cluster of {num_shards}")
        self.seed = seed
        self._defaults = dict(table_defaults or {})
        self.fault_save_delay_s = fault_save_delay_s  # testing only: see PSConfig.fault_save_delay_s
        self._tables: dict[str, Table] = {}
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()  # one save or load at a time
        self._delta_points: dict[str, dict[str, int]] = {}  # save id of a recent delta -> each table's point
        #: how far each table's last save, load or re-shard is (logged, and read by the metrics)
        self.progress = Progress(f"shard {shard_index}/{num_shards}")
        self._disk_dir = disk_dir
        self._disk_mapped_bytes = disk_mapped_bytes
        # requests and sweeps hold it for reading, changes of what the shard owns for writing (slot_moves.py)
        self._gate = ReadWriteLock()
        self._outgoing: Optional[OutgoingSlots] = None  # the slots this shard is handing over, while it does
        self._map_changed = threading.Condition()  # requests routed by a map this shard has not adopted yet wait on it
        self.moves = MoveTally()  #: what this shard's live moves carried (read by the metrics)
        self._given_up_version = 0
        self._swept = False  # rows of others' slots may be here (a log's replay): the first handover's end sweeps them
        self._expirer = Expirer(self._tables_with_ttl, expiry_interval_s, journal=lambda: self._journal("", 0, []),
                                guard=self._gate.reading)
        budget = MappedBudget(memory_limit_bytes) if memory_limit_bytes is not None else None
        self._demoter = Demoter(self._disk_tables, demotion_interval_s, budget) if demotion_interval_s is not None else None
        self.log: Optional[ShardLog] = None  # set once the shard restored itself (wal/shard_log.py)

    def configure(self, config: TableConfig) -> TableConfig:
        """Creates the table, or returns the existing one's config when the dims agree."""
        with self._lock:
            existing = self._tables.get(config.name)
            if existing is None:
                self._tables[config.name] = self._new_table(config)
                ticket = self.log.record_configure(config.to_dict()) if self.log is not None else 0
        if existing is None:
            if ticket:
                self.log.wait(ticket)
            return config
        if existing.config.dim != config.dim:
            raise InvalidRequestError(f"table {config.name!r} exists with dim {existing.config.dim}, asked for dim {config.dim}")
        return existing.config

    @property
    def shard_map(self) -> ShardMap:
        """Which ids are this shard's: it refuses the others, and its saves and loads sift rows by it."""
        return self._shard_map

    def describe(self, name: str) -> TableConfig:
        return self._table(name).config

    def table_count(self) -> int:
        """Tables created so far (declared defaults not used yet do not count)."""
        with self._lock:
            return len(self._tables)

    def tables(self) -> list[str]:
        with self._lock:
            return sorted(set(self._tables) | set(self._defaults))

    def lookup(self, name: str, ids: torch.Tensor, train: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows of ``ids`` (int64, 1-D) as ``[n, dim]`` of ``dtype``; ``train`` admits unseen ids."""
        return self.lookup_many([(name, ids)], train, dtype)[0]

    def lookup_many(self, requests: Sequence[tuple[str, torch.Tensor]], train: bool, dtype: torch.dtype = torch.float32,
                    map_version: Optional[int] = None) -> list[torch.Tensor]:
        """:meth:`lookup` of several tables; every table is checked before any admits a row.

        ``map_version``: the version of the shard map the caller routed the ids by (None: this shard's own); ids this
        shard's newer map gives another shard raise :class:`MapMovedError`."""
        with self._gate.reading():
            tables = [self._table(name) for name, _ in requests]
            for name, ids in requests:
                self._check_ids(name, ids, map_version)
            if not requests:  # a lookup of no table (the native path's batch of zero jobs needs the kernels)
                return []
            tickets: list[int] = []
            journal = self._journal("", 0, tickets) if train else None
            found = Table.lookup_together([(table, ids) for table, (_, ids) in zip(tables, requests)], train, dtype, journal)
            if self.log is not None:  # the rows read may hold an update whose record is still queued: none is served unlogged
                self.log.wait_all()
            return found

    def update(self, name: str, ids: torch.Tensor, grads: torch.Tensor) -> int:
        """Applies the table's optimizer to the rows of ``ids``; duplicate ids have their gradients summed."""
        return self.update_many([(name, ids, grads)])

    def update_many(self, requests: Sequence[tuple[str, torch.Tensor, torch.Tensor]], client: str = "", seq: int = 0,
                    map_version: Optional[int] = None) -> int:
        """:meth:`update` of several tables, all or nothing: every table is checked before any row changes.

        Returns the rows updated in all, once the update is in the log (when there is one) with its ``(client,
        seq)``, from which a restarted shard rebuilds its exactly-once memory. ``map_version``: as for
        :meth:`lookup_many`.
        """
        names = [name for name, _, _ in requests]
        if len(set(names)) != len(names):
            raise InvalidRequestError(f"a table appears more than once in one update: {names}")
        with self._gate.reading():
            tables = [self._table(name) for name in names]
            for table, (name, ids, grads) in zip(tables, requests):
                self._check_ids(name, ids, map_version)
                expected = (ids.numel(), table.config.dim)
                if grads.dtype != torch.float32 or tuple(grads.shape) != expected:
                    raise InvalidRequestError(f"table {name!r}: gradients must be float32 of shape {expected}, got "
                                              f"{grads.dtype} {tuple(grads.shape)}")
                if not bool(torch.isfinite(grads).all()):
                    raise InvalidRequestError(f"table {name!r}: gradients contain NaN or infinity")
            tickets: list[int] = []
            applied = Table.update_together([(table, ids, grads) for table, (_, ids, grads) in zip(tables, requests)],
                                            self._journal(client, seq, tickets))
            self._wait_logged(tickets)
            return applied

    def _journal(self, client: str, seq: int, tickets: list[int]) -> Optional[Journal]:
        """What an operation tells its changes: the write-ahead log, and a handover's collection while one runs (both
        read once, inside the routing gate, so the whole operation reports to the same ones)."""
        log, outgoing = self.log, self._outgoing
        if log is None and outgoing is None:
            return None

        def journal(changes: list[TableChange]) -> None:
            if outgoing is not None:
                outgoing.collect(changes)
            if log is not None:
                tickets.append(log.record(Change(changes, client, seq)))

        return journal

    def _wait_logged(self, tickets: list[int]) -> None:
        if tickets:
            self.log.wait(tickets[-1])

    def replay_change(self, change: Change) -> int:
        """Applies a change read back from the log (a restarted shard, before it serves); the rows it wrote."""
        rows = 0
        for part in change.tables:
            table = self._table(part.name)
            with table.lock:
                table.replay_locked(part)
            rows += part.admitted.numel() + (part.rows["ids"].numel() if part.rows else 0)
        return rows

    @property
    def map_addresses(self) -> tuple[str, ...]:
        """Where the shards of :attr:`shard_map` listen, in shard order, as the move that made it said (empty for the
        map the shard started with): kept in the log, so a restarted shard still tells its clients."""
        return self._map_addresses

    def replay_map(self, shard_map: ShardMap, addresses: Sequence[str] = ()) -> None:
        """Makes ``shard_map`` (whose shards listen at ``addresses``) this shard's again, as the log read back says it
        was (before the shard serves)."""
        with self._map_changed:
            self._shard_map = shard_map
            self._map_addresses = tuple(addresses)
            self.num_shards = shard_map.num_shards
            if self._outgoing is not None and shard_map.version >= self._outgoing.to_map.version:
                self._outgoing = None  # a replayed fence whose move went through
            self._map_changed.notify_all()

    def replay_configure(self, config: dict) -> None:
        """Creates a table read back from the log (as :meth:`configure`, without logging it again)."""
        config = TableConfig.from_dict(config)
        with self._lock:
            if config.name not in self._tables:
                self._tables[config.name] = self._new_table(config)

    def clear(self) -> None:
        """Drops every table (a replay that stopped half-way: nothing of it may stay)."""
        with self._save_lock, self._lock:
            dropped, self._tables = self._tables, {}
            self._delta_points.clear()
        for table in dropped.values():
            table.close()

    def stats(self) -> dict[str, dict[str, int | float | str | list]]:
        with self._lock:
            tables = dict(self._tables)
        return {name: table.stats() for name, table in sorted(tables.items())}

    def background_cpu_s(self) -> dict[str, float]:
        """CPU seconds the shard's background threads have spent in their passes so far: the demoter's (promotions,
        demotions, compaction of disk tables) and the expirer's."""
        return {"demoter": self._demoter.cpu_s if self._demoter is not None else 0.0, "expirer": self._expirer.cpu_s}

    def save(self, directory: str, save_id: str = "") -> None:
        """Writes this shard's part of a checkpoint under ``directory`` (``save_id``: the same for every shard).

        One consistent point for all tables (taken with every table's lock held at once), then each table is
        streamed to disk a chunk at a time while the shard keeps serving. One save at a time.
        """
        self._save(directory, save_id, since=None)

    def save_delta(self, directory: str, save_id: str, base_id: str = "") -> None:
        """Writes what changed since the delta ``base_id`` (an earlier ``save_id`` of this method) under
        ``directory``: the rows written since, and the ids evicted since.

        A table this shard cannot give the changes of (``base_id`` empty or not one of this process's recent
        deltas, as after a restart; a table created since; evictions not logged that far back) is written whole:
        its manifest entry then says ``since: 0``, and whoever applies the delta replaces that table.
        """
        since = self._delta_points.get(base_id, {}) if base_id else {}
        points = self._save(directory, save_id, since=since)
        self._delta_points[save_id] = points
        while len(self._delta_points) > _DELTA_BASES:
            self._delta_points.pop(next(iter(self._delta_points)))

    def _save(self, directory: str, save_id: str, since: Optional[dict[str, int]]) -> dict[str, int]:
        with self._save_lock:
            segment = None
            # The shard's lock from the listing of the tables to the log's new segment: a table created in between
            # would be in neither the checkpoint nor the log the checkpoint truncates (table locks come after it).
            with self._lock, contextlib.ExitStack() as held:
                tables = [self._tables[name] for name in sorted(self._tables)]
                if since is not None:
                    for table in tables:
                        table.remember_removals()
                for table in tables:
                    held.enter_context(table.lock)
                snapshots = [self._begin(table, (since or {}).get(table.config.name, 0)) for table in tables]
                if since is None and self.log is not None:  # the log after this point is what the checkpoint lacks
                    segment = self.log.begin_base(directory, self._shard_map)
            try:
                checkpoint.write_shard(directory, self.shard_index, self.shard_map, snapshots, save_id=save_id,
                                       pause_s=self.fault_save_delay_s, progress=self.progress)
            finally:
                for snapshot in snapshots:
                    snapshot.close()
            if segment is not None:
                self.log.end_base(segment, directory)
            return {s.config.name: s.point for s in snapshots}

    @staticmethod
    def _begin(table: Table, since: int) -> TableSnapshot:
        try:
            return table.begin_snapshot(since)
        except StoreError:  # its evictions since then are not known: the delta carries the whole table
            return table.begin_snapshot(0)

    def stage_delta(self, directory: str) -> "StagedDelta":
        """Reads and checks a delta (or a full checkpoint) that :meth:`save_delta` wrote, without applying it.

        Raises :class:`CheckpointError` naming the file when it is incomplete, corrupted or out of place.
        """
        sources = checkpoint.open_for_shard(directory, self.shard_index, self.shard_map)
        staged = []
        for source in sources:
            blocks = [{name: values.clone() for name, values in block.items()}  # a block's buffers are reused
                      for block in source.blocks(self.shard_index, self.shard_map, progress=self.progress)]
            rows = {name: torch.cat([b[name] for b in blocks]) for name in blocks[0]} if blocks else None
            staged.append((source, rows, source.removed(self.shard_index, self.shard_map)))
        return StagedDelta(self, staged)

    def _apply(self, staged: list) -> None:
        # The shard's lock is held throughout: a lookup that has not found its table yet waits, rather than find a
        # replacing table before its rows are in (table locks are always taken after the shard's, never before).
        with self._lock, contextlib.ExitStack() as held:
            for source, _, _ in staged:
                if source.since == 0 or source.name not in self._tables:  # whole: replaces the table
                    replaced = self._tables.get(source.name)
                    self._tables[source.name] = self._new_table(source.config)
                    if replaced is not None:
                        replaced.close()
            tables = {source.name: self._tables[source.name] for source, _, _ in staged}
            for name in sorted(tables):
                held.enter_context(tables[name].lock)
            for source, rows, removed in staged:
                table = tables[source.name]
                table.remove_ids_locked(removed)
                if rows is not None:
                    table.upsert_locked(rows)

    def load(self, directory: str, own_part: bool = False) -> None:
        """Replaces every table by the rows of the checkpoint at ``directory`` that belong to this shard.

        ``own_part``: read this shard's own folder alone where there is one (``checkpoint.open_for_shard``): what a
        replay of its log starts from.

        The checkpoint may come from any number of shards. Every file is checked before a table is replaced:
        nothing changes if the checkpoint is incomplete or corrupted. The tables are then read a block at a
        time, after the old ones are dropped (memory for one copy of the tables, not two); lookups in the
        meantime find no table. A shard that holds no table (one that starts from the checkpoint) checks the
        checksums while it reads the rows instead, one pass over the disk: a damaged file leaves it without
        tables, as it was.
        """
        with self._lock:
            holds_tables = bool(self._tables)
        sources = checkpoint.open_for_shard(directory, self.shard_index, self.shard_map, check_first=holds_tables,
                                            own_part=own_part)
        with self._save_lock:
            with self._lock:
                dropped, self._tables = self._tables, {}
            for table in dropped.values():
                table.close()
            self._delta_points.clear()  # the new tables' versions restart: a delta since an older point would miss rows
            tables = {}
            for source in sources:
                table = self._new_table(source.config)
                table.restore_step(source.step)
                table.load(source.blocks(self.shard_index, self.shard_map, progress=self.progress),
                           expected_rows=source.rows_for(self.shard_map))
                self._load_disk(table, source)
                tables[source.name] = table
            with self._lock:
                self._tables = tables
                if self.log is not None:  # the log now follows this checkpoint
                    with contextlib.ExitStack() as held:
                        for name in sorted(tables):
                            held.enter_context(tables[name].lock)
                        segment = self.log.begin_base(directory, self._shard_map)
            if self.log is not None:
                self.log.end_base(segment, directory)

    def _load_disk(self, table: Table, source: checkpoint.TableSource) -> None:
        """The disk tier of a checkpoint's table: its segments linked when this shard saved them, else its live rows
        read and re-sharded (those past the memory budget written to the new tier)."""
        parts = source.disk_parts()
        if not parts:
            return
        if source.own_folder(self.shard_map) is not None and table.config.storage == "disk":
            folder, entry = parts[0]
            table.disk.attach(disk_checkpoint.segments(folder, entry), disk_checkpoint.id_map(folder, entry))
            return
        for folder, entry in parts:
            table.load(disk_checkpoint.rows(folder, entry, record_specs(table.field_specs), self.shard_index, self.shard_map))

    def load_latest(self, root: str) -> str:
        """Loads the newest complete checkpoint at or under ``root`` (see :func:`checkpoint.candidate_checkpoints`).

        Returns its path. Raises :class:`CheckpointError` listing why each candidate was refused when none loads.
        """
        refused = []
        for candidate in checkpoint.candidate_checkpoints(root):
            try:
                self.load(str(candidate))
            except CheckpointError as err:
                refused.append(f"{candidate}: {err}")
                continue
            return str(candidate)
        reasons = "; ".join(refused) if refused else "no folder with shard-NNNNN-of-NNNNN folders in it"
        raise CheckpointError(f"no complete parameter-server checkpoint at or under {root} ({reasons})")

    def _table(self, name: str) -> Table:
        with self._lock:
            table = self._tables.get(name)
            if table is None and name in self._defaults:
                table = self._tables[name] = self._new_table(self._defaults[name])
        if table is None:
            raise UnknownTableError(f"unknown table {name!r}; known tables: {sorted(self._tables)}")
        return table

    def expire(self, now: Optional[float] = None) -> int:
        """Sweeps every table with a TTL now (the expiry thread does every ``expiry_interval_s``); returns the rows deleted."""
        return sum(table.expire(time.monotonic() if now is None else now, self._journal("", 0, []))
                   for table in self._tables_with_ttl())

    def _tables_with_ttl(self) -> list[Table]:
        with self._lock:
            return [t for t in self._tables.values() if t.config.ttl_steps is not None or t.config.ttl_seconds is not None]

    def _disk_tables(self) -> list[Table]:
        with self._lock:
            return [t for t in self._tables.values() if isinstance(t.disk, DiskPart)]

    def _new_table(self, config: TableConfig) -> Table:
        if (config.ttl_steps is not None or config.ttl_seconds is not None) and not self._expirer.started:
            self._expirer.start()
        if config.storage == "disk" and self._disk_dir is not None and self._demoter is not None and not self._demoter.started:
            self._demoter.start()
        disk = None
        if config.storage == "disk" and self._disk_dir is not None:
            folder = tier_folders.shard_folder(self._disk_dir, self.shard_index, self.num_shards)
            tier_folders.claim(folder)
            disk = str(tier_folders.tier_folder(folder, config.name))
        return Table(config, self.seed, disk_dir=disk, disk_mapped_bytes=self._disk_mapped_bytes,
                     promote_later=self._demoter is not None)

    def _check_ids(self, name: str, ids: torch.Tensor, map_version: Optional[int] = None) -> None:
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise InvalidRequestError(f"table {name!r}: ids must be a 1-D int64 tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
        shard_map, outgoing = self._shard_map, self._outgoing
        if outgoing is not None and outgoing.fenced and bool(outgoing.covers(ids).any()):
            raise SlotsMovingError(f"table {name!r}: ids of slots this shard is handing over to shard map version "
                                   f"{outgoing.to_map.version} at this moment; retry")
        foreign = shard_map.first_foreign(ids, self.shard_index) if shard_map.num_shards > 1 else -1
        if foreign >= 0:
            example = ids[foreign : foreign + 1]
            if map_version is not None and map_version > shard_map.version:
                # A move's takers adopt its map one after the other: a client that heard it from the first may reach
                # the next before it adopted, and the rows it sends for may still have a last change on the way.
                raise SlotsMovingError(f"table {name!r}: id {int(example)} was routed by shard map version {map_version}, "
                                       f"which this shard has not adopted yet (it routes by version {shard_map.version}); "
                                       "retry")
            if map_version is not None and map_version < shard_map.version:
                raise MapMovedError(f"table {name!r}: id {int(example)} moved to shard {int(shard_map.shard_of(example))} "
                                    f"in shard map version {shard_map.version} (the request was routed by version "
                                    f"{map_version})", shard_map.version)
            raise InvalidRequestError(
                f"table {name!r}: id {int(example)} belongs to shard {int(shard_map.shard_of(example))}, not to this shard "
                f"{self.shard_index} of {shard_map.num_shards} (shard map version {shard_map.version}); the client and "
                f"the shards disagree on the shard map"
            )


class StagedDelta:
    """A delta read and checked by :meth:`ShardStore.stage_delta`; :meth:`commit` applies it.

    The commit holds the shard's lock and the lock of every table it changes for its whole duration, so a lookup
    of a table sees it either before or after the delta, never half of it. (A lookup of several tables reads them
    one after the other: a commit may fall between two of them; the serving ``Predictor`` keeps its requests off
    the shards while it commits.)
    """

    def __init__(self, store: ShardStore, staged: list) -> None:
        self._store = store
        self._staged = staged

    @property
    def rows(self) -> int:
        """Rows the delta writes (inserted or replaced)."""
        return sum(rows["ids"].numel() for _, rows, _ in self._staged if rows is not None)

    def commit(self) -> None:
        self._store._apply(self._staged)
