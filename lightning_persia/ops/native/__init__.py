"""Native kernels (``kernels.c``), compiled with the system C compiler on first use and called through ctypes.

A table operation of a training step touches a few hundred ids; in tensor ops its index probe costs a
dozen dispatches per pass and dominated the shard's CPU. The C loop does the same work in microseconds.
The library is built once per source version into ``$LIGHTNING_PERSIA_CACHE`` (default
``~/.cache/lightning_persia``)/native. Without a C compiler, or with ``LIGHTNING_PERSIA_NATIVE=0``, every
caller keeps its tensor implementation (same results, slower); :func:`available` tells which is in use.

Example::

    from lightning_persia.ops import native
    if native.available():
        first = native.first_foreign(ids, num_shards=2, shard=0)
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c99"]
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


_BUILD_LOCK = threading.Lock()  # the gRPC handler threads of a shard all ask at once on the first requests


@functools.lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    if os.environ.get("LIGHTNING_PERSIA_NATIVE", "1") == "0":
        return None
    try:
        with _BUILD_LOCK:
            library = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError) as err:
        warnings.warn(f"lightning_persia: native kernels unavailable ({err}); using the slower tensor implementation")
        return None
    library.lp_index_find.argtypes = [_P, _I64, _P, _P, _I64, _P, _P]
    library.lp_index_find.restype = None
    library.lp_index_place.argtypes = [_P, _I64, _P, _P, _I64]
    library.lp_index_place.restype = _I64
    library.lp_first_foreign.argtypes = [_P, _I64, _I64, _I64]
    library.lp_first_foreign.restype = _I64
    return library


def _build() -> Path:
    source = _SOURCE.read_bytes()
    compiler = shlex.split(os.environ["CC"]) if os.environ.get("CC") else [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not compiler:
        raise RuntimeError("no C compiler found (set CC)")
    digest = hashlib.sha1(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("LIGHTNING_PERSIA_CACHE", Path.home() / ".cache" / "lightning_persia")) / "native"
    target = cache / f"kernels-{digest}-{platform.machine()}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Several shard processes may build at once: each compiles to its own file, the rename is atomic.
    fd, partial = tempfile.mkstemp(dir=cache, suffix=".so.partial")
    os.close(fd)
    try:
        result = subprocess.run([*compiler, *_FLAGS, str(_SOURCE), "-o", partial], capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"{' '.join(compiler)} could not build {_SOURCE.name}: {result.stderr.strip()[-800:]}")
        os.chmod(partial, 0o755)  # mkstemp's 0600 would hide the library from other users of a shared cache
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target
