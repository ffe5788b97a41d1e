"""Dedup of the ids of one batch: each id is fetched and updated once, however often the batch uses it."""
from __future__ import annotations

import torch


def unique_with_inverse(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique, inverse)`` with ``unique[inverse] == ids``; ``ids`` is flattened to int64."""
    unique, inverse = torch.unique(ids.reshape(-1).to(torch.int64), return_inverse=True)
    return unique, inverse


def segment_unique(values: torch.Tensor, boundaries: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Dedup each segment ``values[boundaries[i]:boundaries[i+1]]`` on its own.

    Returns the unique ids of every segment and, for every value, its position in its own segment's
    unique ids: the local row indices a fused lookup over per-segment tables expects.
    """
    uniques, inverses = [], []
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        unique, inverse = unique_with_inverse(values[start:end])
        uniques.append(unique)
        inverses.append(inverse)
    return uniques, torch.cat(inverses) if inverses else values.new_empty(0, dtype=torch.int64)
