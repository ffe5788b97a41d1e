"""Pooled lookups of many features from one flat batch-local weight tensor, in one fused kernel call.

The embedding pipeline packs the rows fetched for a step (every table of its modules) into one flat leaf
tensor; FBGEMM's ``dense_embedding_codegen_lookup_function`` pools all features from it at once and its
backward writes the gradient of that tensor directly (CPU kernel on CPU, CUDA kernel on GPU). Where
FBGEMM is not installed for the device in use, ``torch.nn.functional.embedding_bag`` per feature does the
same work.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import Optional

import torch
import torch.nn.functional as F

POOLING_MODES = {"sum": 0, "mean": 1}

# FBGEMM registers this op's backward through its own autograd function on the CPU build, which PyTorch
# reports as a missing Autograd-key kernel; the gradient is checked against torch's in the tests.
warnings.filterwarnings("ignore", message="fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel")


@dataclass(frozen=True)
class FlatLayout:
    """Where each table of a flat weight tensor starts, and which table each feature reads.

    ``rows[t]`` and ``dims[t]`` describe table ``t``; ``feature_tables[f]`` is the table of feature ``f``. The
    tables lie one after another from ``base`` (the rows of several modules may share one weight tensor).
    """

    rows: tuple[int, ...]
    dims: tuple[int, ...]
    feature_tables: tuple[int, ...]
    base: int = 0

    @property
    def table_offsets(self) -> list[int]:
        return list(accumulate((r * d for r, d in zip(self.rows, self.dims)), initial=self.base))

    @property
    def feature_dims(self) -> list[int]:
        return [self.dims[t] for t in self.feature_tables]


@lru_cache(maxsize=None)
def fbgemm_available(device_type: str) -> bool:
    """Whether FBGEMM's fused dense lookup runs on ``device_type`` in this installation."""
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    except ImportError:
        return False
    try:
        probe = FlatLayout(rows=(1,), dims=(4,), feature_tables=(0,))
        weights = torch.zeros(4, device=device_type, requires_grad=True)
        indices = torch.zeros(1, dtype=torch.int64, device=device_type)
        offsets = torch.tensor([0, 1], dtype=torch.int64, device=device_type)
        _fbgemm_lookup(weights, probe, indices, offsets, "sum", None).sum().backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def pooled_lookup(
    weights: torch.Tensor,
    layout: FlatLayout,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    pooling: str = "sum",
    per_sample_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pooled embeddings ``[B, sum of feature dims]`` of every feature, features in layout order.

    ``indices`` are row numbers local to each feature's table; ``offsets`` (length ``F * B + 1``) delimit
    the bags feature-major, as in a KeyedJaggedTensor.
    """
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling must be one of {sorted(POOLING_MODES)}, got {pooling!r}")
    if fbgemm_available(weights.device.type):
        return _fbgemm_lookup(weights, layout, indices, offsets, pooling, per_sample_weights)
    return _torch_lookup(weights, layout, indices, offsets, pooling, per_sample_weights)


def _fbgemm_lookup(weights, layout, indices, offsets, pooling, per_sample_weights):
    device = weights.device
    table_offsets = layout.table_offsets
    d_offsets = [0] + list(accumulate(layout.feature_dims))
    table_cumsum = [0] + list(accumulate(layout.rows))
    total_rows = table_cumsum[-1]
    return torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
        dev_weights=weights,
        weights_offsets=torch.tensor([table_offsets[t] for t in layout.feature_tables], dtype=torch.int64, device=device),
        D_offsets=torch.tensor(d_offsets, dtype=torch.int32, device=device),
        total_D=d_offsets[-1],
        max_D=max(layout.dims),
        hash_size_cumsum=torch.tensor([table_cumsum[t] for t in layout.feature_tables] + [total_rows], dtype=torch.int64, device=device),
        total_hash_size_bits=int(math.log2(total_rows) + 1) if total_rows else 0,
        indices=indices.to(torch.int64),
        offsets=offsets.to(torch.int64),
        pooling_mode=POOLING_MODES[pooling],
        indice_weights=None if per_sample_weights is None else per_sample_weights.float(),
        feature_requires_grad=None,
        output_dtype=0,
    )


def _torch_lookup(weights, layout, indices, offsets, pooling, per_sample_weights):
    table_offsets = layout.table_offsets
    num_features = len(layout.feature_tables)
    batch = (offsets.numel() - 1) // num_features
    outputs = []
    for f, t in enumerate(layout.feature_tables):
        table = weights[table_offsets[t] : table_offsets[t + 1]].view(layout.rows[t], layout.dims[t])
        bag_offsets = offsets[f * batch : (f + 1) * batch + 1]
        start = bag_offsets[0]
        end = bag_offsets[-1]
        outputs.append(
            F.embedding_bag(
                indices[start:end],
                table,
                bag_offsets[:-1] - start,
                mode=pooling,
                per_sample_weights=None if per_sample_weights is None else per_sample_weights[start:end],
                include_last_offset=False,
            )
        )
    return torch.cat(outputs, dim=1)
