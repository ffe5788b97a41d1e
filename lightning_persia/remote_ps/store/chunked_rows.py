"""The chunked row store of one table: one record per row (id, versions, optimizer state, weights), in chunks.

A table grows by appending a chunk of records; a stored row never moves, so growth costs one allocation and
no copy whatever the table size (a contiguous array would copy every row at each doubling, under the table's
lock). Row ``r`` is record ``r & (2**shift - 1)`` of chunk ``r >> shift``.

A row's fields sit side by side in its record, so the cache line that confirms an id in a lookup (the id is the
record's first field) also brings its weights, and an update reads and writes one record, not one array per
field: on a table far larger than the caches, a row costs one or two cache misses instead of one per field.

Chunks are anonymous memory maps: untouched rows cost address space only, and the chunks of a large table ask
for transparent huge pages (``MADV_HUGEPAGE``), which cuts the TLB misses of random row accesses over many GB.
The first write to a page of fresh memory costs a fault, and a huge page's fault may first have the kernel
compact memory: tens to hundreds of milliseconds that an inserting request would spend holding its table's lock.
So a table past its first chunk has the memory of the rows it will append next committed ahead of it, by a
background thread (``MADV_POPULATE_WRITE``, which commits pages without changing what they hold).
Gathers and scatters run as native loops over the chunks' addresses (``store/native/rows.c``, through
:class:`~.native.rows.Chunks`) or, without them, as tensor indexing of each chunk's bytes; a table's rows choose one
when they are made, so a field's read goes one way down.
"""
from __future__ import annotations

import ctypes
import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from lightning_persia.ops.hashing import slot_of
from lightning_persia.ops.native.library import row_bytes
from lightning_persia.remote_ps.store import native
from lightning_persia.remote_ps.store.native import rows as native_rows

CHUNK_BYTES = 1 << 27
"""Target size of one chunk of records: the unit of growth and of a checkpoint's copy."""
_MIN_SHIFT, _MAX_SHIFT = 10, 20
_HUGE_PAGE = 2 << 20
_ALIGN = 4  # records of 4-byte multiples: every 4-byte field stays aligned; the 8-byte id is read unaligned
POPULATE_AHEAD_BYTES = 64 << 20
"""Memory committed ahead of a growing table's last row (tables past their first chunk; a chunk at most)."""
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python names it from 3.14 on
_populator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="populate-rows")  # one for the process's tables
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


@dataclass(frozen=True)
class FieldSpec:
    """One field of a row: its dtype, and ``width`` values (``[rows, width]``) or one (``None``: ``[rows]``)."""

    dtype: torch.dtype
    width: Optional[int] = None

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def row_bytes(self) -> int:
        return (1 if self.width is None else self.width) * self.itemsize

    def shape(self, rows: int) -> tuple[int, ...]:
        return (rows,) if self.width is None else (rows, self.width)


