"""The store's side of moving slots between live shards: a gate for ownership changes, and an outgoing move.

A move of slots from shard S to shard T (``ShardStore.begin_handover`` … ``finish_handover``) is a copy followed by
log shipping, the mechanism a restarted shard's replay already reproduces bit for bit:

1. S takes one consistent point of every table (as a save does) and from then on collects every change its
   operations make to rows of the moving slots (:class:`OutgoingSlots`), the very records its write-ahead log holds;
2. the rows of the moving slots at the point go to T, which writes them (``take_rows``); then the collected changes,
   in order (``take_changes``), as often as the caller likes while S keeps serving;
3. S fences the slots: it answers their ids with "moving, retry" (:class:`SlotsMovingError`); the last changes go
   to T; T, then S, adopt the new map. S drops the rows it handed over; its clients hear the map moved
   (:class:`MapMovedError`) and send those ids to T.

Every ownership change (the point, the fence, the adoption) passes the :class:`RoutingGate` alone, after the requests
in flight: a request checks its ids and applies its change inside the gate, so none straddles one.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Sequence

import torch

from lightning_persia.ops.hashing import slot_of
from lightning_persia.ops.shard_map import SLOTS, ShardMap
from lightning_persia.remote_ps.store.errors import StoreError
from lightning_persia.remote_ps.store.wal.changes import Change, TableChange


class SlotsMovingError(StoreError):
    """Ids of slots this shard is handing over at this moment: the caller retries shortly (the cut-over takes the
    time of the last changes' copy)."""


class MapMovedError(StoreError):
    """Ids this shard's map, newer than the caller's, gives to another shard: the caller fetches the map (``version``)
    and sends them there."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


class RoutingGate:
    """Requests pass it together (:meth:`request`); a change of what the shard owns passes it alone (:meth:`alone`),
    once the requests in flight are done, and the requests that come meanwhile wait for it."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._active = 0
        self._closed = False

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        with self._changed:
            while self._closed:
                self._changed.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._changed:
                self._active -= 1
                if not self._active:
                    self._changed.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        with self._changed:
            while self._closed:
                self._changed.wait()
            self._closed = True
            while self._active:
                self._changed.wait()
        try:
            yield
        finally:
            with self._changed:
                self._closed = False
                self._changed.notify_all()


class OutgoingSlots:
    """Slots this shard hands to others under ``to_map``, and the changes to their rows since the move's point."""

    def __init__(self, shard_index: int, current: ShardMap, to_map: ShardMap) -> None:
        self.to_map = to_map
        moving = [slot for slot, (now, then) in enumerate(zip(current.owners, to_map.owners)) if now == shard_index != then]
        self.slots = tuple(moving)
        self._mask = torch.zeros(SLOTS, dtype=torch.bool)
        self._mask[list(moving)] = True
        self.fenced = False
        self.settled = threading.Event()  # set once the handover finished or was given up
        self._changes: list[Change] = []
        self._lock = threading.Lock()

    def covers(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` are in the moving slots (a bool mask)."""
        return self._mask[slot_of(ids, SLOTS)]

    def collect(self, changes: Sequence[TableChange]) -> None:
        """Keeps the part of one operation's changes that falls in the moving slots (called with the tables' locks
        held, so the collected order is the order of the changes)."""
        kept = [part for part in (self._part(change) for change in changes) if part]
        if kept:
            with self._lock:
                self._changes.append(Change(kept))

    def take_changes(self) -> list[Change]:
        """The changes collected since the last call, oldest first."""
        with self._lock:
            taken, self._changes = self._changes, []
        return taken

    def _part(self, change: TableChange) -> TableChange:
        return part_of(change, self.covers)


def part_of(change: TableChange, keep: Callable[[torch.Tensor], torch.Tensor]) -> TableChange:
    """The part of ``change`` about the ids ``keep`` (a bool mask of ids) selects."""
    part = TableChange(change.name, change.step)
    if change.removed.numel():
        part.removed = change.removed[keep(change.removed)]
    if change.admitted.numel():
        kept = keep(change.admitted)
        part.admitted, part.admitted_access = change.admitted[kept], change.admitted_access[kept]
    if change.rows and change.rows["ids"].numel():
        kept = keep(change.rows["ids"])
        part.rows = {name: values[kept] for name, values in change.rows.items()}
    return part
