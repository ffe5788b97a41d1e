"""A table's consistent point for a checkpoint or a serving delta, copied a chunk at a time while the table serves.

:meth:`Table.begin_snapshot` takes the point (the table's version then); :class:`TableSnapshot` hands out the rows
chunk by chunk, each copied under the table's lock. A write to a row of a chunk not copied yet first keeps the row's
pre-image (its value at the point, :meth:`Preimages.keep`), so the checkpoint holds every row as it was at the point.
A disk table's point also seals its tier's segments (:meth:`DiskTier.freeze`): a checkpoint links them, a live move
reads the rows live in them then (:meth:`TableSnapshot.disk_chunks`). A row is in memory or on disk, never both, so
the two parts of the point do not overlap: a row demoted after the point is read as its memory pre-image, a row
promoted after it from its sealed record.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from lightning_persia.ops.hashing import slot_of
from lightning_persia.remote_ps.store import eviction
from lightning_persia.remote_ps.store.chunked_rows import ChunkedRows, FieldSpec
from lightning_persia.remote_ps.store.disk.records import live_ids, live_records, record_specs, unpack
from lightning_persia.remote_ps.store.disk.frozen_tier import FrozenTier
from lightning_persia.remote_ps.store.disk.tier import DiskTierError
from lightning_persia.remote_ps.store.native.rows import Kept
from lightning_persia.remote_ps.table_config import TableConfig

SAVED_FIELDS = ("ids", "weights", "state", "access")
"""The fields a checkpoint keeps per row (versions restart with the process)."""


@dataclass
class SnapshotPoint:
    """A snapshot in progress: its point, and the pre-images of rows changed since."""

    point: int  # rows with version <= point have not changed since
    since: int  # rows with version <= since are left out (0: every row, a full checkpoint)
    size: int  # rows allocated at the point; later ones did not exist
    live: int
    step: int
    removed: torch.Tensor  # ids evicted after `since`, up to the point
    disk: Optional[FrozenTier] = None  # a disk table's segments at the point (a full snapshot's)
    # the routing slots whose rows are kept (bool, one per slot); None: all. A move of a few slots copies, and keeps
    # pre-images of, their rows alone: a wave of a fortieth of the slots would otherwise copy every row of its source
    slot_mask: Optional[torch.Tensor] = None
    next_chunk: int = 0  # chunks below it are copied: their rows need no pre-image
    preimages: dict[int, list[dict[str, torch.Tensor]]] = field(default_factory=dict)
    preimage_rows: int = 0


class Preimages:
    """The snapshot in progress of one table's rows (at most one), and the pre-images it keeps.

    :meth:`begin` and :meth:`keep` are called holding the table's lock; :meth:`chunks` and :meth:`end` take it.
    """

    def __init__(self, rows: ChunkedRows, field_specs: dict[str, FieldSpec], lock: threading.Lock) -> None:
        self._rows = rows
        self._specs = field_specs
        self._lock = lock
        self._point: Optional[SnapshotPoint] = None

    @property
    def active(self) -> Optional[SnapshotPoint]:
        """The snapshot in progress, if any (writes keep pre-images while there is one)."""
        return self._point

    def begin(self, point: SnapshotPoint) -> None:
        self._point = point

    def keep(self, rows: torch.Tensor, version: int) -> None:
        """Keeps the pre-image of ``rows`` about to change (those the snapshot still needs); ``version`` is the
        table's current one, written into the rows so that the chunk's copy skips them."""
        state = self._point
        if state is None or not rows.numel():
            return
        rows = rows[(rows < state.size) & ((rows >> self._rows.shift) >= state.next_chunk)]
        if rows.numel():
            versions = self._rows["version"].gather(rows)
            unchanged = versions <= state.point
            rows = rows[unchanged & (versions > state.since) if state.since else unchanged]
        if rows.numel() and state.slot_mask is not None:
            rows = rows[state.slot_mask[slot_of(self._rows["ids"].gather(rows), state.slot_mask.numel())]]
        if not rows.numel():
            return
        rows, _ = torch.sort(rows)
        chunks, counts = torch.unique_consecutive(rows >> self._rows.shift, return_counts=True)
        piece = {name: self._rows[name].gather(rows) for name in SAVED_FIELDS if name in self._rows.fields}
        start = 0
        for chunk, count in zip(chunks.tolist(), counts.tolist()):
            part = {name: values[start : start + count] for name, values in piece.items()}
            part["rows"] = rows[start : start + count]
            state.preimages.setdefault(chunk, []).append(part)
            start += count
        state.preimage_rows += rows.numel()
        self._rows["version"].fill(rows, version)

    def chunks(self, state: SnapshotPoint) -> Iterator[dict[str, torch.Tensor]]:
        # Two sets of chunk-sized buffers, used in turn: a chunk handed out stays valid while the next one is
        # copied (the caller writes chunk i while chunk i + 1 is copied), and no chunk allocates fresh memory.
        fields = [name for name in SAVED_FIELDS if name in self._rows.fields]
        buffers = [{name: torch.empty(self._specs[name].shape(self._rows.chunk_rows), dtype=self._specs[name].dtype)
                    for name in fields} for _ in range(2)]
        for chunk in range((state.size + self._rows.chunk_rows - 1) >> self._rows.shift):
            with self._lock:
                copied, pieces = self._copy_chunk(state, chunk, buffers[chunk % 2])
            yield copied  # written to disk by the caller while the table serves
            if pieces:  # the chunk's pre-images, handed out apart from its copy: no chunk-sized concatenation
                yield {name: torch.cat([piece[name][piece["access"] != eviction.FREE] for piece in pieces]) for name in copied}

    def end(self, state: SnapshotPoint) -> None:
        with self._lock:
            if self._point is state:
                self._point = None

    def _copy_chunk(self, state: SnapshotPoint, chunk: int, buffers: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        """The chunk's rows unchanged since the point (into ``buffers``), and the pre-images kept of the others
        (now the snapshot's alone: no later write adds to them). The lock held."""
        count = min(self._rows.chunk_rows, state.size - (chunk << self._rows.shift))
        rows = self._rows.select_kept(chunk, count, Kept(state.point, state.since, eviction.FREE, state.slot_mask))
        copied = self._rows.gather_fields(rows, {name: out[: rows.numel()] for name, out in buffers.items()})
        pieces = state.preimages.pop(chunk, [])
        for piece in pieces:
            state.preimage_rows -= piece["rows"].numel()
            if "state" not in piece:
                piece["state"] = torch.empty(piece["ids"].numel(), 0)
        state.next_chunk = chunk + 1
        if "state" not in copied:
            copied["state"] = torch.empty(copied["ids"].numel(), 0)
        return copied, pieces


class TableSnapshot:
    """The rows of a table at one point, handed out a chunk at a time (see :meth:`Table.begin_snapshot`)."""

    def __init__(self, config: TableConfig, field_specs: dict[str, FieldSpec], state: SnapshotPoint, preimages: Preimages,
                 disk_record_bytes: int) -> None:
        self.config = config
        self.step = state.step
        self.point = state.point
        self.since = state.since
        self.rows: Optional[int] = state.live if not state.since else None  # a delta's count is known once written
        self.removed = state.removed
        self.disk = state.disk
        self.disk_record_bytes = disk_record_bytes
        self.field_specs = {name: spec for name, spec in field_specs.items() if name in SAVED_FIELDS}
        self._state = state
        self._preimages = preimages

    def chunks(self) -> Iterator[dict[str, torch.Tensor]]:
        """``{field: rows}`` of the live rows at the point, chunk by chunk (the rows of a chunk changed before its
        copy, as they were at the point, follow it as a ``{field: rows}`` of their own); the table serves between chunks.

        A chunk's tensors stay valid until the chunk after the next one is asked for (they are reused then).
        """
        return self._preimages.chunks(self._state)

    @property
    def disk_rows(self) -> int:
        """A full snapshot's rows on disk at the point (0 for a memory table)."""
        return self.disk.rows if self.disk is not None else 0

    def disk_chunks(self) -> Iterator[dict[str, torch.Tensor]]:
        """``{field: rows}`` (the fields of :meth:`chunks`) of the rows on disk at the point, a block at a time: read
        from the segments the point sealed, which the tier keeps until :meth:`close`, while the table serves. Nothing
        for a memory table."""
        if self.disk is None:
            return
        specs = record_specs(self.field_specs)
        try:
            for block in live_records(self.disk.files(), self.disk_record_bytes):
                rows = unpack(block, specs)
                if "state" not in rows:
                    rows["state"] = torch.empty(block.shape[0], 0)
                yield rows
        except OSError as err:
            raise DiskTierError(f"the disk tier of table {self.config.name!r} could not be read at its point: "
                                f"{err.strerror or err}") from None

    def disk_ids(self) -> Iterator[torch.Tensor]:
        """The ids of the rows on disk at the point (of :meth:`disk_chunks`), from the segments' ids files."""
        if self.disk is None:
            return
        try:
            yield from live_ids(self.disk.files())
        except OSError as err:
            raise DiskTierError(f"the disk tier of table {self.config.name!r} could not be read at its point: "
                                f"{err.strerror or err}") from None

    def close(self) -> None:
        """Ends the snapshot (written or abandoned): the table stops keeping pre-images for it (and a disk table's id
        map stops logging for its save)."""
        self._preimages.end(self._state)
        if self.disk is not None:
            self.disk.release()
