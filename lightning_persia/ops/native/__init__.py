"""Native kernels (``kernels.c``), compiled into a shared library when the package is built, called through ctypes.

A table operation of a training step touches a few hundred ids; in tensor ops its index probe costs a
dozen dispatches per pass and dominated the shard's CPU. The C loop does the same work in microseconds.
``pip install``, ``python -m build`` and ``pip install -e .`` compile the library into this folder (``setup.py``);
in a source checkout ``make native`` does. Its name carries a digest of ``kernels.c``, so a library built from
another version of the source is never loaded. Without the library (no C compiler at build time, or a source
changed since the build), or with ``LIGHTNING_PERSIA_NATIVE=0``, every caller keeps its tensor implementation
(same results, slower); :func:`available` tells which is in use.

Example::

    from lightning_persia.ops import native
    if native.available():
        first = native.first_foreign(ids, num_shards=2, shard=0)
"""
from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
import warnings
from pathlib import Path
from typing import Optional

import torch

from lightning_persia.ops.native._source import library_name

_DIRECTORY = Path(__file__).parent
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def available() -> bool:
    """True when the native kernels are loaded (and used by the id index and the shard store)."""
    return _library() is not None


def index_find(slots: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row of each id in an index (``-1`` when absent) and the slot where its probe ended."""
    _check(slots, torch.int32, "slots")
    _check(keys, torch.int64, "keys")
    ids = _check(ids, torch.int64, "ids").contiguous()
    rows = torch.empty_like(ids)
    positions = torch.empty_like(ids)
    _require().lp_index_find(slots.data_ptr(), slots.numel(), keys.data_ptr(), ids.data_ptr(), ids.numel(),
                             rows.data_ptr(), positions.data_ptr())
    return rows, positions


def index_place(slots: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> int:
    """Writes ``rows`` (int32) into the first free slot of each id's chain; returns how many were tombstones."""
    _check(slots, torch.int32, "slots")
    ids, rows = _check(ids, torch.int64, "ids").contiguous(), rows.to(torch.int32).contiguous()
    if ids.numel() != rows.numel():
        raise ValueError(f"index_place: {ids.numel()} ids but {rows.numel()} rows")
    return _require().lp_index_place(slots.data_ptr(), slots.numel(), ids.data_ptr(), rows.data_ptr(), ids.numel())


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
    if what in ("slots", "keys") and not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous: it is written or read in place")
    return tensor


def _require() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError("the native kernels are not available (see lightning_persia.ops.native.available)")
    return library


@functools.lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    if os.environ.get("LIGHTNING_PERSIA_NATIVE", "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_built_library()))
    except OSError as err:
        warnings.warn(f"lightning_persia: native kernels unavailable ({err}); using the slower tensor implementation")
        return None
    library.lp_index_find.argtypes = [_P, _I64, _P, _P, _I64, _P, _P]
    library.lp_index_find.restype = None
    library.lp_index_place.argtypes = [_P, _I64, _P, _P, _I64]
    library.lp_index_place.restype = _I64
    library.lp_first_foreign.argtypes = [_P, _I64, _I64, _I64]
    library.lp_first_foreign.restype = _I64
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
