"""The fixed 64-bit mix hash behind shard placement, index slots and deterministic initialisation.

Every process (trainer, shard, checkpoint re-sharding) must agree on where an id lives, whatever the
machine or the restart, so the hash is a pure function of the id: splitmix64's finaliser, computed in
wrapping int64 arithmetic with logical right shifts emulated by masks.
"""
from __future__ import annotations

import hashlib

import torch

from lightning_persia.ops import native
from lightning_persia.ops.native import ids as native_ids


_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_C1 = _signed(0xBF58476D1CE4E5B9)
_C2 = _signed(0x94D049BB133111EB)
_SHARD_SALT = _signed(0x2545F4914F6CDD1D)
_SLOT_SALT = _signed(0x9E3779B97F4A7C15)


def _srl(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser of an int64 tensor (a bijection on 64-bit words)."""
    x = x ^ _srl(x, 30)
    x = x * _C1
    x = x ^ _srl(x, 27)
    x = x * _C2
    return x ^ _srl(x, 31)


def mix64_int(x: int) -> int:
    """Python-int twin of :func:`mix64`, for scalars and for testing the tensor version."""
    x &= _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return _signed(x)


def slot_of(ids: torch.Tensor, slots: int) -> torch.Tensor:
    """Routing slot in ``[0, slots)`` of each id (``slots`` a power of two); stable across processes, machines and
    restarts. Which shard owns a slot is the shard map's business (``ops/shard_map.py``).

    A 1-D int64 CPU tensor goes through the native kernel when it is built (same result): the tensor operations
    take 55 ns an id, and a move's point reads the slot of every row of a table."""
    if ids.dtype == torch.int64 and ids.dim() == 1 and ids.device.type == "cpu" and native.available():
        return native_ids.slot_of(ids, slots)
    return mix64(ids ^ _SHARD_SALT) & (slots - 1)


def slot_hash(ids: torch.Tensor) -> torch.Tensor:
    """Hash used for index slots, salted apart from :func:`slot_of` so that one shard's ids fill all index slots."""
    return mix64(ids ^ _SLOT_SALT)


def name_hash(name: str) -> int:
    """Stable signed 64-bit hash of a table name (Python's ``hash`` is salted per process)."""
    return _signed(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))
