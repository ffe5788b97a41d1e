"""Bindings of ``ids.c``: a batch's ids deduplicated table by table, the first id another shard owns, and each id's
routing slot."""
from __future__ import annotations

import ctypes
import itertools

import torch

from lightning_persia.ops import native
from lightning_persia.ops.native.library import check

_P, _I64 = ctypes.c_void_p, ctypes.c_int64

SIGNATURES = {
    "lp_first_foreign": ([_P, _I64, _P, _I64, _I64], _I64),
    "lp_slot_of": ([_P, _I64, _I64, _P], None),
    "lp_unique_by_table": ([_P, _P, _I64, _P, _P, _P], _I64),
}
"""Argument and result types of every function of ``ids.c`` (tests/ops/test_native_interface.py checks them)."""

native.LIBRARY.declare(SIGNATURES)


def first_foreign(ids: torch.Tensor, owners: torch.Tensor, shard: int) -> int:
    """Position of the first id whose slot ``owners`` (a shard map's table, ``ops/shard_map.py``) does not give to
    ``shard``, or -1."""
    ids = check(ids, torch.int64, "ids").contiguous()
    owners = check(owners, torch.int64, "owners").contiguous()
    if owners.numel() & (owners.numel() - 1) or not owners.numel():
        raise ValueError(f"owners must name the owner of a power-of-two number of slots, got {owners.numel()}")
    return native.LIBRARY.require().lp_first_foreign(ids.data_ptr(), ids.numel(), owners.data_ptr(), owners.numel(), shard)


def slot_of(ids: torch.Tensor, slots: int) -> torch.Tensor:
    """Each id's routing slot in ``[0, slots)`` (``slots`` a power of two): ``lightning_persia.ops.hashing.slot_of``."""
    ids = check(ids, torch.int64, "ids").contiguous()
    if slots < 1 or slots & (slots - 1):
        raise ValueError(f"slots must be a power of two, got {slots}")
    out = torch.empty_like(ids)
    native.LIBRARY.require().lp_slot_of(ids.data_ptr(), ids.numel(), slots, out.data_ptr())
    return out


def unique_by_table(ids: torch.Tensor, counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each table's unique ids (ascending), how many per table, and each id's position among its table's unique ids,
    for ``ids`` held table after table (``counts[t]`` ids of table ``t``): ``lightning_persia.ops.dedup``'s result."""
    ids = check(ids, torch.int64, "ids").contiguous()
    if sum(counts) != ids.numel():
        raise ValueError(f"unique_by_table: counts add up to {sum(counts)} for {ids.numel()} ids")
    starts = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
    unique = torch.empty_like(ids)
    found = torch.empty(len(counts), dtype=torch.int64)
    inverse = torch.empty_like(ids)
    library = native.LIBRARY.require()
    if library.lp_unique_by_table(ids.data_ptr(), starts.data_ptr(), len(counts), unique.data_ptr(), found.data_ptr(),
                                  inverse.data_ptr()):
        raise MemoryError(f"out of memory while deduplicating {ids.numel()} ids")
    return unique[: int(found.sum())], found, inverse
