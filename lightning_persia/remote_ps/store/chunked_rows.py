"""The chunked row store of one table: row-aligned fields (ids, weights, optimizer state, ...) in fixed-size chunks.

A table grows by appending a chunk to every field; a stored row never moves, so growth costs one allocation and
no copy whatever the table size (a contiguous array would copy every row at each doubling, under the table's
lock). Row ``r`` lives in chunk ``r >> shift`` at offset ``r & (2**shift - 1)``.

Chunks are anonymous memory maps: untouched rows cost address space only, and the chunks of a large table ask
for transparent huge pages (``MADV_HUGEPAGE``), which cuts the TLB misses of random row accesses over many GB.
Gathers and scatters run as native loops over the chunks' addresses (``ops/native``) or, without them, as
tensor indexing per chunk.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from lightning_persia.ops import native

CHUNK_BYTES = 1 << 27
"""Target size of one chunk of all fields of a table together: the unit of growth and of a checkpoint's copy."""
_MIN_SHIFT, _MAX_SHIFT = 10, 20
_HUGE_PAGE = 2 << 20


@dataclass(frozen=True)
class FieldSpec:
    """One row-aligned field: its dtype, and ``width`` values a row (``[rows, width]``) or one (``None``: ``[rows]``)."""

    dtype: torch.dtype
    width: Optional[int] = None

    @property
    def row_bytes(self) -> int:
        return (1 if self.width is None else self.width) * torch.empty(0, dtype=self.dtype).element_size()

    def shape(self, rows: int) -> tuple[int, ...]:
        return (rows,) if self.width is None else (rows, self.width)


def chunk_shift(row_bytes: int) -> int:
    """log2 of the rows per chunk for rows of ``row_bytes`` (all fields): chunks of about :data:`CHUNK_BYTES`."""
    rows = max(1, CHUNK_BYTES // max(1, row_bytes))
    return max(_MIN_SHIFT, min(_MAX_SHIFT, rows.bit_length() - 1))


class ChunkedField:
    """One field of a table's rows, in chunks of ``2**shift`` rows."""

    def __init__(self, spec: FieldSpec, shift: int) -> None:
        self.spec = spec
        self.shift = shift
        self.chunk_rows = 1 << shift
        self.chunks: list[torch.Tensor] = []
        self.addresses = torch.empty(0, dtype=torch.int64)  # of the chunks, for the native loops

    @property
    def capacity(self) -> int:
        return len(self.chunks) << self.shift

    def add_chunk(self) -> None:
        huge = len(self.chunks) > 0 and self.chunk_rows * self.spec.row_bytes >= _HUGE_PAGE  # small tables stay small
        memory = _anonymous_memory(self.chunk_rows * self.spec.row_bytes, huge)
        self.chunks.append(memory.view(self.spec.dtype).view(self.spec.shape(self.chunk_rows)))
        self.addresses = torch.tensor([c.data_ptr() for c in self.chunks], dtype=torch.int64)

    def chunk(self, index: int, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of chunk ``index`` (a view)."""
        return self.chunks[index][:rows]

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``rows`` (int64; ``-1`` leaves the row of ``out`` as it is), shaped as the field."""
        if out is None:
            out = torch.empty(self.spec.shape(rows.numel()), dtype=self.spec.dtype)
        if native.available():
            return native.gather(self.addresses, self.shift, rows, out)
        for chunk, positions, offsets in self._by_chunk(rows):
            out[positions] = self.chunks[chunk][offsets]
        return out

    def scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Row ``rows[i]`` becomes ``values[i]`` (``-1`` skipped)."""
        values = values.to(self.spec.dtype)
        if native.available():
            native.scatter(self.addresses, self.shift, rows, values)
            return
        for chunk, positions, offsets in self._by_chunk(rows):
            self.chunks[chunk][offsets] = values[positions]

    def fill(self, rows: torch.Tensor, value: int, add: bool = False) -> None:
        """An int32 field of ``rows`` (``-1`` skipped) becomes ``value``, or grows by it with ``add``."""
        if native.available():
            native.set_int32(self.addresses, self.shift, rows, value, add)
            return
        for chunk, _, offsets in self._by_chunk(rows):
            if add:
                self.chunks[chunk].index_add_(0, offsets, torch.full_like(offsets, value, dtype=self.spec.dtype))
            else:
                self.chunks[chunk][offsets] = value

    def _by_chunk(self, rows: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
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


class ChunkedRows:
    """The row-aligned fields of one table; :meth:`reserve` appends chunks to all of them at once.

    Example::

        rows = ChunkedRows({"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float16, 16)})
        rows.reserve(3)
        rows["weights"].scatter(torch.arange(3), torch.zeros(3, 16))
    """

    def __init__(self, fields: dict[str, FieldSpec]) -> None:
        self.shift = chunk_shift(sum(spec.row_bytes for spec in fields.values()))
        self.chunk_rows = 1 << self.shift
        self.fields = {name: ChunkedField(spec, self.shift) for name, spec in fields.items()}

    def __getitem__(self, name: str) -> ChunkedField:
        return self.fields[name]

    @property
    def capacity(self) -> int:
        """Rows the chunks hold (allocated; resident only once written)."""
        return next(iter(self.fields.values())).capacity

    @property
    def num_chunks(self) -> int:
        return self.capacity >> self.shift

    @property
    def row_bytes(self) -> int:
        return sum(f.spec.row_bytes for f in self.fields.values())

    def reserve(self, rows: int) -> None:
        """Makes room for rows ``0 .. rows - 1`` (appends chunks; nothing stored moves)."""
        while self.capacity < rows:
            for field in self.fields.values():
                field.add_chunk()


def _anonymous_memory(nbytes: int, huge: bool) -> torch.Tensor:
    """Zero-filled bytes of an anonymous private map (pages are committed when first written).

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
    memory = torch.frombuffer(buffer, dtype=torch.uint8)
    start = -memory.data_ptr() % extra if huge else 0
    return memory[start : start + nbytes]
