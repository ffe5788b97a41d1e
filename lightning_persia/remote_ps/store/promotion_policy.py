"""Which rows a training lookup read from disk come back into memory: those read again soon enough to earn a place.

Under LRU, a disk table brought every row it read from disk back into memory (a *promotion*), and the demoter then
moved the coldest row of memory out to make room. On a Zipf(1.1) stream at 100M rows, 40M of them in memory, that
was ~3.6k promotions a request, each with the demotion it caused and the compaction of the garbage both left: most
of the demoter's CPU (``benchmarks/results/2026-11-25-disk-tier.md``, sections 20 and 22). Many of those rows are
read once in a long while; each displaced a row that would have been read sooner.

So a row read from disk is promoted only when it was last touched within :data:`HORIZONS` *horizons*: the horizon
is how long memory keeps a row untouched, the steps since the access value below which the demoter last found the
coldest rows (:meth:`PromotionPolicy.demoting_at`). "Last touched" is the later of the access value in its record
(when it was last in memory) and its last read from disk that left it there (:class:`RecentReads`). A row read
once after a long time stays on disk, and its next read, if soon, promotes it. Until the demoter has demoted
(a table that fits in memory, or grew without a sample of its rows), every row read is promoted, as LRU does.

A scaled simulation of the benchmark's stream (10M rows, 3.75M in memory) gave, after 24,000 requests, 441 misses a
request against LRU's 514 and 167 promotions against 514; over the first ~5,000 requests, LRU's figures (section 22).
"""
from __future__ import annotations

from typing import Optional

import torch

from lightning_persia.ops import native
from lightning_persia.ops.hashing import mix64

HORIZONS = 1.5
"""A row read from disk is promoted when last touched within this many of memory's horizons. At 1, the rows grown
first (on disk, the stream's hottest in the benchmark) came back too slowly after growth; at 2 and 3, fewer
promotions were saved (the simulation of section 22)."""
_SALTS = (0x2545F4914F6CDD1D, 0x5851F42D4C957F2D)  # below 2**63: int64 salts; apart from shard_of's hash
_BITS_SHIFT = 40  # native.set_bits' page shift: every cell of a generation lies in its one page


class RecentReads:
    """Ids read from disk and left there within a window of steps: two generations of ``bits`` bits each (a Bloom
    filter of two hashes), the older cleared once the newer has spanned half the window. An id may be reported
    seen that was not (another id's bits: ~4% at 15M ids a generation in 2**27 bits); never the other way."""

    def __init__(self, bits: int) -> None:
        if bits < 8 or bits & (bits - 1):
            raise ValueError(f"RecentReads needs a power of two of at least 8 bits, got {bits}")
        self._mask = bits - 1
        self._generations = [torch.zeros(bits >> 3, dtype=torch.uint8) for _ in range(2)]
        self._started = 0  # the step the newer generation began at

    def seen(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each of ``ids`` was added within the window (a bool per id)."""
        found = torch.zeros(ids.numel(), dtype=torch.bool)
        cells = self._cells(ids)
        for bits in self._generations:
            every = torch.ones_like(found)
            for cell in cells:
                every &= ((bits[cell >> 3] >> (cell & 7).to(torch.uint8)) & 1).bool()
            found |= every
        return found

    def add(self, ids: torch.Tensor, step: int, window: int) -> None:
        """Counts ``ids`` read at ``step``; first begins a new generation if the newer one spans half of ``window``."""
        if step - self._started >= window // 2:
            older = self._generations.pop(0)
            older.zero_()
            self._generations.append(older)
            self._started = step
        if ids.numel():
            page = torch.tensor([self._generations[-1].data_ptr()], dtype=torch.int64)
            for cell in self._cells(ids):
                native.set_bits(page, _BITS_SHIFT, cell, True)

    def _cells(self, ids: torch.Tensor) -> list[torch.Tensor]:
        return [mix64(ids ^ salt) & self._mask for salt in _SALTS]

    @property
    def nbytes(self) -> int:
        return sum(bits.numel() for bits in self._generations)


class PromotionPolicy:
    """The promotions of one LRU disk table of ``capacity`` rows in memory (see the module's doc)."""

    def __init__(self, capacity: int) -> None:
        bits = 1 << max(16, min(27, (2 * capacity - 1).bit_length()))  # two generations of ~2 bits a memory row: 32 MB at most
        self._recent = RecentReads(bits)
        self._cold_access: Optional[int] = None

    def demoting_at(self, access: int) -> None:
        """The demoter found the coldest rows of memory at or below the access value ``access``."""
        self._cold_access = access

    def promotes(self, ids: torch.Tensor, access: torch.Tensor, step: int) -> torch.Tensor:
        """Which of ``ids`` (distinct, read from disk at lookup ``step``; ``access``: their records' access values)
        to promote (a bool per id); the others are remembered as read now."""
        if self._cold_access is None:
            return torch.ones(ids.numel(), dtype=torch.bool)
        window = max(int(HORIZONS * (step - self._cold_access)), 1)
        promoted = (step - access.to(torch.int64)) <= window
        left = torch.nonzero(~promoted).squeeze(1)
        promoted[left] = self._recent.seen(ids[left])
        self._recent.add(ids[~promoted], step, window)
        return promoted

    @property
    def nbytes(self) -> int:
        return self._recent.nbytes
