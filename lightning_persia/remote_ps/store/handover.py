"""A shard store's side of a live migration: handing slots over to other shards, and taking them in.

The steps and why they lose nothing are in ``slot_moves.py``. :class:`SlotHandover` is a part of
:class:`~lightning_persia.remote_ps.store.ShardStore` (its base), kept apart because the requests never call it: a
migration's coordinator does, through the shard's servicer.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch

from lightning_persia.ops.shard_map import SLOTS, ShardMap
from lightning_persia.remote_ps.store.errors import InvalidRequestError
from lightning_persia.read_write_lock import ReadWriteLock
from lightning_persia.remote_ps.store.progress import Progress
from lightning_persia.remote_ps.store.slot_moves import MoveTally, OutgoingSlots, part_of
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.store.table_snapshot import TableSnapshot
from lightning_persia.remote_ps.store.wal.changes import Change, TableChange
from lightning_persia.remote_ps.table_config import TableConfig

if TYPE_CHECKING:
    from lightning_persia.remote_ps.store.wal.shard_log import ShardLog


class SlotHandover:
    """The handover steps of a :class:`ShardStore`, which provides the attributes declared here and the methods
    ``configure``, ``_table``, ``_journal`` and ``_wait_logged``."""

    shard_index: int
    num_shards: int
    _shard_map: ShardMap
    _gate: ReadWriteLock
    _outgoing: Optional[OutgoingSlots]
    _map_changed: threading.Condition
    _given_up_version: int  # the newest map version a move to this shard rolled back from: never adopted since
    _swept: bool  # no row of a slot its map gives another shard is here (False after a restart or a take)
    _lock: threading.Lock
    _save_lock: threading.Lock
    _tables: dict[str, Table]
    log: Optional["ShardLog"]
    progress: Progress
    moves: MoveTally
    map_addresses: tuple[str, ...]

    def begin_handover(self, to_map: ShardMap, addresses: Sequence[str] = ()) -> Iterator[tuple[TableConfig, int, dict[str, torch.Tensor]]]:
        """Starts handing this shard's slots that ``to_map`` gives to other shards over to them.

        Takes one consistent point of every table (a disk table's rows in memory and on disk) and from then on collects
        the changes to the moving slots' rows (:meth:`handover_changes`). Returns ``(config, step, rows)`` of the
        moving slots' rows at the point, a block at a time (``rows``: ``{field: values}``, empty for a table without such rows; the new owner takes them as
        changes that write them, :meth:`take_changes`). One handover at a time. ``addresses``: of ``to_map``'s shards, which a fenced move whose
        coordinator is gone asks (``docs/elastic.md``, *A move without its coordinator*).
        """
        if to_map.version <= self._shard_map.version:
            raise InvalidRequestError(f"a handover to shard map version {to_map.version}, not newer than this shard's "
                                      f"{self._shard_map.version}")
        with self._gate.writing(), self._save_lock, self._lock, contextlib.ExitStack() as held:
            if self._outgoing is not None:
                raise InvalidRequestError(f"a handover to shard map version {self._outgoing.to_map.version} is under way")
            tables = [self._tables[name] for name in sorted(self._tables)]
            for table in tables:
                held.enter_context(table.lock)
            outgoing = OutgoingSlots(self.shard_index, self._shard_map, to_map, addresses)
            snapshots = [table.begin_snapshot(0, disk_map=False, slot_mask=outgoing.slot_mask) for table in tables]
            outgoing.hold(snapshots)
            self._outgoing = outgoing
        return self._handover_rows(outgoing, snapshots)

    def _handover_rows(self, outgoing: OutgoingSlots, snapshots: list[TableSnapshot]) -> Iterator[tuple[TableConfig, int, dict[str, torch.Tensor]]]:
        for snapshot in snapshots:
            yield snapshot.config, snapshot.step, {}  # the table, even with no row to move
            # about the moving rows of the point (ids hash evenly over the slots): the memory's alone are read
            moving = (snapshot.rows + snapshot.disk_rows) * len(outgoing.slots) // SLOTS
            job = self.progress.begin("hand-over", snapshot.config.name, moving)
            # memory's rows copied (a page gathers several blocks, and the snapshot reuses a chunk's buffers two chunks
            # on), then disk's (read into tensors of their own)
            memory = ({name: values.clone() for name, values in chunk.items()} for chunk in snapshot.chunks())
            for rows in itertools.chain(memory, _moving(snapshot.disk_chunks(), outgoing)):
                job.advance(int(rows["ids"].numel()))
                if rows["ids"].numel():
                    self.moves.handed(rows)
                    outgoing.note_handed(snapshot.config.name, rows["ids"])
                    yield snapshot.config, snapshot.step, rows
            job.finish()
        outgoing.point_read()
        outgoing.release()  # the tables stop keeping pre-images for the point as soon as its rows are read

    @property
    def handover(self) -> Optional[OutgoingSlots]:
        """The handover under way, or None."""
        return self._outgoing

    @property
    def fence(self) -> Optional[dict]:
        """The fenced handover as the write-ahead log keeps it (``OutgoingSlots.fence_record``), or None."""
        outgoing = self._outgoing
        return outgoing.fence_record() if outgoing is not None and outgoing.fenced else None

    @property
    def handover_map(self) -> Optional[ShardMap]:
        """The map the handover under way moves to, or None."""
        outgoing = self._outgoing
        return outgoing.to_map if outgoing is not None else None

    def handover_changes(self) -> tuple[list[TableConfig], list[Change]]:
        """The moving slots' rows changed since the handover's point (or the last call), as they are now: one change
        per table that writes the rows present and removes the others, and the configuration of every table (the
        changes may name a table made since the point). A row changed again after it was read is read again next
        time; after the fence, none is."""
        outgoing = self._handing_over()
        if outgoing.replayed:
            raise InvalidRequestError(f"this shard restarted during the move to shard map version {outgoing.to_map.version}: "
                                      "the rows changed since the move's last round are not known here, so the move "
                                      "cannot go through: give it up (ABORT) and run it again")
        changed = outgoing.take_changed()
        changes = []
        for name, ids in sorted(changed.items()):
            table = self._table(name)
            with table.lock:
                rows, absent = table.saved_rows_locked(ids)
                self.moves.handed(rows)
                outgoing.note_handed(name, rows["ids"])
                changes.append(Change([TableChange(name, table.step, removed=absent, rows=rows)]))
        return [table.config for table in self._listed_tables()], changes

    def fence_handover(self) -> None:
        """From now on the moving slots' ids are answered with :class:`SlotsMovingError`: the changes collected after
        this call are the last ones. The fence is in the log first: a shard restarted before the move ends comes back
        fenced (the new owners may have taken the slots over), and settles the move before it serves them."""
        with self._gate.writing():
            outgoing = self._handing_over()
            if self.log is not None and not outgoing.fenced:
                self.log.wait(self.log.record_fence(outgoing.fence_record()))
            outgoing.fenced = True

    def handover_sightings(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """Once fenced: ``(table, slots, counters)`` blocks of the moving slots' admission counters (sightings of ids not
        admitted yet, ``admission.py``), for each table that counts them. The shard counts no sighting of those slots'
        ids after the fence (it refuses them), so the counts move whole; :meth:`take_sightings` merges them."""
        outgoing = self._handing_over()
        if not outgoing.fenced:
            raise InvalidRequestError("a handover's sightings move once fenced: the shard still counts them until then")
        return self._sightings_of(torch.tensor(sorted(outgoing.slots), dtype=torch.int64))

    def _sightings_of(self, slots: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        for table in self._listed_tables():
            for block in slots.split(_SIGHTING_SLOTS_A_BLOCK):
                counters = table.sightings(block)
                if counters is None:
                    break
                yield table.config.name, block, counters

    def finish_handover(self, addresses: Sequence[str] = ()) -> None:
        """Adopts the handover's map (the new owners adopted it first) and drops the rows handed over. ``addresses``:
        of the map's shards (default: those the handover began with).

        The rows dropped are the ones the handover remembers handing over (:meth:`OutgoingSlots.handed_ids`): a wave
        of a fortieth of the slots then reads no other row. Where it does not know them (a restart), or where rows
        taken from other shards may have been left for slots this shard does not own (a move to it given up, and
        not rolled back here), every row's slot is read instead, as :meth:`abort_handover` does."""
        with self._gate.writing():
            outgoing = self._handing_over()
            if not outgoing.fenced:
                raise InvalidRequestError("a handover finishes once fenced: its last changes must have been taken")
            self._set_map(outgoing.to_map, addresses or outgoing.addresses)
            self._outgoing = None
        self.moves.finished += 1
        outgoing.release()
        outgoing.settled.set()
        handed = outgoing.handed_ids() if self._swept else None
        with self._save_lock:
            if handed is None:
                self._sweep_foreign_rows()
                return
            for table in self._listed_tables():
                ids = handed.get(table.config.name)
                if ids is not None:
                    self._drop_rows(table, ids)

    def abort_handover(self, to_map: Optional[ShardMap] = None) -> int:
        """Gives up the handover under way, if any (the slots stay this shard's, served as before), and drops the
        rows taken over for slots this shard's map does not give it (a handover to it that was given up).

        With ``to_map``, the move to it rolls back here for good unless this shard adopted it already (then nothing
        changes): this shard never adopts it, nor takes rows for it, later, restarted from its log or not. Returns
        this shard's map version after the call: ``>= to_map.version`` says the move had gone through here."""
        with self._gate.writing():
            if to_map is not None:
                if self._shard_map.version >= to_map.version:
                    return self._shard_map.version
                if to_map.version > self._given_up_version:
                    self._given_up_version = to_map.version
                    if self.log is not None:  # in the log before the answer that promises it
                        self.log.wait(self.log.record_given_up(to_map.version))
            outgoing, self._outgoing = self._outgoing, None
            if outgoing is not None and outgoing.fenced and self.log is not None:
                self.log.wait(self.log.record_fence(None))
            version = self._shard_map.version
        if outgoing is not None:
            self.moves.given_up += 1
            outgoing.release()  # the rows may never have been read: the point's snapshots end here
            outgoing.settled.set()
        with self._save_lock:
            self._sweep_foreign_rows()
        return version

    def replay_fence(self, fence: Optional[dict]) -> None:
        """Makes the log's FENCE (or its end, ``None``) this shard's again, before it serves: the moving slots stay
        refused until the move is settled (the shard's servicer does it first thing, ``remote_ps/move_settling.py``)."""
        if fence is None:
            self._outgoing = None
            return
        to_map = ShardMap.from_dict(fence["to_map"])
        if to_map.version <= self._shard_map.version:
            self._outgoing = None  # a MAP record since says the move went through
            return
        self._outgoing = OutgoingSlots(self.shard_index, self._shard_map, to_map, addresses=fence.get("addresses", ()))
        self._outgoing.fenced = self._outgoing.replayed = True

    def replay_given_up(self, version: int) -> None:
        """Makes the log's GIVEN_UP (the refusal of a move given up, or ``0``) this shard's again."""
        self._given_up_version = version

    @property
    def given_up_version(self) -> int:
        """The newest map version a move to this shard was given up from, which it never adopts (0: none)."""
        return self._given_up_version

    def take_changes(self, configs: Sequence[TableConfig], changes: Sequence[Change], to_map: ShardMap) -> None:
        """Applies, in order, the part ``to_map`` gives this shard of the rows (:meth:`begin_handover`'s blocks, as
        changes that write them) and then of the changes (:meth:`handover_changes`) another shard hands over,
        creating the tables ``configs`` first."""
        self._check_not_given_up(to_map)
        for config in configs:
            self.configure(config)
        mine = lambda ids: to_map.shard_of(ids) == self.shard_index  # noqa: E731
        try:
            for change in changes:
                parts = [part_of(part, mine, copy=False) for part in change.tables]
                for part in parts:
                    self.moves.taken(part.rows)
                pieces = [_in_pieces(part, self._table(part.name).config) for part in parts]
                if all(len(split) == 1 for split in pieces):
                    self._record(parts)
                    continue
                for split in pieces:  # a slice of rows at a time, the table serving between (see _in_pieces)
                    for piece in split:
                        self._record([piece])
        finally:
            # rows for slots this shard owns only once it adopts to_map: if the move is given up without this shard
            # hearing it, they stay until a sweep (after the rows are in, so that a sweep begun since sees them)
            self._swept = False

    def take_sightings(self, name: str, slots: torch.Tensor, counters: torch.Tensor, to_map: ShardMap) -> None:
        """Merges the admission counters of ``slots`` that another shard handed over (:meth:`handover_sightings`)
        into table ``name``'s, for the slots ``to_map`` gives this shard."""
        self._check_not_given_up(to_map)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= SLOTS):
            raise InvalidRequestError(f"sightings of table {name!r} name slots outside 0..{SLOTS - 1}")
        mine = to_map.table[slots] == self.shard_index
        try:
            self._table(name).merge_sightings(slots[mine], counters[mine])
        except ValueError as err:
            raise InvalidRequestError(f"the sightings of table {name!r} handed over do not fit its filter: {err}") from None

    def adopt_map(self, shard_map: ShardMap, addresses: Sequence[str] = ()) -> None:
        """Makes ``shard_map``, whose shards listen at ``addresses``, this shard's (a newer version; the same one
        again is a no-op)."""
        with self._gate.writing():
            if shard_map.version < self._shard_map.version or (
                    shard_map.version == self._shard_map.version and shard_map != self._shard_map):
                raise InvalidRequestError(f"shard map version {shard_map.version} is older than or differs from this "
                                          f"shard's version {self._shard_map.version}")
            self._check_not_given_up(shard_map)
            self._set_map(shard_map, addresses or (self.map_addresses if shard_map == self._shard_map else ()))

    def forget_given_up(self) -> None:
        """Lets a move this shard rolled back from be run again (a new coordinator starts, the old one is gone)."""
        with self._gate.writing():
            if self._given_up_version and self.log is not None:
                self.log.wait(self.log.record_given_up(0))
            self._given_up_version = 0

    def _check_not_given_up(self, to_map: ShardMap) -> None:
        if self._shard_map.version < to_map.version <= self._given_up_version:
            raise InvalidRequestError(f"the move to shard map version {to_map.version} rolled back on this shard (a "
                                      "shard giving slots away gave it up without its coordinator): run the move again")

    def wait_handover(self, timeout_s: float, seen_version: int) -> None:
        """Waits (at most ``timeout_s``) for the handover under way, if any, to finish or be given up, or else for
        this shard's map to be newer than ``seen_version`` (read before the request): what a request refused with
        :class:`SlotsMovingError` waits for before it runs again."""
        outgoing = self._outgoing
        if outgoing is not None:
            outgoing.settled.wait(timeout_s)
            return
        with self._map_changed:
            self._map_changed.wait_for(lambda: self._shard_map.version != seen_version, timeout_s)

    def _handing_over(self) -> OutgoingSlots:
        if self._outgoing is None:
            raise InvalidRequestError("no handover is under way on this shard")
        return self._outgoing

    def _set_map(self, shard_map: ShardMap, addresses: Sequence[str]) -> None:
        """Adopts ``shard_map``, in the log first when there is one (a restart then keeps it); the routing gate
        held for writing. A shard the map leaves without slots (drained) keeps its index: every id moved elsewhere."""
        if self.log is not None:
            self.log.wait(self.log.record_map(shard_map, addresses))
        self.replay_map(shard_map, addresses)

    def _listed_tables(self) -> list[Table]:
        with self._lock:
            return [self._tables[name] for name in sorted(self._tables)]

    def _record(self, changes: list[TableChange]) -> None:
        """Applies changes as a replay does, and logs them: another shard's rows become this one's, durably."""
        with self._gate.reading():
            tickets: list[int] = []
            journal = self._journal("", 0, tickets)
            tables = [self._table(change.name) for change in changes]
            with contextlib.ExitStack() as held:
                for table in sorted(set(tables), key=lambda t: t.config.name):
                    held.enter_context(table.lock)
                for table, change in zip(tables, changes):
                    table.replay_locked(change)
                if journal is not None:
                    journal(list(changes))
            self._wait_logged(tickets)

    def _sweep_foreign_rows(self) -> None:
        """Removes (and logs the removal of) the rows of every table that its map gives other shards; the save lock
        held."""
        self._swept = True  # before the tables' points: rows a take adds after them clear it again
        for table in self._listed_tables():
            self._drop_foreign_rows(table)

    def _drop_foreign_rows(self, table: Table) -> None:
        """Removes (and logs the removal of) the rows of ``table`` its map gives other shards, in memory and on disk:
        finds them by reading every row's id (the memory's, and the disk's ids files) and its slot."""
        shard_map, shard = self._shard_map, self.shard_index
        with table.lock:
            snapshot = table.begin_snapshot(0, disk_map=False, slot_mask=shard_map.table != shard)
        try:
            foreign = [chunk["ids"].clone() for chunk in snapshot.chunks()]
            foreign += [ids[shard_map.shard_of(ids) != shard] for ids in snapshot.disk_ids()]
        finally:
            snapshot.close()
        self._drop_rows(table, torch.cat(foreign) if foreign else torch.empty(0, dtype=torch.int64))

    def _drop_rows(self, table: Table, ids: torch.Tensor) -> None:
        """Removes (and logs the removal of) the rows of ``ids`` (each once) of ``table``, those present."""
        for piece in ids.split(_DROPPED_A_RECORD):  # the table's requests run between the pieces
            self._record([TableChange(table.config.name, 0, removed=piece)])


