"""Native kernels (``kernels.c``), compiled into a shared library when the package is built, called through ctypes.

A table operation of a training step touches a few hundred ids; in tensor ops its index probe costs a
dozen dispatches per pass and dominated the shard's CPU. The C loop does the same work in microseconds, and on
tables far larger than the caches it keeps many cache misses in flight at once (see kernels.c).

Over 500 lines because it is the one place where the C interface is declared for Python (``SIGNATURES`` and the
job structures, held to ``kernels.c`` by tests/ops/test_native_interface.py): each kernel's checks of its tensors
sit beside its declaration.
``pip install``, ``python -m build`` and ``pip install -e .`` compile the library into this folder (``setup.py``);
in a source checkout ``make native`` does. Its name carries a digest of ``kernels.c``, so a library built from
another version of the source is never loaded. Without the library (no C compiler at build time, or a source
changed since the build), or with ``LIGHTNING_PERSIA_NATIVE=0``, every caller keeps its tensor implementation
(same results, slower); :func:`available` tells which is in use.

Example::

    from lightning_persia.ops import native
    if native.available():
        first = native.first_foreign(ids, num_shards=2, shard=0)
        index = native.Index()
"""
from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import importlib.machinery
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from lightning_persia.ops.native._source import library_name

NATIVE_ENV = "LIGHTNING_PERSIA_NATIVE"
"""``LIGHTNING_PERSIA_NATIVE=0`` keeps the tensor implementation even where the library is built."""

_DIRECTORY = Path(__file__).parent
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def available() -> bool:
    """True when the native kernels are loaded (and used by the id index and the shard store)."""
    return _library() is not None


@dataclass(frozen=True)
class Chunks:
    """Rows kept as records of ``stride`` bytes in chunks of ``2**shift`` records (``addresses``: the chunks')."""

    addresses: torch.Tensor
    shift: int
    stride: int

    @property
    def capacity(self) -> int:
        return self.addresses.numel() << self.shift


