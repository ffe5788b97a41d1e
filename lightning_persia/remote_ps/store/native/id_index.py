"""Bindings of ``id_index.c``: the id index of a table (id -> row), and the jobs of ``jobs.c`` that use it."""
from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

import torch

from lightning_persia.ops.native.library import NativeObject, check, row_bytes
from lightning_persia.remote_ps.store import native
from lightning_persia.remote_ps.store.native import jobs
from lightning_persia.remote_ps.store.native.rows import Chunks

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32

SIGNATURES = {
    "lp_index_new": ([], _P),
    "lp_index_free": ([_P], None),
    "lp_index_info": ([_P, _P], None),
    "lp_index_find": ([_P, _P, _I64, _I64, _P, _I64, _P, _I64, _I64, _P, _I64, _I32, _I32], None),
    "lp_index_insert": ([_P, _P, _I64, _I64, _P, _P, _I64], _I64),
    "lp_index_remove": ([_P, _P, _I64, _I64, _P, _I64], _I64),
    "lp_index_reserve": ([_P, _P, _I64, _I64, _I64], _I64),
}
"""Argument and result types of every function of ``id_index.c`` (tests/remote_ps/store/test_store_native_interface.py
checks them)."""

native.LIBRARY.declare(SIGNATURES)


class IndexInfo(NamedTuple):
    """What :meth:`Index.info` reads of the index."""

    present: int  #: ids present
    nbytes: int  #: memory the index holds
    rebuilds: int  #: partition rebuilds so far (each rehashes about 1/4096 of the ids)
    put_off: int  #: rebuilds an insert left to a later insert so far, its budget of rows to rehash spent
    inserted: int  #: ids inserted so far: while it stays the same, no absent id became present


