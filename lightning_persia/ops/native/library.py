"""A folder's native kernels: the shared library built from its C sources, loaded on first use, called through ctypes.

``pip install``, ``python -m build`` and ``pip install -e .`` compile each folder's library into it (``setup.py``);
in a source checkout ``make native`` does. Its name carries a digest of the folder's sources (``_source.py``), so a
library built from another version of them is never loaded. Without the library (no C compiler at build time, or a
source changed since the build), or with ``LIGHTNING_PERSIA_NATIVE=0``, every caller keeps its tensor implementation
(same results, slower); the folder package's ``available()`` tells which is in use.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import math
import os
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

from lightning_persia.ops.native._source import library_name

NATIVE_ENV = "LIGHTNING_PERSIA_NATIVE"
"""``LIGHTNING_PERSIA_NATIVE=0`` keeps the tensor implementation even where the libraries are built."""

Signatures = dict[str, tuple[list, object]]
"""C function name -> (argument ctypes, result ctypes)."""


class Library:
    """The library built from the C sources of ``folder``. Each binding module declares the ctypes signatures of
    its C file's functions (:meth:`declare`) when it is imported, and calls them through :meth:`require`.

    Example::

        LIBRARY = Library(Path(__file__).parent, "the trainer's native kernels", "lightning_persia.ops.native")
        LIBRARY.declare({"lp_first_foreign": ([c_void_p, c_int64, c_int64, c_int64], c_int64)})
        if LIBRARY.available():
            LIBRARY.require().lp_first_foreign(...)
    """

    def __init__(self, folder: Path, what: str, package: str) -> None:
        self.folder = folder
        self._what = what
        self._package = package
        self._signatures: Signatures = {}
        self._lock = threading.Lock()
        self._loaded = False
        self._library: Optional[ctypes.CDLL] = None

    def declare(self, signatures: Signatures) -> None:
        """Declares the argument and result types of the functions named (applied now if the library is loaded)."""
        with self._lock:
            self._signatures.update(signatures)
            if self._library is not None:
                _apply(self._library, signatures)

    def available(self) -> bool:
        """True when the library is loaded (the first call loads it, or warns why it cannot)."""
        return self._load() is not None

    def require(self) -> ctypes.CDLL:
        """The loaded library; RuntimeError when there is none."""
        library = self._load()
        if library is None:
            raise RuntimeError(f"{self._what} are not available (see {self._package}.available)")
        return library

    def built(self) -> Path:
        """The library built from this folder's sources; OSError naming what to do when there is none."""
        name = library_name(self.folder)
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = self.folder / f"{name}{suffix}"
            if path.is_file():
                return path
        raise OSError(
            f"no {name}*.so in {self.folder} built from the sources there: installing the package builds it (a build "
            "without a working C compiler skips it, and says so), `make native` does in a source checkout"
        )

    def _load(self) -> Optional[ctypes.CDLL]:
        if self._loaded:
            return self._library
        with self._lock:
            if not self._loaded:
                self._library = self._open()
                self._loaded = True
        return self._library

    def _open(self) -> Optional[ctypes.CDLL]:
        if os.environ.get(NATIVE_ENV, "1") == "0":
            return None
        try:
            library = ctypes.CDLL(str(self.built()))
        except OSError as err:
            warnings.warn(f"lightning_persia: {self._what} unavailable ({err}); using the slower tensor implementation")
            return None
        _apply(library, self._signatures)
        return library


class NativeObject:
    """A C object that this Python object owns: made by the library's ``<prefix>_new()`` (NULL: out of memory), freed
    by its ``<prefix>_free`` when this object is collected. Subclasses call the library on ``self._handle``."""

    def __init__(self, library: Library, prefix: str, what: str) -> None:
        self._library = library.require()
        self._free = getattr(self._library, f"{prefix}_free")
        self._handle = getattr(self._library, f"{prefix}_new")()
        if not self._handle:
            raise MemoryError(f"cannot allocate {what}")

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._free(handle)


def _apply(library: ctypes.CDLL, signatures: Signatures) -> None:
    for name, (arguments, result) in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, result


def check(tensor: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``tensor``, or ValueError naming ``what`` unless it is a 1-D ``dtype`` CPU tensor: the C loops read raw CPU
    buffers of one dtype, and anything else would be read (or written) out of bounds."""
    if tensor.dtype != dtype or tensor.device.type != "cpu" or tensor.dim() != 1:
        raise ValueError(f"{what} must be a 1-D {dtype} CPU tensor, got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
    return tensor


def row_bytes(data: torch.Tensor) -> int:
    """Bytes of one row (``data[i]``) of a contiguous tensor."""
    return math.prod(data.shape[1:]) * data.element_size()
