"""The store's side of moving slots between live shards: a gate for ownership changes, and an outgoing move.

A move of slots from shard S to shard T (``ShardStore.begin_handover`` … ``finish_handover``) is a copy followed by
rounds of the rows changed since, in the write-ahead log's record format (which a replay applies bit for bit):

1. S takes one consistent point of every table (as a save does) and from then on notes which rows of the moving
   slots its operations change (:class:`OutgoingSlots`: it hears what its write-ahead log hears);
2. the rows of the moving slots at the point go to T, which writes them (``take_changes``); then, in rounds while S
   keeps serving, each row changed since the last round as it is now (or its removal);
3. S fences the slots: requests for their ids wait, and hear "moving, retry" (:class:`SlotsMovingError`) after a
   while; the last round goes to T; T, then S, adopt the new map. S drops the rows it handed over (the ids it
   remembers sending, :meth:`OutgoingSlots.handed_ids`); its clients hear the map moved (:class:`MapMovedError`) and
   send those ids to T.

Every ownership change (the point, the fence, the adoption) holds the store's routing gate (a
:class:`~lightning_persia.read_write_lock.ReadWriteLock`) for writing, after the requests in flight: a request checks its
ids and applies its change holding it for reading, so none straddles one.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

import torch

from lightning_persia.ops.hashing import slot_of
from lightning_persia.ops.shard_map import SLOTS, ShardMap
from lightning_persia.remote_ps.store.errors import StoreError
from lightning_persia.remote_ps.store.wal.changes import TableChange

if TYPE_CHECKING:
    from lightning_persia.remote_ps.store.table_snapshot import TableSnapshot


class SlotsMovingError(StoreError):
    """Ids of slots this shard is handing over at this moment: the caller retries shortly (the cut-over takes the
    time of the last changes' copy)."""


class MapMovedError(StoreError):
    """Ids this shard's map, newer than the caller's, gives to another shard: the caller fetches the map (``version``)
    and sends them there."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


class OutgoingSlots:
    """Slots this shard hands to others under ``to_map``, and which of their rows changed since the move's point.

    A round ships each changed row once, as it is when the round is taken (``ShardStore.handover_changes``), not every
    change: a trainer rewrites its hot rows many times a round, and rounds must shrink for the fence to be short.
    """

    def __init__(self, shard_index: int, current: ShardMap, to_map: ShardMap, addresses: Sequence[str] = ()) -> None:
        self.from_map = current
        self.to_map = to_map
        self.addresses = tuple(addresses)  # of to_map's shards, where the coordinator said: whom to ask without it
        moving = [slot for slot, (now, then) in enumerate(zip(current.owners, to_map.owners)) if now == shard_index != then]
        self.slots = tuple(moving)
        self._mask = torch.zeros(SLOTS, dtype=torch.bool)
        self._mask[list(moving)] = True
        self.fenced = False
        self.replayed = False  # read back from the log by a restarted shard: which rows changed since the last round is lost
        self.settled = threading.Event()  # set once the handover finished or was given up
        self._dirty: dict[str, list[torch.Tensor]] = {}  # table -> ids changed since the last round was taken
        self._handed: dict[str, list[torch.Tensor]] = {}  # table -> ids of the rows handed over (the point's, the rounds')
        self._handed_all = False  # every row of the point was read (and noted in _handed)
        self._lock = threading.Lock()
        self._snapshots: list["TableSnapshot"] = []  # the tables at the move's point, until its rows are read or it ends

    @property
    def takers(self) -> list[int]:
        """The shards the whole move (not only this shard's part) gives slots to, in the order they adopt its map:
        the first one's adoption is the move's point of no return (``docs/elastic.md``)."""
        return sorted({now for _, now in self.from_map.moves(self.to_map).values()})

    @property
    def sources(self) -> list[int]:
        """The shards the whole move takes slots from."""
        return sorted({was for was, _ in self.from_map.moves(self.to_map).values()})

    def fence_record(self) -> dict:
        """What the write-ahead log's FENCE record keeps of the move: enough to settle it after a restart."""
        return {"to_map": self.to_map.to_dict(), "addresses": list(self.addresses)}

    def hold(self, snapshots: Sequence["TableSnapshot"]) -> None:
        """Keeps the tables' snapshots at the move's point (taken with ``slot_mask=``:attr:`slot_mask`) until :meth:`release`."""
        with self._lock:
            self._snapshots = list(snapshots)

    def release(self) -> None:
        """Ends the move's snapshots, once (their rows were read, or the move finished or was given up)."""
        with self._lock:
            snapshots, self._snapshots = self._snapshots, []
        for snapshot in snapshots:
            snapshot.close()

    @property
    def slot_mask(self) -> torch.Tensor:
        """The moving slots (bool, one per routing slot)."""
        return self._mask

    def covers(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` are in the moving slots (a bool mask)."""
        return self._mask[slot_of(ids, SLOTS)]

    def collect(self, changes: Sequence[TableChange]) -> None:
        """Notes the rows of the moving slots that one operation changed (called with the tables' locks held)."""
        for change in changes:
            part = part_of(change, self.covers)
            touched = [ids for ids in (part.removed, part.admitted, part.rows["ids"] if part.rows else None)
                       if ids is not None and ids.numel()]
            if touched:
                with self._lock:
                    self._dirty.setdefault(change.name, []).extend(touched)

    def take_changed(self) -> dict[str, torch.Tensor]:
        """Per table, the ids of the moving slots changed since the last call (each once)."""
        with self._lock:
            taken, self._dirty = self._dirty, {}
        return {name: torch.cat(ids).unique() for name, ids in taken.items()}

    def note_handed(self, name: str, ids: torch.Tensor) -> None:
        """``ids`` of table ``name`` were handed over (rows of the point, or of a round)."""
        if ids.numel():
            with self._lock:
                self._handed.setdefault(name, []).append(ids)

    def point_read(self) -> None:
        """Every row of the move's point was handed over (:meth:`note_handed`)."""
        self._handed_all = True

    def handed_ids(self) -> Optional[dict[str, torch.Tensor]]:
        """Per table, the ids (each once, sorted) of every row of the moving slots this shard may hold: those of the
        point and of the rounds handed over, and those changed since the last round (a move settled without its
        coordinator may not have taken it). Once fenced, no request adds to them, so dropping these drops every row
        the move gave away, without reading the tables' ids again. None when not known: the point's rows were not all
        read, or the move was read back from the log after a restart (the rows are then found by their slots)."""
        if not self._handed_all or self.replayed:
            return None
        with self._lock:
            lists = {name: list(ids) for name, ids in self._handed.items()}
            for name, ids in self._dirty.items():
                lists.setdefault(name, []).extend(ids)
        return {name: torch.cat(ids).unique() for name, ids in lists.items()}


@dataclass
class MoveTally:
    """What this shard's moves carried since it started, for its metrics: rows and bytes handed to other shards
    (``out``) and taken from them (``into``), and how its moves as a source ended. A row shipped again in a later
    round counts again: the figures are what crossed the wire, which is what a move costs."""

    rows_out: int = 0
    bytes_out: int = 0
    rows_into: int = 0
    bytes_into: int = 0
    finished: int = 0
    given_up: int = 0

    def handed(self, rows: Mapping[str, torch.Tensor]) -> None:
        """One block of ``{field: values}`` given to another shard."""
        self.rows_out += _count(rows)
        self.bytes_out += _bytes(rows)

    def taken(self, rows: Mapping[str, torch.Tensor]) -> None:
        """One block of ``{field: values}`` taken from another shard."""
        self.rows_into += _count(rows)
        self.bytes_into += _bytes(rows)


def _count(rows: Mapping[str, torch.Tensor]) -> int:
    return int(rows["ids"].numel()) if rows else 0


def _bytes(rows: Mapping[str, torch.Tensor]) -> int:
    return sum(values.numel() * values.element_size() for values in rows.values())


def part_of(change: TableChange, keep: Callable[[torch.Tensor], torch.Tensor], *, copy: bool = True) -> TableChange:
    """The part of ``change`` about the ids ``keep`` (a bool mask of ids) selects. ``copy=False``: where every id is
    kept, the part shares ``change``'s tensors (a move's page is all one taker's in a grow: a 16 MB page is not
    copied twice on its way)."""
    part = TableChange(change.name, change.step)
    if change.removed.numel():
        part.removed = _kept(change.removed, keep(change.removed), copy)
    if change.admitted.numel():
        kept = keep(change.admitted)
        part.admitted, part.admitted_access = _kept(change.admitted, kept, copy), _kept(change.admitted_access, kept, copy)
    if change.rows and change.rows["ids"].numel():
        kept = keep(change.rows["ids"])
        part.rows = {name: _kept(values, kept, copy) for name, values in change.rows.items()}
    return part


def _kept(values: torch.Tensor, kept: torch.Tensor, copy: bool) -> torch.Tensor:
    return values if not copy and bool(kept.all()) else values[kept]
