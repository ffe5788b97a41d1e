"""What one journaled lookup or update changed in a table, collected for the shard's write-ahead log.

A table records while the operation runs, under its lock (admitted ids, removed ids, the rows' new values); the
shard's journal then hears every table's change of the operation at once, so the log's order is the order of the
changes (see ``wal/``).
"""
from __future__ import annotations

from typing import Callable

import torch

from lightning_persia.remote_ps.store.wal.changes import TableChange

Journal = Callable[[list[TableChange]], None]
"""Called with the changes of one lookup or update while the tables' locks are held (the write-ahead log's order
is then the order of the changes)."""


class Recording:
    """What one journaled operation changed in a table so far."""

    __slots__ = ("removed", "admitted_ids", "admitted_access", "rows")

    def __init__(self) -> None:
        self.removed: list[torch.Tensor] = []
        self.admitted_ids: list[torch.Tensor] = []
        self.admitted_access: list[torch.Tensor] = []
        self.rows: list[dict[str, torch.Tensor]] = []

    def admitted(self, ids: torch.Tensor, access: torch.Tensor) -> None:
        self.admitted_ids.append(ids)
        self.admitted_access.append(access)

    def change(self, name: str, step: int) -> TableChange:
        change = TableChange(name, step)
        if self.removed:
            change.removed = torch.cat(self.removed)
        if self.admitted_ids:
            change.admitted, change.admitted_access = torch.cat(self.admitted_ids), torch.cat(self.admitted_access)
        if self.rows:
            change.rows = {name: torch.cat([part[name] for part in self.rows]) for name in self.rows[0]}
        return change
