"""An embedding worker reads tensors straight out of its trainer's memory (Linux ``process_vm_readv``).

A batch's ids and a step's gradient live in the trainer's ordinary memory. Handing them over in a shared buffer costs
the trainer a copy of each on its own threads (426k ids and ~150k rows of gradient a step at batch 16,384), the very
per-id work the workers exist to take off it; read this way, the one copy is the worker's. The trainer keeps each
tensor alive, unchanged, until the worker has answered the call that names it.

The kernel allows the read when the worker may trace the trainer: same user and, under Yama's
``ptrace_scope`` >= 1, not for a child reading its parent. Where it is refused the worker says so when it starts
(:func:`readable`) and the trainer copies into shared buffers instead.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Optional

import torch

_libc: Optional[ctypes.CDLL] = None


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _process_vm_readv() -> "ctypes._NamedFuncPointer":
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.process_vm_readv.restype = ctypes.c_ssize_t
        _libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                                           ctypes.c_ulong, ctypes.c_ulong]
    return _libc.process_vm_readv


def read_into(pid: int, address: int, out: torch.Tensor) -> torch.Tensor:
    """Fills the contiguous CPU tensor ``out`` with ``out.nbytes`` bytes of process ``pid`` at ``address``."""
    call = _process_vm_readv()
    done, total = 0, out.numel() * out.element_size()
    while done < total:  # the kernel may stop short at a page it cannot read at once
        local, remote = _IoVec(out.data_ptr() + done, total - done), _IoVec(address + done, total - done)
        got = call(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            error = ctypes.get_errno()
            raise OSError(error, f"could not read {total - done} bytes of process {pid} at {address + done:#x}: {os.strerror(error)}")
        done += got
    return out


def read(pid: int, address: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh tensor of ``numel`` elements of ``dtype`` read from process ``pid`` at ``address``."""
    return read_into(pid, address, torch.empty(numel, dtype=dtype))


def readable(pid: int, address: int, expected: bytes) -> bool:
    """Whether this process may read process ``pid``'s memory: ``expected`` is what lies at ``address`` there."""
    try:
        got = read_into(pid, address, torch.empty(len(expected), dtype=torch.uint8))
    except (OSError, AttributeError):  # refused (permissions, seccomp), or no such call on this system
        return False
    return bytes(got.tolist()) == expected
