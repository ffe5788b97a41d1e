"""Id -> row index of one table. The keys live in the table's rows (their ``ids`` field); the index holds row numbers.

:func:`make_index` picks the native index when the kernels are loaded (``store/native/id_index.c``: buckets of
12 tagged slots in one cache line, 4,096 partitions grown one at a time, at most ~131k rows (and one partition)
rehashed per insert, so a growing table never waits for a whole-index rebuild, and a lookup costs about one cache
miss in the index), else :class:`TensorIdIndex`, a vectorised open-addressing table in tensor ops (same answers,
slower, and it rebuilds whole when it grows).
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from lightning_persia.ops.hashing import slot_hash
from lightning_persia.remote_ps.store import native
from lightning_persia.remote_ps.store.chunked_rows import ChunkedField, ChunkedRows
from lightning_persia.remote_ps.store.native import jobs
from lightning_persia.remote_ps.store.native.id_index import Index, IndexInfo

EMPTY = -1
TOMBSTONE = -2
_MAX_LOAD = 0.5
_MIN_SLOTS = 1 << 10
_WIDE_BELOW = 2048  # unresolved ids below which a probe pass reads a window of slots per id
_WIDE_WINDOW = 8
_MAX_TOMBSTONES = 0.25


class IdIndex(Protocol):
    """What a table needs of its index, over the table's rows whose ``ids`` field holds every indexed id."""

    def find(self, ids: torch.Tensor, copy: Optional[tuple[ChunkedField, torch.Tensor]] = None,
             touch: Optional[tuple[ChunkedField, int, bool]] = None) -> torch.Tensor:
        """Row of each id, or -1 when absent.

        ``copy=(field, out)`` also copies the field's row of every id found into ``out``; ``touch=(field, value,
        add)`` sets (or, with ``add``, increments) an int32 field of every row found: a lookup in one call.
        """

    def insert(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Adds ``ids`` (unique, absent, already written to ``keys`` at ``rows``) pointing at ``rows``."""

    def remove(self, ids: torch.Tensor) -> None:
        """Drops the ``ids`` present."""

    def reserve(self, rows: int) -> None:
        """Makes room for ``rows`` ids in all (a bulk insert of known size then grows nothing on the way)."""

    @property
    def inserted(self) -> int:
        """Ids inserted so far: while it stays the same, no absent id became present."""

    @property
    def nbytes(self) -> int:
        """Memory the index holds."""


def make_index(rows: ChunkedRows) -> IdIndex:
    """The fastest index available here, over ``rows`` (its ``ids`` field is the first of each record)."""
    return NativeIdIndex(rows) if native.available() else TensorIdIndex(rows["ids"])


class NativeIdIndex:
    """:class:`IdIndex` in C (see the module docstring)."""

    def __init__(self, rows: ChunkedRows) -> None:
        if rows["ids"].offset != 0:
            raise ValueError("the native index reads a row's id from the start of its record")
        self._rows = rows
        self._index = Index()

    def info(self) -> IndexInfo:
        """The native index's figures now (its partition rebuilds among them)."""
        return self._index.info()

    @property
    def nbytes(self) -> int:
        return self._index.info().nbytes

    @property
    def inserted(self) -> int:
        return self._index.info().inserted

    def find(self, ids: torch.Tensor, copy: Optional[tuple[ChunkedField, torch.Tensor]] = None,
             touch: Optional[tuple[ChunkedField, int, bool]] = None) -> torch.Tensor:
        return self._index.find(ids, self._rows.layout,
                                copy=(copy[0].offset, copy[1]) if copy is not None else None,
                                touch=(touch[0].offset, touch[1], touch[2]) if touch is not None else None)

    def find_job(self, ids: torch.Tensor, rows: torch.Tensor, copy: tuple[ChunkedField, torch.Tensor],
                 touch: Optional[tuple[ChunkedField, int, bool]] = None) -> jobs.FindJob:
        """:meth:`find` as one job of a :func:`~.native.jobs.find_many` call, into ``rows``."""
        return self._index.find_job(ids, rows, self._rows.layout, (copy[0].offset, copy[1]),
                                    (touch[0].offset, touch[1], touch[2]) if touch is not None else None)

    def update_job(self, ids: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, rule: str, weights: ChunkedField,
                   state_offset: int, version: tuple[ChunkedField, int], lr: float, eps: float, weight_decay: float,
                   bound: Optional[float]) -> jobs.UpdateJob:
        """A native sparse update of the rows of ``ids`` (see :func:`~.native.jobs.update_many`)."""
        return self._index.update_job(ids, rows, grads, self._rows.layout, rule, (weights.offset, weights.spec.dtype),
                                      state_offset, (version[0].offset, version[1]), lr, eps, weight_decay, bound)

    def admit_job(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, fresh: torch.Tensor, fields: jobs.AdmitFields,
                  init_key: int, uniform: tuple[float, float]) -> jobs.AdmitJob:
        return self._index.admit_job(ids, rows, out, self._rows.layout, fresh, fields, init_key, uniform)

    def insert(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self._index.insert(ids, rows, self._rows.layout)

    def remove(self, ids: torch.Tensor) -> None:
        self._index.remove(ids, self._rows.layout)

    def reserve(self, rows: int) -> None:
        self._index.reserve(rows, self._rows.layout)


class TensorIdIndex:
    """:class:`IdIndex` as whole-batch tensor operations, for machines without the native kernels.

    Slots hold int32 row numbers (4 bytes a slot, load 0.25..0.5); probing is linear, each pass resolving every
    id whose slot matches or is empty. Deleted slots become tombstones that lookups walk past and inserts reuse;
    past a quarter of the slots they are dropped by a rebuild.
    """

    def __init__(self, keys: ChunkedField) -> None:
        self._keys = keys
        self._slots = torch.full((_MIN_SLOTS,), EMPTY, dtype=torch.int32)
        self._used = 0  # live entries + tombstones: what lengthens probe chains
        self._tombstones = 0
        self.inserted = 0

    @property
    def nbytes(self) -> int:
        return self._slots.numel() * self._slots.element_size()

    def find(self, ids: torch.Tensor, copy: Optional[tuple[ChunkedField, torch.Tensor]] = None,
             touch: Optional[tuple[ChunkedField, int, bool]] = None) -> torch.Tensor:
        rows, _ = self._probe(ids)
        if copy is not None:
            copy[0].gather(rows, copy[1])
        if touch is not None:
            touch[0].fill(rows, touch[1], touch[2])
        return rows

    def insert(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.inserted += ids.numel()
        live = self._used + ids.numel()
        if live > _MAX_LOAD * self._slots.numel():
            self._rebuild(live - self._tombstones)
        self._place(ids, rows.to(torch.int32))

    def reserve(self, rows: int) -> None:
        if rows > _MAX_LOAD * self._slots.numel():
            self._rebuild(rows)

    def remove(self, ids: torch.Tensor) -> None:
        rows, positions = self._probe(ids)
        gone = positions[rows >= 0]
        self._slots[gone] = TOMBSTONE
        self._tombstones += gone.numel()
        if self._tombstones > _MAX_TOMBSTONES * self._slots.numel():
            self._rebuild(self._used - self._tombstones)

    def _rebuild(self, live: int) -> None:
        current = self._slots[self._slots >= 0]
        self._slots = torch.full((_slots_for(live),), EMPTY, dtype=torch.int32)
        self._used = self._tombstones = 0
        self._place(self._key_of(current.to(torch.int64)), current)

    def _key_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The key in each slot's row (0 for an empty slot or a tombstone: only compared where the slot holds a row)."""
        return self._keys.gather(slots, torch.zeros(slots.shape, dtype=torch.int64))

    def _probe(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and slot of each id (row -1 when absent; its slot is then meaningless).

        A pass costs a dozen tensor ops whatever the number of ids, and the number of passes is the longest
        probe chain among the ids. So while many ids are unresolved each pass looks at one slot per id; once
        few are left (the long chains of linear probing), a pass looks at the next ``_WIDE_WINDOW`` slots of
        each at once.
        """
        mask = self._slots.numel() - 1
        pos = slot_hash(ids) & mask
        rows = torch.full_like(ids, EMPTY)
        positions = pos.clone()
        active = None  # positions in ``ids`` of the unresolved ids; None: all of them
        want, start = ids, pos
        while want.numel():
            width = 1 if want.numel() > _WIDE_BELOW else _WIDE_WINDOW
            if width == 1:
                cand = start
                slot = self._slots[cand].to(torch.int64)
                matched = (slot >= 0) & (self._key_of(slot) == want)
                stopped = matched | (slot == EMPTY)
            else:
                cand = (start.unsqueeze(1) + torch.arange(width)) & mask
                slots = self._slots[cand].to(torch.int64)
                keys = self._key_of(slots.reshape(-1)).view(slots.shape)
                match = (slots >= 0) & (keys == want.unsqueeze(1))
                stop = match | (slots == EMPTY)
                first = stop.to(torch.int8).argmax(1, keepdim=True)  # the first slot that ends the chain
                stopped = stop.gather(1, first).squeeze(1)
                matched = match.gather(1, first).squeeze(1) & stopped
                slot, cand = slots.gather(1, first).squeeze(1), cand.gather(1, first).squeeze(1)
            hit = matched if active is None else active[matched]
            rows[hit] = slot[matched]
            positions[hit] = cand[matched]
            keep = ~stopped
            active = torch.nonzero(keep).squeeze(1) if active is None else active[keep]
            want, start = want[keep], (start[keep] + width) & mask
        return rows, positions

    def _place(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self._used += ids.numel()
        mask = self._slots.numel() - 1
        pos = slot_hash(ids) & mask
        while rows.numel():
            previous = self._slots[pos]
            free = previous < 0
            # Several ids may race for one free slot; exactly one write lands and the others probe on.
            self._slots[pos[free]] = rows[free]
            won = free.clone()
            won[free] = self._slots[pos[free]] == rows[free]
            reused = int((previous[won] == TOMBSTONE).sum())
            self._used -= reused
            self._tombstones -= reused
            keep = ~won
            rows, pos = rows[keep], (pos[keep] + 1) & mask


def _slots_for(rows: int) -> int:
    needed = max(_MIN_SLOTS, int(rows / _MAX_LOAD) + 1)
    return 1 << (needed - 1).bit_length()
