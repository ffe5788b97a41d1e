"""The ids a table evicted, by version, so that a serving delta since an earlier point can name them.

Logging starts with :meth:`RemovalLog.start` (the first delta's base) and keeps at most ``limit`` ids: the oldest
evictions are then forgotten, and a delta since a point before them is refused (a full snapshot is needed).
"""
from __future__ import annotations

from typing import Optional

import torch

from lightning_persia.remote_ps.store.errors import StoreError

_DEFAULT_LIMIT = 1 << 24


class RemovalLog:
    """The evictions of one table (named ``table`` in errors); called holding the table's lock."""

    def __init__(self, table: str, limit: int = _DEFAULT_LIMIT) -> None:
        self._table = table
        self._limit = limit
        self._entries: list[tuple[int, torch.Tensor]] = []  # (version, ids), oldest first
        self._ids = 0
        self._floor: Optional[int] = None  # evictions up to this version are unknown; None: not logging

    def start(self, version: int) -> None:
        """Logs the evictions after ``version`` from now on (once: a later call keeps the earlier floor)."""
        if self._floor is None:
            self._floor = version

    def add(self, version: int, ids: torch.Tensor) -> None:
        """``ids`` evicted at ``version`` (dropped unless logging has started)."""
        if self._floor is None:
            return
        self._entries.append((version, ids))
        self._ids += ids.numel()
        while self._ids > self._limit and len(self._entries) > 1:
            forgotten_version, forgotten = self._entries.pop(0)
            self._ids -= forgotten.numel()
            self._floor = forgotten_version

    def since(self, version: int) -> torch.Tensor:
        """The ids evicted after ``version``; :class:`StoreError` when those are no longer (or not yet) known."""
        if self._floor is None or version < self._floor:
            raise StoreError(f"table {self._table!r}: the ids evicted since version {version} are not known "
                             "(call remember_removals before the snapshot a delta starts from)")
        removed = [ids for at, ids in self._entries if version < at]
        return torch.cat(removed) if removed else torch.empty(0, dtype=torch.int64)