def _moving(chunks: Iterator[dict[str, torch.Tensor]], outgoing: OutgoingSlots) -> Iterator[dict[str, torch.Tensor]]:
    """The moving slots' rows of a point's disk chunks (the snapshot's ``slot_mask`` filters its memory's rows alone)."""
    for chunk in chunks:
        keep = outgoing.covers(chunk["ids"])
        yield {name: values[keep] for name, values in chunk.items()}


_SIGHTING_SLOTS_A_BLOCK = 1024
"""Slots whose admission counters travel together: 4 MB of them at the default filter's 4,096 a slot."""

_DROPPED_A_RECORD = 1 << 16
"""Rows a handover's drop removes with the table's lock held, in one logged removal: a disk table's drop reads each
row's record to find it (a third of a shard's 1M rows dropped at once held the lock for about a second)."""

_TAKEN_A_RECORD = 1 << 15
"""Rows a taker writes with the table's lock held, in one logged change: a taker writes about 0.55 us a row (its id
indexed, its record written), so a whole page of 200k rows held the lock some 110 ms while the trainers' lookups of
that table waited, three steps of a 37 ms one."""


def _in_pieces(change: TableChange, config: TableConfig) -> list[TableChange]:
    """``change`` as changes that write at most :data:`_TAKEN_A_RECORD` rows each, the table serving between them;
    where the table keeps rows on disk, at most a memory budget (``config.capacity``) too: a taken row lands in
    memory, as a replayed one does, and the rows it displaces are demoted to make room first, so the taker's memory
    stays within its budget; a page of a million rows landing at once would hold them all in memory until the demoter
    caught up. The first piece also removes and admits what ``change`` does."""
    count = change.rows["ids"].numel() if change.rows else 0
    limit = min(_TAKEN_A_RECORD, config.capacity) if config.storage == "disk" else _TAKEN_A_RECORD
    if count <= limit:
        return [change]
    pieces = []
    for start in range(0, count, limit):
        piece = TableChange(change.name, change.step, rows={name: values[start : start + limit]
                                                            for name, values in change.rows.items()})
        if not start:
            piece.removed, piece.admitted, piece.admitted_access = change.removed, change.admitted, change.admitted_access
        pieces.append(piece)
    return pieces
