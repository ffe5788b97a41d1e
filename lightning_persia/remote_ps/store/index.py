"""Id -> row index of one table: a vectorised open-addressing hash table.

Slots hold int32 row numbers; the keys themselves live in the row-aligned ``ids`` array of the table, so
an index costs 4 bytes per slot (8 to 16 bytes per row at load factor 0.25..0.5) instead of the 16 of a
(key, value) slot. Probing is linear and runs as whole-batch tensor operations: each pass resolves
every id whose slot matches or is empty, and the rest step to the next slot. Deleted slots become
tombstones that lookups walk past and inserts reuse.
"""
from __future__ import annotations

import torch

from lightning_persia.ops.hashing import slot_hash

EMPTY = -1
TOMBSTONE = -2
_MAX_LOAD = 0.5
_MIN_SLOTS = 1 << 10


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
        mask = self._slots.numel() - 1
        pos = slot_hash(ids) & mask
        rows = torch.full_like(ids, EMPTY)
        positions = pos.clone()
        active = torch.arange(ids.numel())
        want = ids
        while active.numel():
            slot = self._slots[pos].to(torch.int64)
            match = (slot >= 0) & (keys[slot.clamp(min=0)] == want)
            done = match | (slot == EMPTY)
            hit = active[match]
            rows[hit] = slot[match]
            positions[hit] = pos[match]
            keep = ~done
            active, pos, want = active[keep], (pos[keep] + 1) & mask, want[keep]
        return rows, positions

    def _place(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        mask = self._slots.numel() - 1
        pos = slot_hash(ids) & mask
        self._used += ids.numel()
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
