"""Initial embedding rows as a pure function of (seed, table, id).

A row's first value must not depend on which shard holds it, the order ids arrive in, or a restart, so
every element is drawn from a counter-based generator keyed by (seed, table name, id, column) instead
of a stateful RNG. Tests use the same function to build local reference tables.
"""
from __future__ import annotations

import math

import torch

from lightning_persia.ops.hashing import mix64, mix64_int, name_hash
from lightning_persia.remote_ps.store import native
from lightning_persia.remote_ps.store.native import rows as native_rows
from lightning_persia.remote_ps.table_config import Constant, EmbeddingInit, Normal, Uniform

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed word
_MANTISSA = (1 << 53) - 1


def _uniform01(ids: torch.Tensor, key: int, columns: int) -> torch.Tensor:
    """U(0, 1) in float64, shape [n, columns], never exactly 0."""
    if native.available():  # the same words in one C loop instead of a dozen [n, columns] int64 tensor ops
        bits = native_rows.row_bits(ids, key, columns)
    else:
        row_key = mix64(ids ^ key)
        bits = mix64(row_key.unsqueeze(1) + torch.arange(columns, dtype=torch.int64).unsqueeze(0) * _GOLDEN)
    return (((bits >> 11) & _MANTISSA).to(torch.float64) + 0.5) * (1.0 / (1 << 53))


def table_key(seed: int, table: str) -> int:
    """The key of ``table``'s counter-based generator under ``seed`` (the native admission draws with it too)."""
    return mix64_int(seed ^ name_hash(table))


def initial_rows(init: EmbeddingInit, seed: int, table: str, ids: torch.Tensor, dim: int) -> torch.Tensor:
    """Initial float32 rows ``[len(ids), dim]`` for ``ids`` of ``table``.

    Example::

        rows = initial_rows(Uniform(-0.05, 0.05), seed=0, table="t_cat_0", ids=torch.arange(10), dim=16)
    """
    n = ids.numel()
    if isinstance(init, Constant):
        return torch.full((n, dim), float(init.value), dtype=torch.float32)
    key = table_key(seed, table)
    ids = ids.reshape(-1).to(torch.int64)
    if isinstance(init, Uniform):
        if native.available():  # one C loop instead of a dozen passes over [n, dim] float64 tensors
            return native_rows.uniform_rows(ids, key, dim, init.low, init.high)
        u = _uniform01(ids, key, dim)
        return (init.low + (init.high - init.low) * u).to(torch.float32)
    if isinstance(init, Normal):
        u = _uniform01(ids, key, 2 * dim)
        radius = torch.sqrt(-2.0 * torch.log(u[:, :dim]))
        z = radius * torch.cos((2.0 * math.pi) * u[:, dim:])
        return (init.mean + init.std * z).to(torch.float32)
    raise TypeError(f"unknown initialiser {init!r}")
