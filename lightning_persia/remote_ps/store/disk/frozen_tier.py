"""A disk tier frozen at a point (a checkpoint's or a live move's): its sealed segments and which of their slots held
live rows then, kept on disk until the point is released."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from lightning_persia.remote_ps.store.disk.records import SegmentFiles
from lightning_persia.remote_ps.store.native.disk_map import DiskMap


def segment_files(directory: Path, segment: int) -> tuple[Path, Path]:
    """The records' file and the ids' file of ``segment`` in a tier's (or a checkpoint's) ``directory``."""
    return directory / f"segment-{segment:06d}.rows", directory / f"segment-{segment:06d}.ids"


@dataclass(frozen=True)
class FrozenTier:
    """The tier at a checkpoint's point: its segments (each ``(number, rows written)``, never written again) and
    which of their slots held live rows then."""

    directory: Path
    segments: list[tuple[int, int]]
    live: list[torch.Tensor]  # one per segment: a bit per written slot (uint8, little-endian bit order)
    id_map: Optional[DiskMap] = None  # the tier's map, being saved as at the point (DiskMap.save_begin)
    lock: Optional[threading.Lock] = None  # the table's: held to copy a part of the map
    released: Optional[Callable[[], None]] = None  # tells the tier (its lock held): its segments may be deleted again

    @property
    def rows(self) -> int:
        """Live rows at the point."""
        return sum(int(np.bitwise_count(bits.numpy()).sum()) for bits in self.live)

    def files(self) -> Iterator[SegmentFiles]:
        """``(number, rows, records file, ids file, live bits)`` of each segment at the point: what a live move reads
        its rows from (``records.live_records``), while this tier deletes none of them (until :meth:`release`)."""
        for (segment, rows), live in zip(self.segments, self.live):
            yield (segment, rows, *segment_files(self.directory, segment), live)

    def release(self) -> None:
        """Ends the map's save, if any, and the point's hold on the segments (done or abandoned), taking its table's
        lock."""
        if self.lock is None:
            return
        with self.lock:
            if self.id_map is not None:
                self.id_map.save_end()
            if self.released is not None:
                self.released()
