"""Records of a disk tier read without its table's lock: a lookup probes the id map under the lock, lets the lock go
while the records are read (the reads are most of a disk lookup's time), and takes it again to use them."""
from __future__ import annotations

from typing import Optional

import torch

from lightning_persia.remote_ps.store.native.records import read_records


class ReadAhead:
    """Records of a tier read without its table's lock (:meth:`DiskTier.begin_read`): the ``positions`` of a request
    whose ids its memory lacked, those ``ids``, their ``slots`` then (-1: not on disk), and, once :meth:`read`, their
    ``records`` (a row per position; None: not read) and whether an id ``repeats`` among those on disk."""

    def __init__(self, positions: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, tables: tuple, record_bytes: int,
                 map_changes: tuple[int, int]) -> None:
        self.positions, self.ids, self.slots = positions, ids, slots
        self.records: Optional[torch.Tensor] = None
        self.repeats = True
        self.map_changes = map_changes  # the id map's (removals, inserts) so far when the read began
        self._tables = tables  # the tier's file and mapping tables, and its segment shift, when the read began: valid
        # until end_read
        self._record_bytes = record_bytes

    def read(self) -> None:
        """Reads the records (without the table's lock). A failure leaves them unread: the lookup then reads them
        under the lock, where the failure is reported."""
        found = torch.nonzero(self.slots >= 0).squeeze(1)
        sorted_slots, order = torch.sort(self.slots[found])  # file order: neighbouring records share the pages read
        records = torch.empty(self.ids.numel(), self._record_bytes, dtype=torch.uint8)
        try:
            read_records(*self._tables, sorted_slots, records, into=found[order])
        except Exception:  # noqa: BLE001 - read again under the lock, which reports what failed
            return
        self.records = records
        self.repeats = bool((sorted_slots[1:] == sorted_slots[:-1]).any())  # an id's positions share its slot
