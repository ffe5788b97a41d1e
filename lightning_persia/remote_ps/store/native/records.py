"""Bindings of ``records.c``: the disk tier's records read from their segments (a copy from a mapping, or pread), the
segments' files mapped, and the bits of the slots that hold a live record."""
from __future__ import annotations

import ctypes
import errno
import os
from typing import Optional

import torch

from lightning_persia.ops.native.library import check
from lightning_persia.remote_ps.store import native

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32

SIGNATURES = {
    "lp_set_bits": ([_P, _I64, _I64, _P, _I64, _I32, _P], _I64),
    "lp_get_bits": ([_P, _I64, _I64, _P, _I64, _P], None),
    "lp_read_records": ([_P, _P, _P, _P, _I64, _I64, _P, _I64, _P, _P, _P], _I64),
    "lp_map_file": ([_I64, _I64, _I64, _P], _P),
    "lp_unmap_file": ([_P, _I64], None),
    "lp_map_pages": ([_P, _I64, _I64], _I64),
}
"""Argument and result types of every function of ``records.c`` (tests/remote_ps/store/test_store_native_interface.py
checks them)."""

native.LIBRARY.declare(SIGNATURES)


def set_bits(pages: torch.Tensor, shift: int, slots: torch.Tensor, value: bool) -> torch.Tensor:
    """For every slot, bit ``slot & 7`` of byte ``(slot & (2**shift - 1)) >> 3`` of the bits at address
    ``pages[slot >> shift]`` becomes ``value`` (little-endian bit order, as ``numpy.packbits(..., bitorder="little")``;
    ``2**shift`` bits a page, each a live tensor of the caller's). Returns, for each page, how many of its bits
    changed. ValueError naming the first slot whose page is absent (address 0, or past ``pages``), the bits of the
    slots before it set."""
    slots = check(slots, torch.int64, "slots").contiguous()
    check(pages, torch.int64, "pages")
    if not pages.is_contiguous():
        raise ValueError("pages must be contiguous")
    changed = torch.zeros(pages.numel(), dtype=torch.int64)
    failed = native.LIBRARY.require().lp_set_bits(pages.data_ptr(), pages.numel(), shift, slots.data_ptr(), slots.numel(), int(value),
                                    changed.data_ptr())
    if failed >= 0:
        raise ValueError(f"slot {int(slots[failed])} has no bits (its page {int(slots[failed]) >> shift} is absent)")
    return changed


def get_bits(pages: torch.Tensor, shift: int, slots: torch.Tensor) -> torch.Tensor:
    """For every slot, whether its bit (as :func:`set_bits` addresses it) is set: a bool tensor; False where the
    slot is negative or its page absent."""
    slots = check(slots, torch.int64, "slots").contiguous()
    check(pages, torch.int64, "pages")
    if not pages.is_contiguous():
        raise ValueError("pages must be contiguous")
    out = torch.empty(slots.numel(), dtype=torch.uint8)
    native.LIBRARY.require().lp_get_bits(pages.data_ptr(), pages.numel(), shift, slots.data_ptr(), slots.numel(), out.data_ptr())
    return out.view(torch.bool)


def map_file(fd: int, nbytes: int, private: bool = False) -> int:
    """The address of the first ``nbytes`` of file ``fd`` mapped read-only and shared (see :func:`read_records`), or
    ``private``: a copy on write (see :meth:`DiskMap.adopt`); OSError when it cannot be mapped. :func:`unmap_file`
    ends it."""
    error = ctypes.c_int64(0)
    address = native.LIBRARY.require().lp_map_file(fd, nbytes, int(private), ctypes.byref(error))
    if not address:
        code = error.value or errno.ENOMEM
        raise OSError(code, f"cannot map {nbytes} bytes of a file: {os.strerror(code)}")
    return address


def unmap_file(address: int, nbytes: int) -> None:
    """Ends a mapping of :func:`map_file`."""
    native.LIBRARY.require().lp_unmap_file(address, nbytes)


def map_pages(address: int, nbytes: int, drop: bool = False) -> None:
    """Puts ``nbytes`` of a :func:`map_file` mapping at ``address`` into the process's page tables (a read of them then
    costs no fault), or with ``drop`` takes them out again (the page cache keeps them); OSError when it cannot."""
    code = native.LIBRARY.require().lp_map_pages(address, nbytes, int(drop))
    if code:
        raise OSError(code, f"cannot {'drop' if drop else 'populate'} {nbytes} mapped bytes: {os.strerror(code)}")


def read_records(fds: torch.Tensor, bases: torch.Tensor, mapped: torch.Tensor, reads: torch.Tensor, shift: int,
                 slots: torch.Tensor, out: torch.Tensor, into: Optional[torch.Tensor] = None) -> None:
    """``out[into[i]]`` (``into`` None: ``out[i]``) = the record of ``slots[i]`` (``< 0``: left as it is): ``out``'s
    row size at byte ``(slot & (2**shift - 1)) * row size`` of the segment ``slot >> shift``: copied from its mapping
    at ``bases[segment]`` when among its first ``mapped[segment]`` records (populated: :func:`map_pages`), else read
    from the file ``fds[segment]``; ``reads[segment]`` counts the records read. The slots are read in the order
    given (sorted, they share pages). OSError naming the slot when a record cannot be read whole."""
    slots = check(slots, torch.int64, "slots").contiguous()
    for name, table in (("fds", fds), ("bases", bases), ("mapped", mapped), ("reads", reads)):
        check(table, torch.int64, name)
        if not table.is_contiguous() or table.numel() != fds.numel():
            raise ValueError(f"read_records: {name} must be contiguous, one per segment ({fds.numel()})")
    rows = slots.numel() if into is None else out.shape[0]
    if out.dtype != torch.uint8 or out.dim() != 2 or out.shape[0] != rows or not out.is_contiguous():
        raise ValueError(f"read_records: out must be a contiguous uint8 [{rows}, record bytes] tensor")
    if into is not None:
        into = check(into, torch.int64, "into").contiguous()
        if into.numel() != slots.numel() or (into.numel() and (int(into.min()) < 0 or int(into.max()) >= rows)):
            raise ValueError(f"read_records: into must hold a row of out (0..{rows - 1}) for each of the {slots.numel()} slots")
    if slots.numel() and int(slots.max()) >> shift >= fds.numel():
        raise ValueError(f"slot {int(slots.max())} is past the {fds.numel()} files")
    error = ctypes.c_int64(0)
    failed = native.LIBRARY.require().lp_read_records(fds.data_ptr(), bases.data_ptr(), mapped.data_ptr(), reads.data_ptr(), shift, out.shape[1],
                                        slots.data_ptr(), slots.numel(), into.data_ptr() if into is not None else None,
                                        out.data_ptr(), ctypes.byref(error))
    if failed:
        slot = int(slots[-failed - 1])
        reason = os.strerror(error.value) if error.value else "the file ends before it"
        raise OSError(error.value or errno.EIO, f"the record of disk slot {slot} could not be read whole (file {slot >> shift}): {reason}")
