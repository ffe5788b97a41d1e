"""Which unseen ids a training lookup admits: a draw of ``admit_probability``, then ``admit_after`` sightings.

:class:`Admission` is a table's part for it, with one entry point (:meth:`Admission.admitted`). The sightings are
counted without a row per id:

A counting filter (a count-min sketch with conservative update): one byte counters, each id hashed to
:data:`_HASHES` of them; an id's count is the least of its counters, so it is never under-counted and over-counted
only where every one of its counters is shared with more frequent ids. ``width`` bytes serve any number of ids. So
that old sightings do not pile up into admissions, every counter is halved each time as many sightings as there are
counters have been added (the count decays with the table's traffic, not with the clock).
"""
from __future__ import annotations

import torch

from lightning_persia.ops.hashing import mix64, name_hash
from lightning_persia.remote_ps.table_config import TableConfig

_HASHES = 2
_SALTS = (0x3C6EF372FE94F82B, 0x1BD11BDAA9FC1A22)  # below 2**63: the salts are int64s
DEFAULT_WIDTH = 1 << 24
"""Counters of a table's filter (16 MB): ~1% of ids over-counted while ~2M distinct ids are being counted at once."""


class CountingFilter:
    """Approximate sighting counts of ids, in ``width`` one-byte counters.

    Example::

        counts = CountingFilter(1 << 20)
        counts.add(torch.tensor([7, 8]))   # tensor([1, 1])
        counts.add(torch.tensor([7]))      # tensor([2])
    """

    def __init__(self, width: int = DEFAULT_WIDTH) -> None:
        if width < 1:
            raise ValueError(f"a counting filter needs at least one counter, got {width}")
        self.width = width
        self._counters = torch.zeros(width, dtype=torch.uint8)
        self._added = 0

    def add(self, ids: torch.Tensor) -> torch.Tensor:
        """Counts one sighting of each of ``ids`` (distinct); returns each one's count so far, this one included."""
        if not ids.numel():
            return torch.zeros(0, dtype=torch.int32)
        cells = [mix64(ids ^ salt).remainder(self.width) for salt in _SALTS[:_HASHES]]
        counts = torch.stack([self._counters[c] for c in cells]).amin(0).to(torch.int32) + 1
        counts.clamp_(max=255)
        for c in cells:  # conservative update: a counter rises only to the count of the id that reads it
            self._counters.scatter_reduce_(0, c, counts.to(torch.uint8), reduce="amax")
        self._added += ids.numel()
        if self._added >= self.width:
            self._counters >>= 1
            self._added = 0
        return counts

    @property
    def nbytes(self) -> int:
        return self.width


class Admission:
    """A table's admission of unseen ids (``config.admit_probability``, ``config.admit_after``), its draws seeded by
    ``seed`` and the table's name (so every shard and every replay draws alike)."""

    def __init__(self, config: TableConfig, seed: int) -> None:
        self._probability = config.admit_probability
        self._after = config.admit_after
        self._draws = torch.Generator().manual_seed((seed ^ name_hash(config.name)) & ((1 << 63) - 1))
        self._sightings = CountingFilter() if config.admit_after > 1 else None

    @property
    def admits_all(self) -> bool:
        """Whether every unseen id is admitted (no draw, no sighting counted): a lookup may admit in one native pass."""
        return self._probability >= 1.0 and self._sightings is None

    def admitted(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` (distinct, unseen) are admitted now (a bool mask); counts a sighting of those drawn."""
        keep = torch.ones(ids.numel(), dtype=torch.bool)
        if self._probability < 1.0:
            keep = torch.rand(ids.numel(), generator=self._draws) < self._probability
        if self._sightings is not None:
            drawn = torch.nonzero(keep).squeeze(1)
            keep[drawn] = self._sightings.add(ids[drawn]) >= self._after
        return keep
