"""Which rows leave a full table: least recently used (default) or least frequently used.

Each table keeps one int32 ``access`` value per row: the table's lookup step of the last access (LRU)
or the number of accesses (LFU). Free rows hold ``FREE`` and are never chosen. Victims are taken in
bulk (a slice of the capacity at a time) so that eviction runs rarely and each lookup pays little.

A table of hundreds of millions of rows is never sorted whole: the access value below which ``count`` rows
lie is estimated from a sample, then the chunks are scanned one at a time for rows at or below it (the
smallest values first where more qualify), so the extra memory is a chunk's worth, not the table's.
"""
from __future__ import annotations

from typing import Sequence

import torch

FREE = -1
BULK_FRACTION = 0.05
_SAMPLE = 1 << 16


def touch_value(policy: str, step: int) -> tuple[int, bool]:
    """``(value, add)``: what an access writes into a row's ``access`` (LRU: the step; LFU: one more)."""
    return (step, False) if policy == "lru" else (1, True)


def first_access(policy: str, step: int) -> int:
    """The access value of a row just inserted."""
    return step if policy == "lru" else 1


def select_victims(access: Sequence[torch.Tensor], count: int, generator: torch.Generator) -> torch.Tensor:
    """Row numbers of ``count`` rows of the lowest access values (fewer if fewer are live), free rows excluded.

    ``access[c]`` is the access value of the rows of chunk ``c`` in use; every chunk but the last is full, so a
    position in their concatenation is a row number. Exact when the rows fit in a sample; otherwise the rows
    below a sample's quantile, so the victims are the ``count`` lowest up to the sample's error.
    """
    total = sum(a.numel() for a in access)
    if total <= _SAMPLE:
        keyed = torch.cat(list(access)).to(torch.int64)
        live = torch.nonzero(keyed != FREE).squeeze(1)
        order = torch.topk(keyed[live], min(count, live.numel()), largest=False, sorted=False).indices
        return live[order]
    margin = 1.25  # aim above count: a sample's quantile may fall short of it
    while True:
        threshold, live_fraction = _threshold(access, margin * count, total, generator)
        rows, values = _at_or_below(access, threshold)
        if rows.numel() >= count or margin * count >= live_fraction * total:
            break
        margin *= 2
    if rows.numel() > count:
        rows = rows[torch.topk(values, count, largest=False, sorted=False).indices]
    return rows


def _at_or_below(access: Sequence[torch.Tensor], threshold: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Live rows whose access value is at most ``threshold``, and those values; one chunk at a time."""
    rows, values, start = [], [], 0
    for values_here in access:
        found = torch.nonzero((values_here <= threshold) & (values_here != FREE)).squeeze(1)
        rows.append(found + start)
        values.append(values_here[found])
        start += values_here.numel()
    return torch.cat(rows), torch.cat(values)


def _threshold(access: Sequence[torch.Tensor], count: float, total: int, generator: torch.Generator) -> tuple[int, float]:
    """An access value with about ``count`` live rows at or below it, and the live fraction, from a sample."""
    picks = torch.randint(0, total, (_SAMPLE,), generator=generator)
    bounds = torch.tensor([0] + [a.numel() for a in access]).cumsum(0)
    chunk_of = torch.searchsorted(bounds, picks, right=True) - 1
    sample = torch.cat([access[c][picks[chunk_of == c] - bounds[c]] for c in torch.unique(chunk_of).tolist()])
    sample = sample[sample != FREE]
    live_fraction = sample.numel() / _SAMPLE
    if not sample.numel():
        return FREE, 0.0
    quantile = min(1.0, count / max(total * live_fraction, 1.0))
    return int(torch.quantile(sample.to(torch.float64), quantile, interpolation="higher")), live_fraction


def bulk_size(needed: int, capacity: int) -> int:
    """How many rows to evict when ``needed`` more rows must fit."""
    return min(capacity, max(needed, int(capacity * BULK_FRACTION)))
