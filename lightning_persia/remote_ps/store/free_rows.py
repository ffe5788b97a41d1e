"""The free rows of a table's row store: left by evictions, demotions, expiry and removals, taken again by inserts.

A disk table keeps a sixteenth of its budget free ahead of the requests (``demoter.py``): 2.5M rows at a 40M-row
budget. Kept in one tensor, every demotion appended to it by copying it whole (20 MB there); kept as the tensors
they were freed in, a push copies nothing and a take copies only the rows it takes.
"""
from __future__ import annotations

from collections import deque

import torch


class FreeRows:
    """Row numbers, taken in the order they were freed.

    Example::

        free = FreeRows()
        free.push(torch.tensor([4, 9]))
        free.take(1)   # tensor([4])
        len(free)      # 1
    """

    def __init__(self) -> None:
        self._parts: deque[torch.Tensor] = deque()
        self._count = 0

    def push(self, rows: torch.Tensor) -> None:
        """Frees ``rows`` (int64; the caller changes them no more)."""
        if rows.numel():
            self._parts.append(rows)
            self._count += rows.numel()

    def take(self, n: int) -> torch.Tensor:
        """Up to ``n`` free rows, the first freed first; they are no longer free."""
        taken, wanted = [], n
        while wanted > 0 and self._parts:
            head = self._parts[0]
            if head.numel() <= wanted:
                taken.append(self._parts.popleft())
            else:
                taken.append(head[:wanted])
                self._parts[0] = head[wanted:]
            wanted -= taken[-1].numel()
        self._count -= n - max(wanted, 0)
        if not taken:
            return torch.empty(0, dtype=torch.int64)
        return taken[0] if len(taken) == 1 else torch.cat(taken)

    def __len__(self) -> int:
        return self._count
