"""Bindings of ``rows.c``: the fields of a table's rows kept in chunks, the eviction sweep, and initial rows."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_persia.ops.native.library import check, row_bytes
from lightning_persia.remote_ps.store import native

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32

SIGNATURES = {
    "lp_gather": ([_P, _I64, _I64, _I64, _I64, _P, _I64, _P], None),
    "lp_scatter": ([_P, _I64, _I64, _I64, _I64, _P, _I64, _P], None),
    "lp_fields": ([_P, _I64, _I64, _P, _I64, _I64, _P, _P, _P, _I32], None),
    "lp_set_i32": ([_P, _I64, _I64, _I64, _P, _I64, _I32, _I32], None),
    "lp_select_at_most": ([_P, _I64, _I64, _I32, _I32, _I64, _P, _P], _I64),
    "lp_select_kept": ([_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I32, _P, _I64, _P], _I64),
    "lp_row_bits": ([_P, _I64, _I64, _I64, _P], None),
    "lp_uniform_rows": ([_P, _I64, _I64, _I64, ctypes.c_double, ctypes.c_double, _P], None),
}
"""Argument and result types of every function of ``rows.c`` (tests/remote_ps/store/test_store_native_interface.py
checks them)."""

native.LIBRARY.declare(SIGNATURES)


@dataclass(frozen=True)
class Chunks:
    """Rows kept as records of ``stride`` bytes in chunks of ``2**shift`` records (``addresses``: the chunks'), and
    the C loops that read and write their fields."""

    addresses: torch.Tensor
    shift: int
    stride: int

    @property
    def capacity(self) -> int:
        return self.addresses.numel() << self.shift

    def layout(self) -> tuple[int, int, int]:
        """``(address of the chunks' addresses, shift, stride)``: how the C kernels take the chunks."""
        check(self.addresses, torch.int64, "chunks")
        if not self.addresses.is_contiguous():
            raise ValueError("chunks must be contiguous: the C code reads it in place")
        return self.addresses.data_ptr(), self.shift, self.stride

    def check_field(self, offset: int, width: int) -> None:
        """ValueError unless a field of ``width`` bytes at ``offset`` fits in a record."""
        if offset < 0 or offset + width > self.stride:
            raise ValueError(f"a field of {width} bytes at offset {offset} does not fit in records of {self.stride} bytes")

    def check_rows(self, rows: torch.Tensor, data: Optional[torch.Tensor], offset: int, width: int = 0) -> torch.Tensor:
        """``rows`` as the C loops take them (contiguous int64), checked: the loops write wherever a row number points,
        so none may point past the chunks; ``data``, when given, holds a row of the field at ``offset`` for each."""
        rows = check(rows, torch.int64, "rows").contiguous()
        if data is not None:
            if data.device.type != "cpu" or not data.is_contiguous() or data.shape[0] != rows.numel():
                raise ValueError(f"a contiguous CPU tensor of {rows.numel()} rows is needed, got {tuple(data.shape)} on {data.device}")
            width = row_bytes(data)
        self.check_field(offset, width)
        if rows.numel() and int(rows.max()) >= self.capacity:
            raise ValueError(f"row {int(rows.max())} is past the {self.capacity} rows of the chunks")
        return rows

    def gather(self, offset: int, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[i]`` = the field at byte ``offset`` of the record of row ``rows[i]`` (``out[i]``'s size; ``rows[i] < 0``
        leaves it as it is). Returns ``out``."""
        rows = self.check_rows(rows, out, offset)
        native.LIBRARY.require().lp_gather(*self.layout(), offset, row_bytes(out), rows.data_ptr(), rows.numel(), out.data_ptr())
        return out

    def scatter(self, offset: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """The field at byte ``offset`` of the record of row ``rows[i]`` becomes ``values[i]``; ``rows[i] < 0`` is skipped."""
        values = values.contiguous()
        rows = self.check_rows(rows, values, offset)
        native.LIBRARY.require().lp_scatter(*self.layout(), offset, row_bytes(values), rows.data_ptr(), rows.numel(),
                                            values.data_ptr())

    def fields(self, rows: torch.Tensor, arrays: dict[int, torch.Tensor], to_rows: bool) -> None:
        """Several fields of ``rows`` in one pass over their records: ``arrays[offset]`` is the ``[n, ...]`` array of the
        field at byte ``offset``; ``to_rows`` writes the arrays into the rows, else the rows into the arrays."""
        arrays = {offset: array if array.is_contiguous() else array.contiguous() for offset, array in arrays.items()}
        for offset, array in arrays.items():
            rows = self.check_rows(rows, array, offset)
        count = len(arrays)
        offsets = (ctypes.c_int64 * count)(*arrays)
        widths = (ctypes.c_int64 * count)(*(row_bytes(a) for a in arrays.values()))
        pointers = (ctypes.c_int64 * count)(*(a.data_ptr() for a in arrays.values()))
        native.LIBRARY.require().lp_fields(*self.layout(), rows.data_ptr(), rows.numel(), count, offsets, widths, pointers,
                                           int(to_rows))

    def set_int32(self, offset: int, rows: torch.Tensor, value: int, add: bool = False) -> None:
        """The int32 field at byte ``offset`` of ``rows`` (``< 0``: skipped) becomes ``value``, or grows by it with ``add``."""
        rows = self.check_rows(rows, None, offset, 4)
        native.LIBRARY.require().lp_set_i32(*self.layout(), offset, rows.data_ptr(), rows.numel(), value, int(add))

    def select_kept(self, first: int, count: int, fields: KeptFields, kept: Kept) -> torch.Tensor:
        """The rows ``first .. first + count - 1`` (of one chunk) that ``kept`` keeps, ascending (int64)."""
        if count < 0 or first < 0 or first + count > self.capacity or (count and first >> self.shift != (first + count - 1) >> self.shift):
            raise ValueError(f"rows {first} .. {first + count - 1} are not within one chunk of the {self.capacity} rows")
        for offset, width in ((fields.version, 4), (fields.access, 4), (fields.id, 8)):
            self.check_field(offset, width)
        mask = kept.slot_mask
        if mask is not None:
            check(mask, torch.bool, "slot_mask")
            if not mask.is_contiguous() or mask.numel() & (mask.numel() - 1) or not mask.numel():
                raise ValueError(f"slot_mask must be a contiguous bool tensor of a power-of-two length, got {mask.numel()}")
        out = torch.empty(count, dtype=torch.int64)
        found = native.LIBRARY.require().lp_select_kept(
            *self.layout(), first, count, fields.version, fields.access, fields.id, kept.point, kept.since, kept.free_mark,
            None if mask is None else mask.data_ptr(), 0 if mask is None else mask.numel(), out.data_ptr())
        return out[:found]


@dataclass(frozen=True)
class KeptFields:
    """Where a record holds the fields :meth:`Chunks.select_kept` reads: byte offsets of the int32 version, the
    int32 access mark and the int64 id."""

    version: int
    access: int
    id: int


@dataclass(frozen=True)
class Kept:
    """Which rows a snapshot keeps: version at most ``point`` and above ``since`` (0: no lower bound), access not
    ``free_mark``, and, with ``slot_mask`` (bool, one per routing slot), an id whose slot is set in it."""

    point: int
    since: int
    free_mark: int
    slot_mask: Optional[torch.Tensor] = None


def select_at_most(values: torch.Tensor, threshold: int, free_mark: int, count: int) -> tuple[torch.Tensor, int]:
    """The positions (int64, in order) of up to ``count`` values of ``values`` (1-D int32, any stride: a field of
    records) that are at most ``threshold`` and not ``free_mark``, and the position after the last one taken (the
    length where fewer were found; 0 for a ``count`` of 0). Reads no further than that position."""
    check(values, torch.int32, "values")
    if count < 0:
        raise ValueError(f"count must not be negative, got {count}")
    out = torch.empty(min(count, values.numel()), dtype=torch.int64)
    stop = ctypes.c_int64(0)
    found = native.LIBRARY.require().lp_select_at_most(values.data_ptr(), values.stride(0), values.numel(), threshold,
                                                       free_mark, out.numel(), out.data_ptr(), ctypes.byref(stop))
    return out[:found], stop.value


def row_bits(ids: torch.Tensor, key: int, columns: int) -> torch.Tensor:
    """``[n, columns]`` int64 words ``mix64(mix64(id ^ key) + column * 0x9E3779B97F4A7C15)`` (see initializers.py)."""
    ids = check(ids, torch.int64, "ids").contiguous()
    out = torch.empty(ids.numel(), columns, dtype=torch.int64)
    native.LIBRARY.require().lp_row_bits(ids.data_ptr(), ids.numel(), key, columns, out.data_ptr())
    return out


def uniform_rows(ids: torch.Tensor, key: int, columns: int, low: float, high: float) -> torch.Tensor:
    """``[n, columns]`` float32 Uniform(low, high) initial rows of ``ids`` (see initializers.py), bit for bit."""
    ids = check(ids, torch.int64, "ids").contiguous()
    out = torch.empty(ids.numel(), columns, dtype=torch.float32)
    native.LIBRARY.require().lp_uniform_rows(ids.data_ptr(), ids.numel(), key, columns, float(low), float(high),
                                             out.data_ptr())
    return out
