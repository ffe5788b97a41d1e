"""What a lookup does with the ids that neither its table's memory nor its disk holds: a training lookup admits them
(a draw of ``admit_probability``, then ``admit_after`` sightings), an evaluation one reads their initial rows.

:class:`Admission` is a table's part for it, with one entry point (:meth:`Admission.fill_missing`), which the table calls
once per lookup. Which of two it is, :func:`make_admission` chooses once per table, like the id index: a
:class:`DrawnAdmission` (tensor ops, for any table: its draws and sightings, its first rows from ``initializers.py``)
or, where every unseen id is admitted with a Uniform first row and the index is native, a :class:`OnePassAdmission`
(one native pass draws the rows, indexes them and fills the lookup's output), which leaves the lookups that pass
cannot serve to a DrawnAdmission of its own. Either decides and returns what to admit (:class:`Admitted`); the table
makes room through its memory limit and writes the rows.

The sightings are counted without a row per id:

A counting filter (a count-min sketch with conservative update): one byte counters, each id hashed to
:data:`_HASHES` of them; an id's count is the least of its counters, so it is never under-counted and over-counted
only where every one of its counters is shared with more frequent ids. ``width`` bytes serve any number of ids. So
that old sightings do not pile up into admissions, every counter is halved each time as many sightings as there are
counters have been added (the count decays with the table's traffic, not with the clock).

The counters are split by routing slot (``ops/shard_map.py``): an id's counters lie in its slot's ``width / SLOTS``
of them. The slots a shard hands over take their counters along (:meth:`CountingFilter.counters`, merged on the new
owner by :meth:`CountingFilter.merge`), so an id's sightings move with its rows, and no other id's count changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from lightning_persia.ops.hashing import mix64, name_hash, slot_of
from lightning_persia.ops.shard_map import SLOTS
from lightning_persia.remote_ps.store.initializers import initial_rows, table_key
from lightning_persia.remote_ps.store.optimizers import SparseRule
from lightning_persia.remote_ps.table_config import TableConfig, Uniform

_HASHES = 2
_SALTS = (0x3C6EF372FE94F82B, 0x1BD11BDAA9FC1A22)  # below 2**63: the salts are int64s
DEFAULT_WIDTH = 1 << 24
"""Counters of a table's filter (16 MB, 4,096 a slot): ~1% of ids over-counted while ~2M distinct ids are being counted
at once."""


class CountingFilter:
    """Approximate sighting counts of ids, in ``width`` one-byte counters (a multiple of :data:`SLOTS`).

    Example::

        counts = CountingFilter(1 << 20)
        counts.add(torch.tensor([7, 8]))   # tensor([1, 1])
        counts.add(torch.tensor([7]))      # tensor([2])
    """

    def __init__(self, width: int = DEFAULT_WIDTH) -> None:
        if width < SLOTS or width % SLOTS:
            raise ValueError(f"a counting filter's width must be a positive multiple of the {SLOTS} routing slots "
                             f"(its counters are split by slot), got {width}")
        self.width = width
        self._per_slot = width // SLOTS
        self._counters = torch.zeros(width, dtype=torch.uint8)
        self._added = 0

    def add(self, ids: torch.Tensor) -> torch.Tensor:
        """Counts one sighting of each of ``ids`` (distinct); returns each one's count so far, this one included."""
        if not ids.numel():
            return torch.zeros(0, dtype=torch.int32)
        first = slot_of(ids, SLOTS) * self._per_slot
        cells = [first + mix64(ids ^ salt).remainder(self._per_slot) for salt in _SALTS[:_HASHES]]
        counts = torch.stack([self._counters[c] for c in cells]).amin(0).to(torch.int32) + 1
        counts.clamp_(max=255)
        for c in cells:  # conservative update: a counter rises only to the count of the id that reads it
            self._counters.scatter_reduce_(0, c, counts.to(torch.uint8), reduce="amax")
        self._added += ids.numel()
        if self._added >= self.width:
            self._counters >>= 1
            self._added = 0
        return counts

    def counters(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the counters of ``slots`` (``slots`` int64; uint8 ``[len(slots), width / SLOTS]``): every id of
        those slots reads only these."""
        return self._counters.view(SLOTS, self._per_slot)[slots]

    def merge(self, slots: torch.Tensor, counters: torch.Tensor) -> None:
        """Takes the sightings another shard's filter counted for the ids of ``slots`` (its :meth:`counters` of them):
        each counter becomes the larger of the two. An id of those slots then counts at least the sightings the other
        filter gave it (at least its own, where this shard saw none of its slot's ids: one that takes the slots over);
        it is over-counted no more than a plain count-min sketch of both shards' sightings would over-count it, and
        the other slots' ids not at all. The halving clock stays this filter's."""
        if counters.dtype != torch.uint8 or counters.shape != (slots.numel(), self._per_slot):
            raise ValueError(f"the counters of {slots.numel()} slots are uint8 [{slots.numel()}, {self._per_slot}], "
                             f"got {counters.dtype} {list(counters.shape)}")
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= SLOTS):
            raise ValueError(f"slots are in 0..{SLOTS - 1}, got {int(slots.min())}..{int(slots.max())}")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("the counters of a slot are merged once: the slots repeat")
        regions = self._counters.view(SLOTS, self._per_slot)
        regions[slots] = torch.maximum(regions[slots], counters)

    @property
    def nbytes(self) -> int:
        return self.width


@dataclass(frozen=True)
class FirstRows:
    """What the native pass draws an admitted id's first record from: the table's generator key
    (:func:`~.initializers.table_key`), the Uniform bounds, and one record's initial optimizer state (float32)."""

    key: int
    uniform: tuple[float, float]
    state: torch.Tensor


@dataclass(frozen=True)
class Admitted:
    """What a training lookup admits, as its table's admission decided it; the table makes room for ``count`` rows
    and writes them. Where ``first`` is set, the ids absent from the lookup (-1 in its rows) in one native pass, their
    first records drawn from it (:meth:`~.memory_rows.MemoryRows.admit_in_one_pass`); else ``ids`` (unique), their
    first weights ``initial`` in the storage dtype (:meth:`~.memory_rows.MemoryRows.write_admitted`)."""

    count: int
    first: Optional[FirstRows] = None
    ids: Optional[torch.Tensor] = None
    initial: Optional[torch.Tensor] = None


class NewRows(Protocol):
    """What admission asks of its table's memory (:class:`~.memory_rows.MemoryRows` is one); the lock held."""

    rule: SparseRule

    @property
    def indexed_natively(self) -> bool: ...

    @property
    def saving(self) -> bool: ...

    @property
    def memory_rows(self) -> int: ...


class Admission(Protocol):
    """A table's admission of unseen ids (``config.admit_probability``, ``config.admit_after``), made by
    :func:`make_admission`."""

    def fill_missing(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, missing: int) -> Optional[Admitted]:
        """The rows of ``out`` that neither the memory nor the disk held (``missing`` of them: -1 in ``rows``; -2: read
        from disk and left there, already in ``out``): what a training lookup admits of their ids (None: nothing),
        which the table then writes; an evaluation one reads their initial rows into ``out``. The lock held."""

    def sightings(self, slots: torch.Tensor) -> Optional[torch.Tensor]:
        """The sighting counters of ``slots`` (:meth:`CountingFilter.counters`), or None where no sighting is counted.
        The lock held."""

    def merge_sightings(self, slots: torch.Tensor, counters: torch.Tensor) -> None:
        """Takes another shard's :meth:`sightings` of ``slots`` (:meth:`CountingFilter.merge`); a table that counts
        none ignores them. The lock held."""

    def stats(self) -> dict[str, int]: ...


def make_admission(config: TableConfig, seed: int, memory: NewRows) -> Admission:
    """The admission of ``config``'s table over ``memory``, its draws seeded by ``seed`` and the table's name (so every
    shard and every replay draws alike). The native pass admits every id it is given with a Uniform first row: a
    draw, a sighting count or another initialiser takes the tensor ops."""
    drawn = DrawnAdmission(config, seed, memory)
    if not (memory.indexed_natively and isinstance(config.init, Uniform) and drawn.admits_all):
        return drawn
    first = FirstRows(table_key(seed, config.name), (config.init.low, config.init.high), memory.rule.initial_state(1).reshape(-1))
    return OnePassAdmission(config, memory, first, drawn)


class OnePassAdmission:
    """Admission in one native pass (``jobs.c``'s ``lp_admit``): every unseen id admitted, its first row Uniform."""

    def __init__(self, config: TableConfig, memory: NewRows, first: FirstRows, others: DrawnAdmission) -> None:
        """``others``: the admission of the lookups the pass does not serve."""
        self._capacity = config.capacity
        self._memory = memory
        self._first = first
        self._others = others

    def fill_missing(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, missing: int) -> Optional[Admitted]:
        # An evaluation lookup admits nothing; a save keeps pre-images, which only the tensor ops write; more new ids
        # than the table holds are cut to its capacity, which only the tensor ops do.
        if not (train and missing <= self._capacity and not self._memory.saving):
            return self._others.fill_missing(ids, rows, out, train, missing)
        # a row is taken for every absent occurrence (a client sends each id once; an id repeated in a request takes
        # one row and hands the others back to the free list), except where rows must be evicted for them: exactly
        # one per new id then, none more
        if missing > self._capacity - self._memory.memory_rows:
            missing = int(torch.unique(ids[rows == -1]).numel())
        return Admitted(missing, first=self._first)

    def sightings(self, slots: torch.Tensor) -> Optional[torch.Tensor]:
        return self._others.sightings(slots)

    def merge_sightings(self, slots: torch.Tensor, counters: torch.Tensor) -> None:
        self._others.merge_sightings(slots, counters)

    def stats(self) -> dict[str, int]:
        return self._others.stats()


class DrawnAdmission:
    """Admission in tensor ops: the draw, the sightings, the table's capacity; first rows from ``initializers.py``."""

    def __init__(self, config: TableConfig, seed: int, memory: NewRows) -> None:
        self._config = config
        self._seed = seed
        self._memory = memory
        self._probability = config.admit_probability
        self._after = config.admit_after
        self._draws = torch.Generator().manual_seed((seed ^ name_hash(config.name)) & ((1 << 63) - 1))
        self._sightings = CountingFilter() if config.admit_after > 1 else None
        self._refused = 0  # unseen ids met in training that got no row (the draw, too few sightings, or no room)

    @property
    def admits_all(self) -> bool:
        """Whether every unseen id is admitted (no draw, no sighting counted)."""
        return self._probability >= 1.0 and self._sightings is None

    def fill_missing(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, train: bool, missing: int) -> Optional[Admitted]:
        absent = rows == -1
        unique, inverse = torch.unique(ids[absent], return_inverse=True)
        config = self._config
        initial = initial_rows(config.init, self._seed, config.name, unique, config.dim).to(out.dtype)
        out[absent] = initial[inverse]
        if not train:
            return None
        keep = self._admitted(unique)
        if not bool(keep.all()):
            self._refused += int((~keep).sum())
            unique, initial = unique[keep], initial[keep]
        if unique.numel() > config.capacity:
            self._refused += unique.numel() - config.capacity
            unique, initial = unique[: config.capacity], initial[: config.capacity]
        return Admitted(unique.numel(), ids=unique, initial=initial) if unique.numel() else None

    def sightings(self, slots: torch.Tensor) -> Optional[torch.Tensor]:
        return self._sightings.counters(slots) if self._sightings is not None else None

    def merge_sightings(self, slots: torch.Tensor, counters: torch.Tensor) -> None:
        if self._sightings is not None:
            self._sightings.merge(slots, counters)

    def stats(self) -> dict[str, int]:
        return {"not_admitted": self._refused}

    def _admitted(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` (distinct, unseen) are admitted now (a bool mask); counts a sighting of those drawn."""
        keep = torch.ones(ids.numel(), dtype=torch.bool)
        if self._probability < 1.0:
            keep = torch.rand(ids.numel(), generator=self._draws) < self._probability
        if self._sightings is not None:
            drawn = torch.nonzero(keep).squeeze(1)
            keep[drawn] = self._sightings.add(ids[drawn]) >= self._after
        return keep