def chunk_shift(record_bytes: int) -> int:
    """log2 of the records per chunk for records of ``record_bytes``: chunks of about :data:`CHUNK_BYTES`."""
    rows = max(1, CHUNK_BYTES // max(1, record_bytes))
    return max(_MIN_SHIFT, min(_MAX_SHIFT, rows.bit_length() - 1))


class _Records:
    """The chunks of records themselves, shared by a table's :class:`ChunkedRows` and its fields (which hold this,
    not the ChunkedRows: no reference cycle, so a dropped table's memory is freed at once, not by a later GC pass)."""

    def __init__(self, record_bytes: int) -> None:
        self.record_bytes = record_bytes
        self.shift = chunk_shift(record_bytes)
        self.chunk_rows = 1 << self.shift
        self.chunks: list[torch.Tensor] = []  # uint8 [chunk_rows, record_bytes]
        self.maps: list[tuple[mmap.mmap, int]] = []  # each chunk's map and the chunk's address in it
        self.layout = native_rows.Chunks(torch.empty(0, dtype=torch.int64), self.shift, record_bytes)
        # chosen once: every gather and scatter of the table then goes one way down, to the C loops or tensor ops
        self._tensor_ops = None if native.available() else _TensorChunks(self)
        self.access: native_rows.Chunks | _TensorChunks = self.layout if self._tensor_ops is None else self._tensor_ops
        self.populated = 0  # rows whose memory is committed (or being committed) ahead of the writes
        self.last_populate: Optional[Future] = None  # the latest commit asked (the populator runs them in order)

    def add_chunk(self) -> None:
        huge = bool(self.chunks) and self.chunk_rows * self.record_bytes >= _HUGE_PAGE  # small tables stay small
        buffer, start = _anonymous_memory(self.chunk_rows * self.record_bytes, huge)
        memory = torch.frombuffer(buffer, dtype=torch.uint8)[start : start + self.chunk_rows * self.record_bytes]
        self.chunks.append(memory.view(self.chunk_rows, self.record_bytes))
        self.maps.append((buffer, memory.data_ptr()))
        self.layout = native_rows.Chunks(torch.tensor([c.data_ptr() for c in self.chunks], dtype=torch.int64),
                                         self.shift, self.record_bytes)
        self.access = self.layout if self._tensor_ops is None else self._tensor_ops

    def populate_ahead(self, rows: int, limit: int) -> None:
        """Commits, in the background, the memory of the rows that follow the first ``rows``, up to ``limit`` rows
        (allocating their chunks now: an address-space reservation), once the writes near what is committed."""
        if len(self.chunks) < 2:
            return
        ahead = max(1, min(POPULATE_AHEAD_BYTES // self.record_bytes, self.chunk_rows))
        end = min(rows + ahead, limit)
        if rows + ahead // 2 <= self.populated or end <= self.populated:
            return
        first = max(rows, self.populated)
        while len(self.chunks) << self.shift < end:
            self.add_chunk()
        self.populated = end
        ranges = []
        for chunk in range(first >> self.shift, ((end - 1) >> self.shift) + 1):
            lo = max(first, chunk << self.shift) - (chunk << self.shift)
            hi = min(end, (chunk + 1) << self.shift) - (chunk << self.shift)
            buffer, address = self.maps[chunk]
            ranges.append((buffer, address + lo * self.record_bytes, address + hi * self.record_bytes))
        self.last_populate = _populator.submit(_populate, ranges)

    def by_chunk(self, rows: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(chunk, positions in rows, offsets in the chunk)`` of the rows ``>= 0``, one chunk at a time."""
        positions = torch.nonzero(rows >= 0).squeeze(1)
        valid = rows[positions]
        if len(self.chunks) == 1:
            yield 0, positions, valid
            return
        chunk_of = valid >> self.shift
        for chunk in torch.unique(chunk_of).tolist():
            mine = torch.nonzero(chunk_of == chunk).squeeze(1)
            yield chunk, positions[mine], valid[mine] & (self.chunk_rows - 1)


class _TensorChunks:
    """The rows' fields read and written as :class:`~.native.rows.Chunks` does, in tensor indexing of each chunk's
    bytes, for machines without the native kernels (same results, slower)."""

    def __init__(self, records: _Records) -> None:
        self._records = records

    def gather(self, offset: int, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for chunk, positions, offsets in self._records.by_chunk(rows):
            values = self._bytes(chunk, offset, row_bytes(out))[offsets]
            out[positions] = values.view(out.dtype).reshape(-1, *out.shape[1:])
        return out

    def scatter(self, offset: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        raw = values.contiguous().view(torch.uint8).view(values.shape[0], row_bytes(values))
        for chunk, positions, offsets in self._records.by_chunk(rows):
            self._bytes(chunk, offset, raw.shape[1])[offsets] = raw[positions]

    def fields(self, rows: torch.Tensor, arrays: dict[int, torch.Tensor], to_rows: bool) -> None:
        for offset, array in arrays.items():
            if to_rows:
                self.scatter(offset, rows, array)
            else:
                self.gather(offset, rows, array)

    def set_int32(self, offset: int, rows: torch.Tensor, value: int, add: bool = False) -> None:
        for chunk, _, offsets in self._records.by_chunk(rows):
            view = self._bytes(chunk, offset, 4).view(torch.int32).squeeze(1)
            view[offsets] = view[offsets] + value if add else value

    def select_kept(self, first: int, count: int, fields: native_rows.KeptFields, kept: native_rows.Kept) -> torch.Tensor:
        chunk, start = first >> self._records.shift, first & (self._records.chunk_rows - 1)
        version, access = (self._bytes(chunk, offset, 4)[start : start + count].contiguous().view(torch.int32).squeeze(1)
                           for offset in (fields.version, fields.access))
        keep = (version <= kept.point) & (access != kept.free_mark)
        if kept.since:
            keep &= version > kept.since
        rows = torch.nonzero(keep).squeeze(1) + first
        if kept.slot_mask is not None:
            ids = self._bytes(chunk, fields.id, 8)[rows - (chunk << self._records.shift)].contiguous().view(torch.int64).squeeze(1)
            rows = rows[kept.slot_mask[slot_of(ids, kept.slot_mask.numel())]]
        return rows

    def _bytes(self, chunk: int, offset: int, width: int) -> torch.Tensor:
        """The ``width`` bytes at ``offset`` of every record of ``chunk`` (a ``[rows, width]`` uint8 view)."""
        return self._records.chunks[chunk][:, offset : offset + width]


class ChunkedField:
    """One field of a table's records, read and written as a tensor of its own dtype."""

    def __init__(self, records: _Records, spec: FieldSpec, offset: int) -> None:
        self.spec = spec
        self.offset = offset
        self._rows = records

    def chunk(self, index: int, rows: int) -> torch.Tensor:
        """The field of the first ``rows`` records of chunk ``index`` (a strided view).

        Only for fields whose item size divides the record size (every field but the 8-byte id, whose records
        may be 4-byte aligned): :meth:`gather` reads any field.
        """
        raw = self._rows.chunks[index][:rows, self.offset : self.offset + self.spec.row_bytes]
        if self._rows.record_bytes % self.spec.itemsize:
            raise ValueError(f"records of {self._rows.record_bytes} bytes hold no strided view of {self.spec.dtype}; use gather()")
        view = raw.view(self.spec.dtype)
        return view.squeeze(1) if self.spec.width is None else view

    def gather(self, rows: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The field of ``rows`` (int64; ``-1`` leaves that row of ``out`` as it is), shaped as the field."""
        if out is None:
            out = torch.empty(self.spec.shape(rows.numel()), dtype=self.spec.dtype)
        return self._rows.access.gather(self.offset, rows, out)

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """The field of row ``rows[i]`` becomes ``values[i]`` (``-1`` skipped)."""
        self._rows.access.scatter(self.offset, rows, values.to(self.spec.dtype))

    def fill(self, rows: torch.Tensor, value: int, add: bool = False) -> None:
        """An int32 field of ``rows`` (``-1`` skipped) becomes ``value``, or grows by it with ``add``."""
        self._rows.access.set_int32(self.offset, rows, value, add)


class ChunkedRows:
    """The records of one table's rows; :meth:`reserve` appends chunks. ``rows[name]`` is one field.

    Example::

        rows = ChunkedRows({"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float16, 16)})
        rows.reserve(3)
        rows["weights"].scatter(torch.arange(3), torch.zeros(3, 16))
    """

    def __init__(self, fields: dict[str, FieldSpec]) -> None:
        offsets, offset = {}, 0
        for name, spec in sorted(fields.items(), key=lambda item: -item[1].itemsize):  # larger items first
            offsets[name] = offset
            offset += spec.row_bytes
        self._records = _Records(max(_ALIGN, -(-offset // _ALIGN) * _ALIGN))
        self.fields = {name: ChunkedField(self._records, fields[name], offsets[name]) for name in offsets}
        self.record_bytes = self._records.record_bytes
        self.shift = self._records.shift
        self.chunk_rows = self._records.chunk_rows
        self.chunks = self._records.chunks  # the records' own list, which reserve() appends to

    def __getitem__(self, name: str) -> ChunkedField:
        return self.fields[name]


    @property
    def layout(self) -> native_rows.Chunks:
        return self._records.layout

    @property
    def capacity(self) -> int:
        """Rows the chunks hold (allocated; resident only once written)."""
        return len(self._records.chunks) << self.shift

    @property
    def num_chunks(self) -> int:
        return len(self._records.chunks)

    def reserve(self, rows: int, ahead_limit: int = 0) -> None:
        """Makes room for rows ``0 .. rows - 1`` (appends chunks; nothing stored moves); a table past its first
        chunk also has the memory of the rows after them, up to row ``ahead_limit``, committed in the background."""
        while self.capacity < rows:
            self._records.add_chunk()
        self._records.populate_ahead(rows, ahead_limit)

    def wait_populated(self, timeout_s: Optional[float] = None) -> None:
        """Waits until the memory :meth:`reserve` asked to commit ahead is committed."""
        if self._records.last_populate is not None:
            self._records.last_populate.result(timeout_s)

    def select_kept(self, chunk: int, count: int, kept: native_rows.Kept) -> torch.Tensor:
        """The rows among the first ``count`` of chunk ``chunk`` that ``kept`` keeps (a snapshot's read of the chunk:
        its version, access mark and id), ascending, in one pass over the records."""
        fields = native_rows.KeptFields(self.fields["version"].offset, self.fields["access"].offset, self.fields["ids"].offset)
        return self._records.access.select_kept(chunk << self.shift, count, fields, kept)

    def gather_fields(self, rows: torch.Tensor, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``out[name]`` = field ``name`` of ``rows``, every field in one pass over the records; returns ``out``."""
        self._records.access.fields(rows, {self.fields[name].offset: array for name, array in out.items()}, to_rows=False)
        return out

    def scatter_fields(self, rows: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Field ``name`` of ``rows`` = ``values[name]``, every field in one pass over the records."""
        self._records.access.fields(rows, {self.fields[name].offset: array.to(self.fields[name].spec.dtype)
                                           for name, array in values.items()}, to_rows=True)


def _populate(ranges: list[tuple[mmap.mmap, int, int]]) -> None:
    """Commits the pages of ``(map, first address, end address)`` ranges in the map, leaving their bytes as they are.

    Through libc, which ctypes calls without the GIL: ``mmap.madvise`` holds it for the whole call (tens of ms per
    64 MB), which would stop every request thread of the shard meanwhile. And one huge page per call: a call
    holds the process's memory-map lock (for reading) throughout, and a request thread that maps or unmaps
    memory meanwhile (a new chunk, an index partition, a large tensor) waits for it, holding its table's lock.
    The map in each range keeps it open.
    """
    for _, first, end in ranges:
        first -= first % mmap.PAGESIZE
        for start in range(first, end, _HUGE_PAGE):
            if _libc.madvise(start, min(_HUGE_PAGE, end - start), _MADV_POPULATE_WRITE):  # an older kernel: the
                return  # rows' first writes fault their pages, as without this


def _anonymous_memory(nbytes: int, huge: bool) -> tuple[mmap.mmap, int]:
    """An anonymous private map of at least ``nbytes`` zero bytes (pages are committed when first written), and
    the offset of the bytes to use in it.

    With ``huge``, the bytes start on a huge-page boundary (the map is one huge page longer; its untouched ends
    cost no memory), so the kernel can back all of them with huge pages.
    """
    extra = _HUGE_PAGE if huge else 0
    buffer = mmap.mmap(-1, nbytes + extra, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: ordinary pages then
            pass
    start = -torch.frombuffer(buffer, dtype=torch.uint8).data_ptr() % extra if huge else 0
    return buffer, start
