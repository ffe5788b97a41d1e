"""Id -> row index of one table: a vectorised open-addressing hash table.

Slots hold int32 row numbers; the keys themselves live in the row-aligned ``ids`` array of the table, so
an index costs 4 bytes per slot (8 to 16 bytes per row at load factor 0.25..0.5) instead of the 16 of a
(key, value) slot. Probing is linear and runs as whole-batch tensor operations: each pass resolves
every id whose slot matches or is empty, and the rest step to the next slot. Deleted slots become
tombstones that lookups walk past and inserts reuse.

With the native kernels (:mod:`lightning_persia.ops.native`) a probe or a placement is one C loop over
the ids, in the same slots; the tensor version below is what runs without a C compiler.
"""
from __future__ import annotations

import torch

from lightning_persia.ops import native
from lightning_persia.ops.hashing import slot_hash

EMPTY = -1
TOMBSTONE = -2
_MAX_LOAD = 0.5
_MIN_SLOTS = 1 << 10
_WIDE_BELOW = 2048  # unresolved ids below which a probe pass reads a window of slots per id
_WIDE_WINDOW = 8


class IdIndex:
    """Maps int64 ids to int32 row numbers of a table whose ids are kept in ``keys`` (row-aligned)."""

    def __init__(self, expected_rows: int = 0) -> None:
        self._slots = torch.full((_slots_for(expected_rows),), EMPTY, dtype=torch.int32)
        self._used = 0  # live entries + tombstones: what lengthens probe chains

    @property
    def nbytes(self) -> int:
        return self._slots.numel() * self._slots.element_size()

    def find(self, ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Row of each id, or -1 when absent."""
        rows, _ = self._probe(ids, keys)
        return rows

    def insert(self, ids: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> None:
        """Adds ``ids`` (unique, absent, already written to ``keys[rows]``) pointing at ``rows``."""
        live = self._used + ids.numel()
        if live > _MAX_LOAD * self._slots.numel():
            self._rebuild(live, keys, extra=(ids, rows))
            return
        self._place(ids, rows.to(torch.int32))

    def remove(self, ids: torch.Tensor, keys: torch.Tensor) -> None:
        """Turns the slots of present ``ids`` into tombstones."""
        rows, positions = self._probe(ids, keys)
        self._slots[positions[rows >= 0]] = TOMBSTONE

    def rebuild(self, rows: torch.Tensor, keys: torch.Tensor) -> None:
        """Re-creates the index from scratch for ``rows`` (drops tombstones)."""
        self._slots = torch.full((_slots_for(rows.numel()),), EMPTY, dtype=torch.int32)
        self._used = 0
        self._place(keys[rows], rows.to(torch.int32))

    def tombstone_ratio(self) -> float:
        return float((self._slots == TOMBSTONE).sum()) / self._slots.numel()

    def _rebuild(self, live: int, keys: torch.Tensor, extra: tuple[torch.Tensor, torch.Tensor]) -> None:
        current = self._slots[self._slots >= 0]
        self._slots = torch.full((_slots_for(live),), EMPTY, dtype=torch.int32)
        self._used = 0
        self._place(keys[current.to(torch.int64)], current)
        self._place(extra[0], extra[1].to(torch.int32))

    def _probe(self, ids: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and slot of each id (row -1 when absent; its slot is then meaningless).

        A pass costs a dozen tensor ops whatever the number of ids, and the number of passes is the longest
        probe chain among the ids. So while many ids are unresolved each pass looks at one slot per id; once
        few are left (the long chains of linear probing), a pass looks at the next ``_WIDE_WINDOW`` slots of
        each at once. Finding the few hundred ids per table of a training step (a 4096-row batch over 26
        tables and 2 shards) then takes 1-2 passes instead of the 10-20 of one slot per pass.
        """
        if native.available():
            return native.index_find(self._slots, keys, ids)
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
                matched = (slot >= 0) & (keys[slot.clamp(min=0)] == want)
                stopped = matched | (slot == EMPTY)
            else:
                cand = (start.unsqueeze(1) + torch.arange(width)) & mask
                slots = self._slots[cand].to(torch.int64)
                match = (slots >= 0) & (keys[slots.clamp(min=0)] == want.unsqueeze(1))
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
        if native.available():
            self._used -= native.index_place(self._slots, ids, rows)
            return
        mask = self._slots.numel() - 1
        pos = slot_hash(ids) & mask
        while rows.numel():
            previous = self._slots[pos]
            free = previous < 0
            # Several ids may race for one free slot; exactly one write lands and the others probe on.
            self._slots[pos[free]] = rows[free]
            won = free.clone()
            won[free] = self._slots[pos[free]] == rows[free]
            self._used -= int((previous[won] == TOMBSTONE).sum())
            keep = ~won
            rows, pos = rows[keep], (pos[keep] + 1) & mask


def _slots_for(rows: int) -> int:
    needed = max(_MIN_SLOTS, int(rows / _MAX_LOAD) + 1)
    return 1 << (needed - 1).bit_length()