class Index(NativeObject):
    """The native id index of one table (``id_index.c``): id -> row. A row's id is read from the first 8 bytes of its
    record in ``chunks``.

    Example::

        index = Index()
        index.insert(ids, rows, chunks)      # the records of rows already hold ids
        assert torch.equal(index.find(ids, chunks), rows)
    """

    def __init__(self) -> None:
        super().__init__(native.LIBRARY, "lp_index", "an id index")

    def info(self) -> IndexInfo:
        """The index's figures now."""
        out = (ctypes.c_int64 * 5)()
        self._library.lp_index_info(self._handle, out)
        return IndexInfo(*out)

    def find(
        self, ids: torch.Tensor, chunks: Chunks, copy: Optional[tuple[int, torch.Tensor]] = None,
        touch: Optional[tuple[int, int, bool]] = None,
    ) -> torch.Tensor:
        """Row of each id, ``-1`` when absent.

        In the same pass, ``copy=(offset, out)``: ``out[i]`` = the field at ``offset`` of each row found;
        ``touch=(offset, value, add)``: the int32 field at ``offset`` of each row found becomes ``value`` (or grows by it).
        """
        ids = check(ids, torch.int64, "ids").contiguous()
        rows = torch.empty_like(ids)
        offset, width, out = 0, 0, None
        if copy is not None:
            offset, out = copy
            if not out.is_contiguous() or out.shape[0] != ids.numel() or out.device.type != "cpu":
                raise ValueError(f"find: out must be a contiguous CPU tensor of {ids.numel()} rows, got {tuple(out.shape)}")
            width = row_bytes(out)
            chunks.check_field(offset, width)
        touch_offset, value, add = touch if touch is not None else (-1, 0, False)
        if touch is not None:
            chunks.check_field(touch_offset, 4)
        self._library.lp_index_find(
            self._handle, *chunks.layout(), ids.data_ptr(), ids.numel(), rows.data_ptr(),
            offset, width, out.data_ptr() if out is not None else None, touch_offset, value, int(add),
        )
        return rows

    def find_job(self, ids: torch.Tensor, rows: torch.Tensor, chunks: Chunks, copy: tuple[int, torch.Tensor],
                 touch: Optional[tuple[int, int, bool]] = None) -> jobs.FindJob:
        """A :func:`~.jobs.find_many` job: as :meth:`find` into ``rows``; the tensors must outlive the call."""
        check(ids, torch.int64, "ids")
        check(rows, torch.int64, "rows")
        offset, out = copy
        if not (ids.is_contiguous() and rows.is_contiguous() and out.is_contiguous()) or rows.numel() != ids.numel() or \
                out.shape[0] != ids.numel() or out.device.type != "cpu":
            raise ValueError(f"find_job: contiguous CPU ids, rows and out of {ids.numel()} rows are needed")
        chunks.check_field(offset, row_bytes(out))
        touch_offset, value, add = touch if touch is not None else (-1, 0, False)
        if touch is not None:
            chunks.check_field(touch_offset, 4)
        address, shift, stride = chunks.layout()
        return jobs.FindJob(self._handle, address, shift, stride, ids.data_ptr(), ids.numel(), rows.data_ptr(), offset,
                       row_bytes(out), out.data_ptr(), touch_offset, value, int(add), 0)

    def update_job(self, ids: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, chunks: Chunks, rule: str,
                   weights: tuple[int, torch.dtype], state_offset: int, version: tuple[int, int], lr: float, eps: float,
                   weight_decay: float, bound: Optional[float]) -> jobs.UpdateJob:
        """An :func:`~.jobs.update_many` job for the rows of ``ids``; the tensors must outlive the call."""
        check(ids, torch.int64, "ids")
        check(rows, torch.int64, "rows")
        weights_offset, weights_dtype = weights
        dim = grads.shape[1] if grads.dim() == 2 else -1
        if grads.dtype != torch.float32 or dim < 1 or grads.shape[0] != ids.numel() or not grads.is_contiguous() or \
                not ids.is_contiguous() or rows.numel() != ids.numel() or weights_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"update_job: contiguous float32 grads [{ids.numel()}, dim], ids and rows of as many are needed")
        chunks.check_field(weights_offset, dim * torch.empty(0, dtype=weights_dtype).element_size())
        chunks.check_field(state_offset, 4 * (dim if rule == "Adagrad" else 1 if rule == "RowwiseAdagrad" else 0))
        chunks.check_field(version[0], 4)
        address, shift, stride = chunks.layout()
        return jobs.UpdateJob(self._handle, address, shift, stride, ids.data_ptr(), ids.numel(), rows.data_ptr(), grads.data_ptr(),
                         dim, weights_offset, state_offset, version[0], int(weights_dtype == torch.float16), jobs.RULES[rule],
                         version[1], int(bound is not None), lr, eps, weight_decay, bound or 0.0, 0, 0, 0)

    def admit_job(self, ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, chunks: Chunks, fresh: torch.Tensor,
                  fields: jobs.AdmitFields, init_key: int, uniform: tuple[float, float]) -> jobs.AdmitJob:
        """An :func:`~.jobs.admit` job: the ids of a training lookup whose ``rows`` are ``-1`` get rows of ``fresh``, in
        order (see ``jobs.c``); the tensors must outlive the call."""
        check(ids, torch.int64, "ids")
        check(rows, torch.int64, "rows")
        fresh = chunks.check_rows(fresh, None, 0, 8)
        weights_offset, weights_dtype = fields.weights
        dim = out.shape[1] if out.dim() == 2 else -1
        state = fields.state.contiguous()
        if not (ids.is_contiguous() and rows.is_contiguous() and out.is_contiguous()) or rows.numel() != ids.numel() or \
                out.shape[0] != ids.numel() or out.dtype != weights_dtype or weights_dtype not in (torch.float16, torch.float32) or \
                dim < 1 or state.dtype != torch.float32 or out.device.type != "cpu":
            raise ValueError(f"admit_job: contiguous CPU ids, rows and out [{ids.numel()}, dim] of the weights' dtype are needed")
        chunks.check_field(weights_offset, row_bytes(out))
        chunks.check_field(fields.access[0], 4)
        chunks.check_field(fields.version[0], 4)
        state_bytes = state.numel() * 4
        if state_bytes:
            chunks.check_field(fields.state_offset, state_bytes)
        address, shift, stride = chunks.layout()
        return jobs.AdmitJob(self._handle, address, shift, stride, ids.data_ptr(), ids.numel(), rows.data_ptr(), out.data_ptr(),
                        dim, weights_offset, int(weights_dtype == torch.float16), fields.access[1], fields.access[0],
                        fields.version[0], fields.version[1], 0, fields.state_offset, state_bytes, state.data_ptr(),
                        init_key, float(uniform[0]), float(uniform[1]), fresh.data_ptr(), fresh.numel(), 0,
                        _keep=(ids, rows, out, fresh, state))

    def insert(self, ids: torch.Tensor, rows: torch.Tensor, chunks: Chunks) -> None:
        """Adds ``ids`` (unique, absent, already written to their rows' records) pointing at ``rows``."""
        ids = check(ids, torch.int64, "ids").contiguous()
        rows = chunks.check_rows(rows, None, 0, 8)
        if ids.numel() != rows.numel():
            raise ValueError(f"Index.insert: {ids.numel()} ids but {rows.numel()} rows")
        if rows.numel() and int(rows.min()) < 0:
            raise ValueError("Index.insert: rows must be >= 0")
        if self._library.lp_index_insert(self._handle, *chunks.layout(), ids.data_ptr(), rows.data_ptr(), ids.numel()):
            self.remove(ids, chunks)
            raise MemoryError(f"out of memory while indexing {ids.numel()} new ids")

    def reserve(self, rows: int, chunks: Chunks) -> None:
        """Sizes the index for ``rows`` ids in all, so that inserting them rehashes nothing."""
        if self._library.lp_index_reserve(self._handle, *chunks.layout(), rows):
            raise MemoryError(f"out of memory while sizing an id index for {rows} ids")

    def remove(self, ids: torch.Tensor, chunks: Chunks) -> int:
        """Drops the ``ids`` present; returns how many were."""
        ids = check(ids, torch.int64, "ids").contiguous()
        return self._library.lp_index_remove(self._handle, *chunks.layout(), ids.data_ptr(), ids.numel())
