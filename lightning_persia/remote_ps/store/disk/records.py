"""A disk tier's records and their files: the record layout ``[id | weights | optimizer state | access]`` (a row of
uint8 bytes), its fields packed and unpacked, records read and written with ``pread``/``pwrite``, and files linked
into a checkpoint."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np
import torch

from lightning_persia.remote_ps.store.chunked_rows import FieldSpec

DISK_FIELDS = ("ids", "weights", "state", "access")
"""The fields of a record on disk, in their order; the id comes first."""


def record_specs(field_specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
    """Of a table's ``field_specs``, those of a record on disk (:data:`DISK_FIELDS`, in their order; none empty)."""
    return {name: field_specs[name] for name in DISK_FIELDS if name in field_specs and field_specs[name].row_bytes > 0}


def link(source: Path, target: Path) -> None:
    """``target`` becomes a hard link of ``source`` (no copy; a copy only across file systems), its bytes on the disk."""
    try:
        os.link(source, target)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        shutil.copyfile(source, target)
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pread_records(fd: int, first: int, count: int, record_bytes: int) -> torch.Tensor:
    """Records ``[first, first + count)`` of a segment's file, ``[count, record_bytes]``; :class:`OSError` (ENODATA)
    where the file ends before them."""
    records = torch.empty(count, record_bytes, dtype=torch.uint8)
    view, offset = memoryview(records.numpy()).cast("B"), first * record_bytes
    while view:
        read = os.preadv(fd, [view], offset)
        if not read:
            raise OSError(errno.ENODATA, f"the file ends before record {first + count - 1}")
        view, offset = view[read:], offset + read
    return records


def live_slots(bits: torch.Tensor, rows: int) -> torch.Tensor:
    """The slots whose bit is set among the first ``rows`` of a segment's live bits."""
    flags = np.unpackbits(bits.numpy(), count=rows, bitorder="little").astype(bool)
    return torch.from_numpy(np.flatnonzero(flags))


SegmentFiles = tuple[int, int, Path, Path, torch.Tensor]
"""A sealed segment's ``(number, rows written, records file, ids file, live bits)``: a checkpoint's, or a tier's at a
point (:meth:`FrozenTier.files`)."""


def live_records(segments: Iterable[SegmentFiles], record_bytes: int, block_rows: int = 1 << 20) -> Iterator[torch.Tensor]:
    """The records (uint8 ``[n, record_bytes]``) of the live slots of ``segments``, read a block of ``block_rows``
    slots at a time; :class:`OSError` (ENODATA) where a records file ends before its rows."""
    for _, count, records, _, bits in segments:
        live = torch.zeros(count, dtype=torch.bool)
        live[live_slots(bits, count)] = True
        for start in range(0, count, block_rows):
            n = min(block_rows, count - start)
            raw = np.fromfile(records, dtype=np.uint8, count=n * record_bytes, offset=start * record_bytes)
            if raw.size != n * record_bytes:
                raise OSError(errno.ENODATA, f"disk segment {records} ends before its {count} records")
            yield torch.from_numpy(raw.reshape(n, record_bytes))[live[start : start + n]]


def live_ids(segments: Iterable[SegmentFiles]) -> Iterator[torch.Tensor]:
    """The ids of the live slots of ``segments``, a segment at a time, read from their ids files (8 bytes a row,
    not the records); :class:`OSError` (ENODATA) where an ids file ends before its rows."""
    for _, count, _, ids, bits in segments:
        stored = torch.from_numpy(np.fromfile(ids, dtype="<i8", count=count))
        if stored.numel() != count:
            raise OSError(errno.ENODATA, f"disk segment {ids} holds {stored.numel()} ids, not {count}")
        yield stored[live_slots(bits, count)]


def unpack(records: torch.Tensor, specs: dict[str, FieldSpec]) -> dict[str, torch.Tensor]:
    """``{field: values}`` of uint8 records ``[n, record bytes]`` laid out as ``specs`` (in their order)."""
    out, offset = {}, 0
    n = records.shape[0]
    for name, spec in specs.items():
        raw = _packed(_columns(records, offset, spec.row_bytes)).view(torch.uint8)
        out[name] = raw.view(spec.dtype).reshape(spec.shape(n))
        offset += spec.row_bytes
    return out


def take_records(records: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``records[index]`` of uint8 records ``[n, record bytes]`` (``index``: positions or a mask), copied a word
    at a time where their layout allows: torch copies the rows of a uint8 tensor a byte at a time (4,500 records of
    48 bytes: 133 us, against 40 us as 8-byte words, on the development VM)."""
    return _columns(records, 0, records.shape[1])[index].view(torch.uint8)


def record_ids(records: torch.Tensor, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ids (int64, contiguous) of uint8 records ``[n, record bytes]``: their first 8 bytes; of the rows
    ``index`` only, if given."""
    ids = _columns(records, 0, 8)
    return _packed(ids if index is None else ids[index]).view(torch.int64).reshape(-1)


def packed_columns(records: torch.Tensor, offset: int, width: int) -> torch.Tensor:
    """Bytes ``offset`` to ``offset + width`` of each of uint8 records ``[n, record bytes]``, as rows of their own
    width (a copy where they are not already)."""
    return _packed(_columns(records, offset, width))


def write_all(fd: int, data: torch.Tensor, offset: int) -> None:
    """Writes all of ``data`` at ``offset`` of the file ``fd`` (``pwrite`` may write less than asked)."""
    view = memoryview(data.contiguous().numpy()).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _packed(columns: torch.Tensor) -> torch.Tensor:
    """``columns`` as rows of their own width, copied unless they are already (an index's result is):
    ``contiguous`` leaves a single row with the stride it had (a whole record's), which a view as wider values
    refuses where the value's size does not divide it."""
    if columns.stride(1) == 1 and columns.stride(0) == columns.shape[1]:
        return columns
    return columns.clone(memory_format=torch.contiguous_format)


def _columns(records: torch.Tensor, offset: int, width: int) -> torch.Tensor:
    """Bytes ``offset`` to ``offset + width`` of each of uint8 records ``[n, record bytes]``, a view as the widest
    integer words (8, 4, 2 or 1 bytes) that their layout and the span allow."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if (offset % size == 0 and width % size == 0 and records.shape[1] % size == 0 and records.stride(1) == 1
                and records.stride(0) % size == 0 and records.data_ptr() % size == 0):
            return records.view(dtype)[:, offset // size : (offset + width) // size]
    return records[:, offset : offset + width]
