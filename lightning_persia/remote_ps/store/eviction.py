"""Which rows leave a full table: least recently used (default) or least frequently used.

Each table keeps one int32 ``access`` value per row: the table's lookup step of the last access (LRU)
or the number of accesses (LFU). Free rows hold ``FREE`` and are never chosen.

A table of hundreds of millions of rows is never sorted, nor scanned whole under its lock: the access value
below which the coldest :data:`BULK_FRACTION` of its rows lie is estimated from a sample, and the rows are swept
from where the previous eviction stopped (a clock hand), a slice at a time, until enough rows at or below it
are found. An eviction of ``count`` rows so reads about ``count / BULK_FRACTION`` access values and removes
``count`` ids, whatever the table size: at most :data:`SLICE_ROWS` beyond what a request needs. (Taking 5% of
the capacity at once held a 67M-row table's lock 1.3 to 1.5 s: every access value scanned, 3.3M ids removed.)

:class:`Eviction` is a table's part for it, with one entry point for the table (:meth:`Eviction.victims`); a
disk table's demoter asks it ahead, without the lock, for the threshold it then evicts by
(:meth:`Eviction.cold_estimate`).
"""
from __future__ import annotations

import math
from bisect import bisect_right
from itertools import accumulate
from typing import Optional, Protocol, Sequence

import torch

from lightning_persia.remote_ps.store import native
from lightning_persia.remote_ps.store.native import rows as native_rows

FREE = -1
_HIDDEN = (1 << 31) - 1  # above any threshold: a row hidden from a selection looks the hottest
BULK_FRACTION = 0.05
"""Victims are taken among the coldest this fraction of the live rows (and, in a small table, this fraction of
its capacity at a time)."""
SLICE_ROWS = 1 << 16
"""The most rows one eviction takes beyond those a request needs."""
_SAMPLE = 1 << 16
_MARGIN = 1.25  # aim above count: a sample's quantile may fall short of it, and the sweep would read the whole table
_SWEEP_ROWS = 1 << 18  # access values read per step of the sweep
_STALE_READS = 4  # a sweep by an estimate made earlier reads at most this many times what a fresh one needs on average