def gather(chunks: Chunks, offset: int, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[i]`` = the field at byte ``offset`` of the record of row ``rows[i]`` (``out[i]``'s size; ``rows[i] < 0``
    leaves it as it is). Returns ``out``."""
    rows = _rows(chunks, rows, out, offset)
    _require().lp_gather(*_layout(chunks), offset, _row_bytes(out), rows.data_ptr(), rows.numel(), out.data_ptr())
    return out


def scatter(chunks: Chunks, offset: int, rows: torch.Tensor, values: torch.Tensor) -> None:
    """The field at byte ``offset`` of the record of row ``rows[i]`` becomes ``values[i]``; ``rows[i] < 0`` is skipped."""
    values = values.contiguous()
    rows = _rows(chunks, rows, values, offset)
    _require().lp_scatter(*_layout(chunks), offset, _row_bytes(values), rows.data_ptr(), rows.numel(), values.data_ptr())


def fields(chunks: Chunks, rows: torch.Tensor, arrays: dict[int, torch.Tensor], to_rows: bool) -> None:
    """Several fields of ``rows`` in one pass over their records: ``arrays[offset]`` is the ``[n, ...]`` array of the
    field at byte ``offset``; ``to_rows`` writes the arrays into the rows, else the rows into the arrays."""
    arrays = {offset: array if array.is_contiguous() else array.contiguous() for offset, array in arrays.items()}
    for offset, array in arrays.items():
        rows = _rows(chunks, rows, array, offset)
    count = len(arrays)
    offsets = (ctypes.c_int64 * count)(*arrays)
    widths = (ctypes.c_int64 * count)(*(_row_bytes(a) for a in arrays.values()))
    pointers = (ctypes.c_int64 * count)(*(a.data_ptr() for a in arrays.values()))
    _require().lp_fields(*_layout(chunks), rows.data_ptr(), rows.numel(), count, offsets, widths, pointers, int(to_rows))


def set_int32(chunks: Chunks, offset: int, rows: torch.Tensor, value: int, add: bool = False) -> None:
    """The int32 field at byte ``offset`` of ``rows`` (``< 0``: skipped) becomes ``value``, or grows by it with ``add``."""
    rows = _rows(chunks, rows, None, offset, 4)
    _require().lp_set_i32(*_layout(chunks), offset, rows.data_ptr(), rows.numel(), value, int(add))


class Index:
    """The native id index of one table (``kernels.c``): id -> row. A row's id is read from the first 8 bytes of its
    record in ``chunks``.

    Example::

        index = native.Index()
        index.insert(ids, rows, chunks)      # the records of rows already hold ids
        assert torch.equal(index.find(ids, chunks), rows)
    """

    def __init__(self) -> None:
        self._library = _require()
        self._handle = self._library.lp_index_new()
        if not self._handle:
            raise MemoryError("cannot allocate an id index")

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._library.lp_index_free(handle)

    def info(self) -> tuple[int, int, int, int, int]:
        """``(ids present, bytes, partition rebuilds so far, rebuilds an insert put off to a later one so far, ids
        inserted so far)``."""
        out = (ctypes.c_int64 * 5)()
        self._library.lp_index_info(self._handle, out)
        return out[0], out[1], out[2], out[3], out[4]

    def find(
        self, ids: torch.Tensor, chunks: Chunks, copy: Optional[tuple[int, torch.Tensor]] = None,
        touch: Optional[tuple[int, int, bool]] = None,
    ) -> torch.Tensor:
        """Row of each id, ``-1`` when absent.

        In the same pass, ``copy=(offset, out)``: ``out[i]`` = the field at ``offset`` of each row found;
        ``touch=(offset, value, add)``: the int32 field at ``offset`` of each row found becomes ``value`` (or grows by it).
        """
        ids = _check(ids, torch.int64, "ids").contiguous()
        _check(chunks.addresses, torch.int64, "chunks")
        rows = torch.empty_like(ids)
        offset, width, out = 0, 0, None
        if copy is not None:
            offset, out = copy
            if not out.is_contiguous() or out.shape[0] != ids.numel() or out.device.type != "cpu":
                raise ValueError(f"find: out must be a contiguous CPU tensor of {ids.numel()} rows, got {tuple(out.shape)}")
            width = _row_bytes(out)
            _within(chunks, offset, width)
        touch_offset, value, add = touch if touch is not None else (-1, 0, False)
        if touch is not None:
            _within(chunks, touch_offset, 4)
        self._library.lp_index_find(
            self._handle, *_layout(chunks), ids.data_ptr(), ids.numel(), rows.data_ptr(),
            offset, width, out.data_ptr() if out is not None else None, touch_offset, value, int(add),
        )
        return rows

    def find_job(self, ids: torch.Tensor, rows: torch.Tensor, chunks: Chunks, copy: tuple[int, torch.Tensor],
                 touch: Optional[tuple[int, int, bool]] = None) -> FindJob:
        """A :func:`find_many` job: as :meth:`find` into ``rows``; the tensors must outlive the call."""
        _check(ids, torch.int64, "ids")
        _check(rows, torch.int64, "rows")
        offset, out = copy
        if not (ids.is_contiguous() and rows.is_contiguous() and out.is_contiguous()) or rows.numel() != ids.numel() or \
                out.shape[0] != ids.numel() or out.device.type != "cpu":
            raise ValueError(f"find_job: contiguous CPU ids, rows and out of {ids.numel()} rows are needed")
        _within(chunks, offset, _row_bytes(out))
        touch_offset, value, add = touch if touch is not None else (-1, 0, False)
        if touch is not None:
            _within(chunks, touch_offset, 4)
        address, shift, stride = _layout(chunks)
        return FindJob(self._handle, address, shift, stride, ids.data_ptr(), ids.numel(), rows.data_ptr(), offset,
                       _row_bytes(out), out.data_ptr(), touch_offset, value, int(add), 0)

    def update_job(self, ids: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, chunks: Chunks, rule: str,
                   weights: tuple[int, torch.dtype], state_offset: int, version: tuple[int, int], lr: float, eps: float,
                   weight_decay: float, bound: Optional[float]) -> UpdateJob:
        """An :func:`update_many` job for the rows of ``ids``; the tensors must outlive the call."""
        _check(ids, torch.int64, "ids")
        _check(rows, torch.int64, "rows")
        weights_offset, weights_dtype = weights
        dim = grads.shape[1] if grads.dim() == 2 else -1
        if grads.dtype != torch.float32 or dim < 1 or grads.shape[0] != ids.numel() or not grads.is_contiguous() or \
                not ids.is_contiguous() or rows.numel() != ids.numel() or weights_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"update_job: contiguous float32 grads [{ids.numel()}, dim], ids and rows of as many are needed")
        _within(chunks, weights_offset, dim * torch.empty(0, dtype=weights_dtype).element_size())
        _within(chunks, state_offset, 4 * (dim if rule == "Adagrad" else 1 if rule == "RowwiseAdagrad" else 0))
        _within(chunks, version[0], 4)
        address, shift, stride = _layout(chunks)
        return UpdateJob(self._handle, address, shift, stride, ids.data_ptr(), ids.numel(), rows.data_ptr(), grads.data_ptr(),
                         dim, weights_offset, state_offset, version[0], int(weights_dtype == torch.float16), RULES[rule],
                         version[1], int(bound is not None), lr, eps, weight_decay, bound or 0.0, 0, 0, 0)

    def admit_job(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, chunks: Chunks, fresh: torch.Tensor,
                  fields: AdmitFields, init_key: int, uniform: tuple[float, float]) -> AdmitJob:
        """An :func:`admit` job: the ids of a training lookup whose ``rows`` are ``-1`` get rows of ``fresh``, in
        order (see ``kernels.c``); the tensors must outlive the call."""
        _check(ids, torch.int64, "ids")
        _check(rows, torch.int64, "rows")
        fresh = _rows(chunks, fresh, None, 0, 8)
        weights_offset, weights_dtype = fields.weights
        dim = out.shape[1] if out.dim() == 2 else -1
        state = fields.state.contiguous()
        if not (ids.is_contiguous() and rows.is_contiguous() and out.is_contiguous()) or rows.numel() != ids.numel() or \
                out.shape[0] != ids.numel() or out.dtype != weights_dtype or weights_dtype not in (torch.float16, torch.float32) or \
                dim < 1 or state.dtype != torch.float32 or out.device.type != "cpu":
            raise ValueError(f"admit_job: contiguous CPU ids, rows and out [{ids.numel()}, dim] of the weights' dtype are needed")
        _within(chunks, weights_offset, _row_bytes(out))
        _within(chunks, fields.access[0], 4)
        _within(chunks, fields.version[0], 4)
        state_bytes = state.numel() * 4
        if state_bytes:
            _within(chunks, fields.state_offset, state_bytes)
        address, shift, stride = _layout(chunks)
        return AdmitJob(self._handle, address, shift, stride, ids.data_ptr(), ids.numel(), rows.data_ptr(), out.data_ptr(),
                        dim, weights_offset, int(weights_dtype == torch.float16), fields.access[1], fields.access[0],
                        fields.version[0], fields.version[1], 0, fields.state_offset, state_bytes, state.data_ptr(),
                        init_key, float(uniform[0]), float(uniform[1]), fresh.data_ptr(), fresh.numel(), 0,
                        _keep=(ids, rows, out, fresh, state))

    def insert(self, ids: torch.Tensor, rows: torch.Tensor, chunks: Chunks) -> None:
        """Adds ``ids`` (unique, absent, already written to their rows' records) pointing at ``rows``."""
        ids = _check(ids, torch.int64, "ids").contiguous()
        rows = _rows(chunks, rows, None, 0, 8)
        if ids.numel() != rows.numel():
            raise ValueError(f"Index.insert: {ids.numel()} ids but {rows.numel()} rows")
        if rows.numel() and int(rows.min()) < 0:
            raise ValueError("Index.insert: rows must be >= 0")
        if self._library.lp_index_insert(self._handle, *_layout(chunks), ids.data_ptr(), rows.data_ptr(), ids.numel()):
            self.remove(ids, chunks)
            raise MemoryError(f"out of memory while indexing {ids.numel()} new ids")

    def reserve(self, rows: int, chunks: Chunks) -> None:
        """Sizes the index for ``rows`` ids in all, so that inserting them rehashes nothing."""
        if self._library.lp_index_reserve(self._handle, *_layout(chunks), rows):
            raise MemoryError(f"out of memory while sizing an id index for {rows} ids")

    def remove(self, ids: torch.Tensor, chunks: Chunks) -> int:
        """Drops the ``ids`` present; returns how many were."""
        ids = _check(ids, torch.int64, "ids").contiguous()
        return self._library.lp_index_remove(self._handle, *_layout(chunks), ids.data_ptr(), ids.numel())


class FindJob(ctypes.Structure):
    """One table's part of :func:`find_many` (``kernels.c``'s ``find_job_t``)."""

    _fields_ = [("index", _P), ("chunks", _P), ("shift", _I64), ("stride", _I64), ("ids", _P), ("n", _I64), ("rows", _P),
                ("offset", _I64), ("width", _I64), ("out", _P), ("touch_offset", _I64), ("value", ctypes.c_int32),
                ("add", ctypes.c_int32), ("missing", _I64)]


class UpdateJob(ctypes.Structure):
    """One table's part of :func:`update_many` (``kernels.c``'s ``update_job_t``)."""

    _fields_ = [("index", _P), ("chunks", _P), ("shift", _I64), ("stride", _I64), ("ids", _P), ("n", _I64), ("rows", _P),
                ("grads", _P), ("dim", _I64), ("weights_offset", _I64), ("state_offset", _I64), ("version_offset", _I64),
                ("weights_half", ctypes.c_int32), ("rule", ctypes.c_int32), ("version", ctypes.c_int32),
                ("bounded", ctypes.c_int32), ("lr", ctypes.c_float), ("eps", ctypes.c_float), ("weight_decay", ctypes.c_float),
                ("bound", ctypes.c_float), ("applied", _I64), ("absent", _I64), ("not_unique", ctypes.c_int32)]


@dataclass(frozen=True)
class AdmitFields:
    """Where :func:`admit` writes a new record: ``weights`` (offset, dtype), ``access`` and ``version`` (offset, value),
    ``state``: one record's initial optimizer state (float32, possibly empty) at ``state_offset``."""

    weights: tuple[int, torch.dtype]
    access: tuple[int, int]
    version: tuple[int, int]
    state: torch.Tensor
    state_offset: int


class AdmitJob(ctypes.Structure):
    """One table's :func:`admit` call (``kernels.c``'s ``admit_job_t``); keeps the tensors it points at alive."""

    _fields_ = [("index", _P), ("chunks", _P), ("shift", _I64), ("stride", _I64), ("ids", _P), ("n", _I64), ("rows", _P),
                ("out", _P), ("dim", _I64), ("weights_offset", _I64), ("weights_half", ctypes.c_int32),
                ("access_value", ctypes.c_int32), ("access_offset", _I64), ("version_offset", _I64),
                ("version", ctypes.c_int32), ("pad", ctypes.c_int32), ("state_offset", _I64), ("state_bytes", _I64),
                ("state", _P), ("init_key", _I64), ("low", ctypes.c_double), ("high", ctypes.c_double), ("fresh", _P),
                ("fresh_count", _I64), ("used", _I64)]

    def __init__(self, *values, _keep: tuple = ()) -> None:
        super().__init__(*values)
        self._keep = _keep


RULES = {"SGD": 0, "Adagrad": 1, "RowwiseAdagrad": 2}
"""The sparse rules :func:`update_many` runs in C (``remote_ps/store/optimizers.py`` names; Adam runs in torch)."""


SIGNATURES = {
    "lp_gather": ([_P, _I64, _I64, _I64, _I64, _P, _I64, _P], None),
    "lp_scatter": ([_P, _I64, _I64, _I64, _I64, _P, _I64, _P], None),
    "lp_set_i32": ([_P, _I64, _I64, _I64, _P, _I64, ctypes.c_int32, ctypes.c_int32], None),
    "lp_select_at_most": ([_P, _I64, _I64, ctypes.c_int32, ctypes.c_int32, _I64, _P, _P], _I64),
    "lp_fields": ([_P, _I64, _I64, _P, _I64, _I64, _P, _P, _P, ctypes.c_int32], None),
    "lp_index_new": ([], _P),
    "lp_index_free": ([_P], None),
    "lp_index_info": ([_P, _P], None),
    "lp_index_find": ([_P, _P, _I64, _I64, _P, _I64, _P, _I64, _I64, _P, _I64, ctypes.c_int32, ctypes.c_int32], None),
    "lp_index_insert": ([_P, _P, _I64, _I64, _P, _P, _I64], _I64),
    "lp_index_remove": ([_P, _P, _I64, _I64, _P, _I64], _I64),
    "lp_index_reserve": ([_P, _P, _I64, _I64, _I64], _I64),
    "lp_find_many": ([_P, _I64], None),
    "lp_update_many": ([_P, _I64], None),
    "lp_row_bits": ([_P, _I64, _I64, _I64, _P], None),
    "lp_uniform_rows": ([_P, _I64, _I64, _I64, ctypes.c_double, ctypes.c_double, _P], None),
    "lp_first_foreign": ([_P, _I64, _I64, _I64], _I64),
    "lp_admit": ([_P], _I64),
    "lp_unique_by_table": ([_P, _P, _I64, _P, _P, _P], _I64),
    "lp_dmap_new": ([], _P),
    "lp_dmap_free": ([_P], None),
    "lp_dmap_info": ([_P, _P], None),
    "lp_dmap_insert": ([_P, _P, _P, _I64], _I64),
    "lp_dmap_find": ([_P, _P, _I64, _P, _P], None),
    "lp_dmap_remove": ([_P, _P, _P, _I64], _I64),
    "lp_dmap_move": ([_P, _P, _P, _P, _I64], _I64),
    "lp_set_bits": ([_P, _I64, _I64, _P, _I64, ctypes.c_int32, _P], _I64),
    "lp_get_bits": ([_P, _I64, _I64, _P, _I64, _P], None),
    "lp_read_records": ([_P, _P, _P, _P, _I64, _I64, _P, _I64, _P, _P, _P], _I64),
    "lp_map_file": ([_I64, _I64, _I64, _P], _P),
    "lp_map_pages": ([_P, _I64, _I64], _I64),
    "lp_dmap_save_begin": ([_P, _I64], _I64),
    "lp_dmap_save_part": ([_P, _I64, _P, _I64, _P], _I64),
    "lp_dmap_save_end": ([_P], None),
    "lp_dmap_adopt": ([_P, _I64, _P, _I64, _I64], _I64),
    "lp_unmap_file": ([_P, _I64], None),
}
"""Argument and result types of every function of ``kernels.c`` called here (``tests/ops/test_native_interface.py``
checks them, and the job structs above, against the C source)."""


def find_many(jobs: list[FindJob]) -> None:
    """Lookups of several tables in one call (each job: :meth:`Index.find` with a copy and a touch); sets ``missing``.

    The jobs' buffers are checked by their builder (``Index.find_job``); the caller holds every table's lock.
    """
    array = (FindJob * len(jobs))(*jobs)
    _require().lp_find_many(array, len(jobs))
    for job, done in zip(jobs, array):
        job.missing = done.missing


def update_many(jobs: list[UpdateJob]) -> None:
    """Sparse updates of several tables in one call; sets each job's ``applied``, ``absent`` and ``not_unique`` (ids
    not strictly increasing: that job applied nothing). The caller holds every table's lock."""
    array = (UpdateJob * len(jobs))(*jobs)
    _require().lp_update_many(array, len(jobs))
    for job, done in zip(jobs, array):
        job.applied, job.absent, job.not_unique = done.applied, done.absent, done.not_unique


def admit(job: AdmitJob) -> int:
    """Runs an :meth:`Index.admit_job`; returns the rows of ``fresh`` it took. MemoryError when the index cannot grow,
    ValueError when ``fresh`` runs out; the ids admitted until then stay, and ``job.used`` counts them. The caller
    holds the table's lock."""
    failed = _require().lp_admit(ctypes.byref(job))
    if failed == -2:
        raise ValueError(f"admit: {job.fresh_count} fresh rows were too few for the absent ids")
    if failed:
        raise MemoryError(f"out of memory while indexing new ids ({job.used} admitted before)")
    return job.used


def row_bits(ids: torch.Tensor, key: int, columns: int) -> torch.Tensor:
    """``[n, columns]`` int64 words ``mix64(mix64(id ^ key) + column * 0x9E3779B97F4A7C15)`` (see initializers.py)."""
    ids = _check(ids, torch.int64, "ids").contiguous()
    out = torch.empty(ids.numel(), columns, dtype=torch.int64)
    _require().lp_row_bits(ids.data_ptr(), ids.numel(), key, columns, out.data_ptr())
    return out


def uniform_rows(ids: torch.Tensor, key: int, columns: int, low: float, high: float) -> torch.Tensor:
    """``[n, columns]`` float32 Uniform(low, high) initial rows of ``ids`` (see initializers.py), bit for bit."""
    ids = _check(ids, torch.int64, "ids").contiguous()
    out = torch.empty(ids.numel(), columns, dtype=torch.float32)
    _require().lp_uniform_rows(ids.data_ptr(), ids.numel(), key, columns, float(low), float(high), out.data_ptr())
    return out


class DiskMap:
    """The disk tier's id map (``kernels.c``): id -> slot on disk, 8 bytes an id, the ids themselves left on disk.

    :meth:`find` answers a slot whose entry's fingerprint matches the id; the caller confirms it against the id in
    the record it reads there and, on a false match (odds of about 2^-32), asks again with ``skip`` one higher.

    Example::

        disk_map = native.DiskMap()
        disk_map.insert(ids, slots)
        assert torch.equal(disk_map.find(ids), slots)
    """

    def __init__(self) -> None:
        self._library = _require()
        self._handle = self._library.lp_dmap_new()
        if not self._handle:
            raise MemoryError("cannot allocate a disk id map")

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._library.lp_dmap_free(handle)
        for address, nbytes in getattr(self, "_borrowed", ()):  # after the map that pointed into them
            self._library.lp_unmap_file(address, nbytes)

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
        address = map_file(fd, nbytes, private=True)
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
        ids = _check(ids, torch.int64, "ids").contiguous()
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


def set_bits(pages: torch.Tensor, shift: int, slots: torch.Tensor, value: bool) -> torch.Tensor:
    """For every slot, bit ``slot & 7`` of byte ``(slot & (2**shift - 1)) >> 3`` of the bits at address
    ``pages[slot >> shift]`` becomes ``value`` (little-endian bit order, as ``numpy.packbits(..., bitorder="little")``;
    ``2**shift`` bits a page, each a live tensor of the caller's). Returns, for each page, how many of its bits
    changed. ValueError naming the first slot whose page is absent (address 0, or past ``pages``), the bits of the
    slots before it set."""
    slots = _check(slots, torch.int64, "slots").contiguous()
    _check(pages, torch.int64, "pages")
    if not pages.is_contiguous():
        raise ValueError("pages must be contiguous")
    changed = torch.zeros(pages.numel(), dtype=torch.int64)
    failed = _require().lp_set_bits(pages.data_ptr(), pages.numel(), shift, slots.data_ptr(), slots.numel(), int(value),
                                    changed.data_ptr())
    if failed >= 0:
        raise ValueError(f"slot {int(slots[failed])} has no bits (its page {int(slots[failed]) >> shift} is absent)")
    return changed


def select_at_most(values: torch.Tensor, threshold: int, free_mark: int, count: int) -> tuple[torch.Tensor, int]:
    """The positions (int64, in order) of up to ``count`` values of ``values`` (1-D int32, any stride: a field of
    records) that are at most ``threshold`` and not ``free_mark``, and the position after the last one taken (the
    length where fewer were found; 0 for a ``count`` of 0). Reads no further than that position."""
    _check(values, torch.int32, "values")
    if count < 0:
        raise ValueError(f"count must not be negative, got {count}")
    out = torch.empty(min(count, values.numel()), dtype=torch.int64)
    stop = ctypes.c_int64(0)
    found = _require().lp_select_at_most(values.data_ptr(), values.stride(0), values.numel(), threshold, free_mark,
                                         out.numel(), out.data_ptr(), ctypes.byref(stop))
    return out[:found], stop.value


def get_bits(pages: torch.Tensor, shift: int, slots: torch.Tensor) -> torch.Tensor:
    """For every slot, whether its bit (as :func:`set_bits` addresses it) is set: a bool tensor; False where the
    slot is negative or its page absent."""
    slots = _check(slots, torch.int64, "slots").contiguous()
    _check(pages, torch.int64, "pages")
    if not pages.is_contiguous():
        raise ValueError("pages must be contiguous")
    out = torch.empty(slots.numel(), dtype=torch.uint8)
    _require().lp_get_bits(pages.data_ptr(), pages.numel(), shift, slots.data_ptr(), slots.numel(), out.data_ptr())
    return out.view(torch.bool)


def map_file(fd: int, nbytes: int, private: bool = False) -> int:
    """The address of the first ``nbytes`` of file ``fd`` mapped read-only and shared (see :func:`read_records`), or
    ``private``: a copy on write (see :meth:`DiskMap.adopt`); OSError when it cannot be mapped. :func:`unmap_file`
    ends it."""
    error = ctypes.c_int64(0)
    address = _require().lp_map_file(fd, nbytes, int(private), ctypes.byref(error))
    if not address:
        code = error.value or errno.ENOMEM
        raise OSError(code, f"cannot map {nbytes} bytes of a file: {os.strerror(code)}")
    return address


def unmap_file(address: int, nbytes: int) -> None:
    """Ends a mapping of :func:`map_file`."""
    _require().lp_unmap_file(address, nbytes)


def map_pages(address: int, nbytes: int, drop: bool = False) -> None:
    """Puts ``nbytes`` of a :func:`map_file` mapping at ``address`` into the process's page tables (a read of them then
    costs no fault), or with ``drop`` takes them out again (the page cache keeps them); OSError when it cannot."""
    code = _require().lp_map_pages(address, nbytes, int(drop))
    if code:
        raise OSError(code, f"cannot {'drop' if drop else 'populate'} {nbytes} mapped bytes: {os.strerror(code)}")


def read_records(fds: torch.Tensor, bases: torch.Tensor, mapped: torch.Tensor, reads: torch.Tensor, shift: int,
                 slots: torch.Tensor, out: torch.Tensor, into: Optional[torch.Tensor] = None) -> None:
    """``out[into[i]]`` (``into`` None: ``out[i]``) = the record of ``slots[i]`` (``< 0``: left as it is): ``out``'s
    row size at byte ``(slot & (2**shift - 1)) * row size`` of the segment ``slot >> shift``: copied from its mapping
    at ``bases[segment]`` when among its first ``mapped[segment]`` records (populated: :func:`map_pages`), else read
    from the file ``fds[segment]``; ``reads[segment]`` counts the records read. The slots are read in the order
    given (sorted, they share pages). OSError naming the slot when a record cannot be read whole."""
    slots = _check(slots, torch.int64, "slots").contiguous()
    for name, table in (("fds", fds), ("bases", bases), ("mapped", mapped), ("reads", reads)):
        _check(table, torch.int64, name)
        if not table.is_contiguous() or table.numel() != fds.numel():
            raise ValueError(f"read_records: {name} must be contiguous, one per segment ({fds.numel()})")
    rows = slots.numel() if into is None else out.shape[0]
    if out.dtype != torch.uint8 or out.dim() != 2 or out.shape[0] != rows or not out.is_contiguous():
        raise ValueError(f"read_records: out must be a contiguous uint8 [{rows}, record bytes] tensor")
    if into is not None:
        into = _check(into, torch.int64, "into").contiguous()
        if into.numel() != slots.numel() or (into.numel() and (int(into.min()) < 0 or int(into.max()) >= rows)):
            raise ValueError(f"read_records: into must hold a row of out (0..{rows - 1}) for each of the {slots.numel()} slots")
    if slots.numel() and int(slots.max()) >> shift >= fds.numel():
        raise ValueError(f"slot {int(slots.max())} is past the {fds.numel()} files")
    error = ctypes.c_int64(0)
    failed = _require().lp_read_records(fds.data_ptr(), bases.data_ptr(), mapped.data_ptr(), reads.data_ptr(), shift, out.shape[1],
                                        slots.data_ptr(), slots.numel(), into.data_ptr() if into is not None else None,
                                        out.data_ptr(), ctypes.byref(error))
    if failed:
        slot = int(slots[-failed - 1])
        reason = os.strerror(error.value) if error.value else "the file ends before it"
        raise OSError(error.value or errno.EIO, f"the record of disk slot {slot} could not be read whole (file {slot >> shift}): {reason}")


def _pair(ids: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _check(ids, torch.int64, "ids").contiguous()
    other = _check(other, torch.int64, "slots").contiguous()
    if other.numel() != ids.numel():
        raise ValueError(f"{ids.numel()} ids and {other.numel()} slots")
    return ids, other


def first_foreign(ids: torch.Tensor, num_shards: int, shard: int) -> int:
    """Position of the first id that :func:`~lightning_persia.ops.hashing.shard_of` puts on another shard, or -1."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    ids = _check(ids, torch.int64, "ids").contiguous()
    return _require().lp_first_foreign(ids.data_ptr(), ids.numel(), num_shards, shard)


def _check(tensor: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """The C loops read raw CPU buffers of one dtype: anything else would be read (or written) out of bounds."""
    if tensor.dtype != dtype or tensor.device.type != "cpu" or tensor.dim() != 1:
        raise ValueError(f"{what} must be a 1-D {dtype} CPU tensor, got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
    if what == "chunks" and not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous: the C code reads it in place")
    return tensor


def _row_bytes(data: torch.Tensor) -> int:
    return math.prod(data.shape[1:]) * data.element_size()


def _layout(chunks: Chunks) -> tuple[int, int, int]:
    _check(chunks.addresses, torch.int64, "chunks")
    return chunks.addresses.data_ptr(), chunks.shift, chunks.stride


def _within(chunks: Chunks, offset: int, width: int) -> None:
    if offset < 0 or offset + width > chunks.stride:
        raise ValueError(f"a field of {width} bytes at offset {offset} does not fit in records of {chunks.stride} bytes")


def _rows(chunks: Chunks, rows: torch.Tensor, data: Optional[torch.Tensor], offset: int, width: int = 0) -> torch.Tensor:
    """Checked row numbers: the C loops write wherever a row number points, so none may point past the chunks."""
    rows = _check(rows, torch.int64, "rows").contiguous()
    if data is not None:
        if data.device.type != "cpu" or not data.is_contiguous() or data.shape[0] != rows.numel():
            raise ValueError(f"a contiguous CPU tensor of {rows.numel()} rows is needed, got {tuple(data.shape)} on {data.device}")
        width = _row_bytes(data)
    _within(chunks, offset, width)
    if rows.numel() and int(rows.max()) >= chunks.capacity:
        raise ValueError(f"row {int(rows.max())} is past the {chunks.capacity} rows of the chunks")
    return rows


def unique_by_table(ids: torch.Tensor, counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each table's unique ids (ascending), how many per table, and each id's position among its table's unique ids,
    for ``ids`` held table after table (``counts[t]`` ids of table ``t``): ``lightning_persia.ops.dedup``'s result."""
    ids = _check(ids, torch.int64, "ids").contiguous()
    if sum(counts) != ids.numel():
        raise ValueError(f"unique_by_table: counts add up to {sum(counts)} for {ids.numel()} ids")
    starts = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
    unique = torch.empty_like(ids)
    found = torch.empty(len(counts), dtype=torch.int64)
    inverse = torch.empty_like(ids)
    if _require().lp_unique_by_table(ids.data_ptr(), starts.data_ptr(), len(counts), unique.data_ptr(), found.data_ptr(), inverse.data_ptr()):
        raise MemoryError(f"out of memory while deduplicating {ids.numel()} ids")
    return unique[: int(found.sum())], found, inverse


def _require() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError("the native kernels are not available (see lightning_persia.ops.native.available)")
    return library


@functools.lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_built_library()))
    except OSError as err:
        warnings.warn(f"lightning_persia: native kernels unavailable ({err}); using the slower tensor implementation")
        return None
    for name, (arguments, result) in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, result
    return library


def _built_library() -> Path:
    """The library built from this ``kernels.c``; OSError naming what to do when there is none."""
    name = library_name()
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _DIRECTORY / f"{name}{suffix}"
        if path.is_file():
            return path
    raise OSError(
        f"no {name}*.so in {_DIRECTORY} built from this kernels.c: installing the package builds it (a build "
        "without a working C compiler skips it, and says so), `make native` does in a source checkout"
    )
