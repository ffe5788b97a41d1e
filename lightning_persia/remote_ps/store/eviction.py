"""Which rows leave a full table: least recently used (default) or least frequently used.

Each table keeps one int32 ``access`` value per row: the table's lookup step of the last access (LRU)
or the number of accesses (LFU). Free rows hold ``FREE`` and are never chosen. Victims are taken in
bulk (a slice of the capacity at a time) so that eviction runs rarely and each lookup pays little.
"""
from __future__ import annotations

import torch

FREE = -1
BULK_FRACTION = 0.05


def touch(access: torch.Tensor, rows: torch.Tensor, policy: str, step: int) -> None:
    """Records an access of ``rows`` (unique) at lookup ``step``."""
    if policy == "lru":
        access[rows] = step
    else:
        access[rows] += 1


def first_access(policy: str, step: int) -> int:
    """The access value of a row just inserted."""
    return step if policy == "lru" else 1


def select_victims(access: torch.Tensor, count: int) -> torch.Tensor:
    """Rows (indices into ``access``) of the ``count`` lowest access values, free rows excluded."""
    keyed = access.to(torch.int64)
    keyed[access == FREE] = torch.iinfo(torch.int64).max
    count = min(count, int((access != FREE).sum()))
    return torch.topk(keyed, count, largest=False, sorted=False).indices


def bulk_size(needed: int, capacity: int) -> int:
    """How many rows to evict when ``needed`` more rows must fit."""
    return min(capacity, max(needed, int(capacity * BULK_FRACTION)))