class Eviction:
    """Which rows of a table leave its memory when it is full: the sweep's clock hand and its samples' generators,
    seeded by ``seed``; ``access``: the table's ``access`` field (rows an operation keeps are hidden in it)."""

    def __init__(self, access: "AccessField", seed: int) -> None:
        self._access = access
        self._sample = torch.Generator().manual_seed(seed)
        self._demotion_sample = torch.Generator().manual_seed(seed + 1)  # the demoter's, used without the lock
        self._start = 0  # the row where the next eviction's sweep starts (select_victims)

    def victims(self, in_use: Sequence[torch.Tensor], count: int, estimated: Optional[tuple[int, float]] = None,
                keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Row numbers of ``count`` cold rows (fewer if fewer are live), none of ``keep``: ``in_use[c]`` is the access
        value of the rows of chunk ``c`` allocated so far; ``estimated``: their threshold (:meth:`cold_estimate`), or
        estimated now. The table's lock held."""
        if not in_use:
            return torch.empty(0, dtype=torch.int64)
        if keep is None or not keep.numel():
            victims, self._start = select_victims(in_use, count, self._sample, self._start, estimated)
            return victims
        # the rows kept look the hottest while the selection runs, so that it passes over them; their access values
        # come back after it. A selection that takes every row of a small table may still name them: they are dropped
        values = self._access.gather(keep)
        self._access.fill(keep, _HIDDEN)
        try:
            victims, self._start = select_victims(in_use, count, self._sample, self._start, estimated)
        finally:
            self._access.scatter(keep, values)
        return victims[~torch.isin(victims, keep)]

    def cold_estimate(self, in_use: Sequence[torch.Tensor], count: int) -> Optional[tuple[int, float]]:
        """:func:`estimate` of ``count`` victims among ``in_use`` (read without the lock; only the demoter calls it)."""
        return estimate(in_use, count, self._demotion_sample)


class AccessField(Protocol):
    """A table's ``access`` field as :meth:`Eviction.victims` reads and writes it (hiding the rows kept) (:class:`~.chunked_rows.ChunkedField` is one)."""

    def gather(self, rows: torch.Tensor) -> torch.Tensor: ...

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None: ...

    def fill(self, rows: torch.Tensor, value: int) -> None: ...


def touch_value(policy: str, step: int) -> tuple[int, bool]:
    """``(value, add)``: what an access writes into a row's ``access`` (LRU: the step; LFU: one more)."""
    return (step, False) if policy == "lru" else (1, True)


def first_access(policy: str, step: int) -> int:
    """The access value of a row just inserted."""
    return step if policy == "lru" else 1


def estimate(access: Sequence[torch.Tensor], count: int, generator: torch.Generator) -> Optional[tuple[int, float]]:
    """The first estimate :func:`select_victims` makes for ``count`` victims, ``(threshold, live fraction)`` from a
    sample, or None where the table fits in a sample (its victims are then chosen exactly). It only reads ``access``,
    so it may run while the values change (a shard's demoter runs it without the table's lock: a value changed
    meanwhile moves the estimate a little, nothing else)."""
    total = sum(a.numel() for a in access)
    return None if total <= _SAMPLE else _threshold(access, _MARGIN * count, total, generator)


def select_victims(access: Sequence[torch.Tensor], count: int, generator: torch.Generator, start: int = 0,
                   estimated: Optional[tuple[int, float]] = None) -> tuple[torch.Tensor, int]:
    """Row numbers of ``count`` cold rows (fewer if fewer are live), free rows excluded, and where the next
    eviction starts.

    ``access[c]`` is the access value of the rows of chunk ``c`` in use; every chunk but the last is full, so a
    position in their concatenation is a row number. A table that fits in a sample gives exactly its ``count``
    coldest rows. A larger one gives the first ``count`` rows from row ``start`` on (wrapping around) whose access
    value is at or below the sample's estimate of the coldest :data:`BULK_FRACTION` (or of ``count`` rows, if more):
    ``estimated`` (by :func:`estimate`, perhaps several evictions ago: rows touched since may have left too few
    below it, so a sweep by it gives up after a few times the values it should need and a new sample is taken), or
    estimated now.
    """
    total = sum(a.numel() for a in access)
    if total <= _SAMPLE:
        keyed = torch.cat(list(access)).to(torch.int64)
        live = torch.nonzero(keyed != FREE).squeeze(1)
        order = torch.topk(keyed[live], min(count, live.numel()), largest=False, sorted=False).indices
        return live[order], start
    margin = _MARGIN
    reads = total
    if estimated is not None and estimated[1] > 0:  # made earlier: the rows touched since may have left it short
        reads = min(total, math.ceil(_STALE_READS * count / (BULK_FRACTION * estimated[1])))
    bounds = list(accumulate((a.numel() for a in access), initial=0))
    # In C where it can (one pass that stops at the last one taken): the tensor ops read the whole slice three times,
    # 1.0 ms of a 16,384-row demotion's 5.25 ms with the lock held (100M rows, 40M in memory).
    cold_among = native_rows.select_at_most if native.available() else _cold_among
    while True:
        threshold, live_fraction = estimated if estimated is not None else _threshold(access, margin * count, total, generator)
        estimated = None  # a second try samples again, aiming higher
        # the sweep: up to `count` live rows at or below the threshold, read from `start` on (wrapping, at most once
        # around), reading at most `reads` values, a slice at a time; it stops after the last one taken (or read)
        found, taken, position, read = [], 0, start % total, 0
        while taken < count and read < reads:
            chunk = bisect_right(bounds, position) - 1
            offset = position - bounds[chunk]
            values = access[chunk][offset : offset + min(_SWEEP_ROWS, reads - read)]
            hits, step = cold_among(values, threshold, FREE, count - taken)
            found.append(hits + position)
            taken += hits.numel()
            read += step
            position = (position + step) % total
        if taken >= count or margin * count >= live_fraction * total:
            return (torch.cat(found) if found else torch.empty(0, dtype=torch.int64)), position
        reads = total
        margin *= 2


def _cold_among(values: torch.Tensor, threshold: int, free_mark: int, count: int) -> tuple[torch.Tensor, int]:
    """:func:`~.native.rows.select_at_most` in tensor ops: the positions of up to ``count`` values at or below
    ``threshold`` and not ``free_mark``, in order, and how many values that took: up to the last one taken (the next
    sweep starts right after it), or all of them where fewer were found."""
    hits = torch.nonzero((values <= threshold) & (values != free_mark)).squeeze(1)[:count]
    return hits, values.numel() if hits.numel() < count else int(hits[-1]) + 1


def _threshold(access: Sequence[torch.Tensor], count: float, total: int, generator: torch.Generator) -> tuple[int, float]:
    """The access value at or below which about ``count`` live rows lie, or the coldest :data:`BULK_FRACTION` of
    them if more (from a sample), and the live fraction."""
    picks = torch.sort(torch.randint(0, total, (_SAMPLE,), generator=generator)).values  # grouped by chunk
    bounds = torch.tensor([0] + [a.numel() for a in access]).cumsum(0)
    chunk_of = torch.searchsorted(bounds, picks, right=True) - 1
    counts = torch.bincount(chunk_of, minlength=len(access)).tolist()
    local = (picks - bounds[chunk_of]).split(counts)
    sample = torch.cat([access[c][local[c]] for c, n in enumerate(counts) if n])
    sample = sample[sample != FREE]
    live_fraction = sample.numel() / _SAMPLE
    if not sample.numel():
        return FREE, 0.0
    quantile = min(1.0, max(BULK_FRACTION, count / max(total * live_fraction, 1.0)))
    rank = math.ceil(quantile * (sample.numel() - 1)) + 1  # the quantile's "higher" value, selected without a sort
    return int(torch.kthvalue(sample, rank).values), live_fraction


def bulk_size(needed: int, capacity: int) -> int:
    """How many rows to evict when ``needed`` more rows must fit."""
    return min(capacity, max(needed, min(SLICE_ROWS, int(capacity * BULK_FRACTION))))
