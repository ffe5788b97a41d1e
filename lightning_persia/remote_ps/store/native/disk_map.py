"""Bindings of ``disk_map.c``: the disk tier's id map (id -> slot on disk) and its copy for a checkpoint."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from lightning_persia.ops.native.library import NativeObject, check
from lightning_persia.remote_ps.store import native
from lightning_persia.remote_ps.store.native import records

_P, _I64 = ctypes.c_void_p, ctypes.c_int64

SIGNATURES = {
    "lp_dmap_new": ([], _P),
    "lp_dmap_free": ([_P], None),
    "lp_dmap_info": ([_P, _P], None),
    "lp_dmap_insert": ([_P, _P, _P, _I64], _I64),
    "lp_dmap_find": ([_P, _P, _I64, _P, _P], None),
    "lp_dmap_remove": ([_P, _P, _P, _I64], _I64),
    "lp_dmap_move": ([_P, _P, _P, _P, _I64], _I64),
    "lp_dmap_save_begin": ([_P, _I64], _I64),
    "lp_dmap_save_part": ([_P, _I64, _P, _I64, _P], _I64),
    "lp_dmap_save_end": ([_P], None),
    "lp_dmap_adopt": ([_P, _I64, _P, _I64, _I64], _I64),
}
"""Argument and result types of every function of ``disk_map.c`` (tests/remote_ps/store/test_store_native_interface.py
checks them)."""

native.LIBRARY.declare(SIGNATURES)


class DiskMap(NativeObject):
    """The disk tier's id map (``disk_map.c``): id -> slot on disk, 8 bytes an id, the ids themselves left on disk.

    :meth:`find` answers a slot whose entry's fingerprint matches the id; the caller confirms it against the id in
    the record it reads there and, on a false match (odds of about 2^-32), asks again with ``skip`` one higher.

    Example::

        disk_map = DiskMap()
        disk_map.insert(ids, slots)
        assert torch.equal(disk_map.find(ids), slots)
    """

    def __init__(self) -> None:
        super().__init__(native.LIBRARY, "lp_dmap", "a disk id map")

    def __del__(self) -> None:
        super().__del__()
        for address, nbytes in getattr(self, "_borrowed", ()):  # after the map that pointed into them
            records.unmap_file(address, nbytes)

    PARTS = 4096
    """Partitions of the map (``DM_PARTS``): a save copies them, and a load adopts them, one at a time."""

    def save_begin(self, boundary: int) -> None:
        """Takes the map's point for a save: later entries have slots at or past ``boundary``; removals are logged
        until :meth:`save_part` copied their partition. :meth:`save_end` ends it."""
        if self._library.lp_dmap_save_begin(self._handle, boundary):
            raise MemoryError("cannot allocate the disk id map's save logs")

    def save_part(self, part: int) -> tuple[torch.Tensor, int]:
        """Partition ``part`` as at the save's point: ``(entries (int64), live entries)``; RuntimeError when no save
        runs or its logs could not grow."""
        live = ctypes.c_int64(0)
        out = torch.zeros(0, dtype=torch.int64)
        while True:
            size = self._library.lp_dmap_save_part(self._handle, part, out.data_ptr(), out.numel(), ctypes.byref(live))
            if size >= 0:
                return out[:size], live.value
            if size == -(1 << 62):
                raise RuntimeError("the disk id map is not being saved, or its save logs ran out of memory")
            out = torch.zeros(-size, dtype=torch.int64)

    def save_end(self) -> None:
        self._library.lp_dmap_save_end(self._handle)

    def adopt(self, fd: int, nbytes: int, parts: list[tuple[int, int, int]]) -> None:
        """Maps the first ``nbytes`` of file ``fd`` (a copy on write) and makes each of ``parts``, ``(byte offset,
        entries, live)`` in partition order, the partition it holds (the map must be empty). ValueError when a
        partition cannot be as described; the mapping lasts as long as the map."""
        if len(parts) != self.PARTS or self.info()[0]:
            raise ValueError(f"an id map is adopted whole ({self.PARTS} partitions) into an empty map")
        address = records.map_file(fd, nbytes, private=True)
        self._borrowed = [*getattr(self, "_borrowed", ()), (address, nbytes)]
        for part, (offset, size, live) in enumerate(parts):
            if offset % 8 or offset + size * 8 > nbytes or self._library.lp_dmap_adopt(self._handle, part, address + offset, size, live):
                raise ValueError(f"partition {part} of the id map ({size} entries, {live} live, at byte {offset}) does not fit")

    def info(self) -> tuple[int, int]:
        """``(ids present, bytes)``."""
        out = (ctypes.c_int64 * 2)()
        self._library.lp_dmap_info(self._handle, out)
        return out[0], out[1]

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Adds ``ids`` (absent) at ``slots`` (each ``< 2**32 - 1``); MemoryError when a partition could not grow
        (the ids before the one that failed are in)."""
        ids, slots = _pair(ids, slots)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= (1 << 32) - 1):
            raise ValueError("disk slots must be in [0, 2**32 - 1)")
        added = self._library.lp_dmap_insert(self._handle, ids.data_ptr(), slots.data_ptr(), ids.numel())
        if added < ids.numel():
            raise MemoryError(f"the disk id map could not grow ({added} of {ids.numel()} ids added)")

    def find(self, ids: torch.Tensor, skip: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Slot of the first matching entry of each id past ``skip[i]`` others (none skipped by default), or -1."""
        ids = check(ids, torch.int64, "ids").contiguous()
        if skip is not None:
            ids, skip = _pair(ids, skip)
        out = torch.empty_like(ids)
        self._library.lp_dmap_find(self._handle, ids.data_ptr(), ids.numel(), skip.data_ptr() if skip is not None else None,
                                   out.data_ptr())
        return out

    def remove(self, ids: torch.Tensor, slots: torch.Tensor) -> int:
        """Drops the entries ``(ids[i], slots[i])`` present; returns how many were."""
        ids, slots = _pair(ids, slots)
        return self._library.lp_dmap_remove(self._handle, ids.data_ptr(), slots.data_ptr(), ids.numel())

    def move(self, ids: torch.Tensor, slots: torch.Tensor, to: torch.Tensor) -> int:
        """Re-points the entries ``(ids[i], slots[i])`` present to ``to[i]`` (each ``< 2**32 - 1``), as a removal and
        an insertion would, in one probe; returns how many were present."""
        ids, slots = _pair(ids, slots)
        ids, to = _pair(ids, to)
        if to.numel() and (int(to.min()) < 0 or int(to.max()) >= (1 << 32) - 1):
            raise ValueError("disk slots must be in [0, 2**32 - 1)")
        return self._library.lp_dmap_move(self._handle, ids.data_ptr(), slots.data_ptr(), to.data_ptr(), ids.numel())


def _pair(ids: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = check(ids, torch.int64, "ids").contiguous()
    other = check(other, torch.int64, "slots").contiguous()
    if other.numel() != ids.numel():
        raise ValueError(f"{ids.numel()} ids and {other.numel()} slots")
    return ids, other
