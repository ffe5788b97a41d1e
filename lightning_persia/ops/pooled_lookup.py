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
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import accumulate
from typing import Optional, Union

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


@dataclass(frozen=True)
class FusedArguments:
    """What FBGEMM's fused lookup takes besides weights, indices and offsets, for one :class:`FlatLayout`.

    Built on the host from the layout (:meth:`of`) as one int64 tensor, so that the embedding pipeline moves it to
    the device in one asynchronous copy ahead of the forward (building it there from Python lists would be three
    synchronous copies, each a wait for the device, in every forward).
    """

    packed: torch.Tensor  # weights offsets [F], hash size cumsum [F + 1], D offsets [F + 1]
    num_features: int
    total_dim: int
    max_dim: int
    total_hash_size_bits: int

    @classmethod
    def of(cls, layout: FlatLayout, device: Union[str, torch.device] = "cpu") -> "FusedArguments":
        table_offsets = layout.table_offsets
        d_offsets = [0, *accumulate(layout.feature_dims)]
        table_cumsum = [0, *accumulate(layout.rows)]
        total_rows = table_cumsum[-1]
        packed = [table_offsets[t] for t in layout.feature_tables]
        packed += [table_cumsum[t] for t in layout.feature_tables] + [total_rows]
        packed += d_offsets
        return cls(torch.tensor(packed, dtype=torch.int64, device=device), len(layout.feature_tables), d_offsets[-1],
                   max(layout.dims), int(math.log2(total_rows) + 1) if total_rows else 0)

    def with_packed(self, packed: torch.Tensor) -> "FusedArguments":
        """The same arguments held in ``packed`` (their copy on a device)."""
        return replace(self, packed=packed)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(weights_offsets, hash_size_cumsum, D_offsets)`` as the kernel takes them."""
        f = self.num_features
        return self.packed[:f], self.packed[f : 2 * f + 1], self.packed[2 * f + 1 :].to(torch.int32)


def fbgemm_available(device_type: str) -> bool:
    """Whether FBGEMM's fused dense lookup runs on ``device_type`` in this installation."""
    return _fbgemm_failure(device_type) is None


def kernel_in_use(device_type: str) -> str:
    """Which kernel pools the rows on ``device_type``, and why not FBGEMM's when it is not (for the start-up line)."""
    failure = _fbgemm_failure(device_type)
    if failure is None:
        import fbgemm_gpu

        version = getattr(fbgemm_gpu, "__version__", "?")
        return f"FBGEMM's fused {'CUDA' if device_type == 'cuda' else device_type.upper()} kernel (fbgemm_gpu {version})"
    return f"torch's embedding_bag per feature ({failure})"


@lru_cache(maxsize=None)
def _fbgemm_failure(device_type: str) -> Optional[str]:
    """None when FBGEMM's fused lookup runs (forward and backward) on ``device_type``; else why not."""
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    except ImportError as error:
        return f"FBGEMM is not installed: {error}"
    except Exception as error:  # noqa: BLE001 - a broken install raises anything; the reason is what matters
        return f"FBGEMM is installed but failed to load: {type(error).__name__}: {error}"
    try:
        probe = FlatLayout(rows=(1,), dims=(4,), feature_tables=(0,))
        weights = torch.zeros(4, device=device_type, requires_grad=True)
        indices = torch.zeros(1, dtype=torch.int64, device=device_type)
        offsets = torch.tensor([0, 1], dtype=torch.int64, device=device_type)
        _fbgemm_lookup(weights, probe, indices, offsets, "sum", None).sum().backward()
        return None
    except (RuntimeError, NotImplementedError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"FBGEMM is installed but its {device_type} kernel cannot run here: {first_line}"


def pooled_lookup(
    weights: torch.Tensor,
    layout: FlatLayout,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    pooling: str = "sum",
    per_sample_weights: Optional[torch.Tensor] = None,
    fused: Optional[FusedArguments] = None,
) -> torch.Tensor:
    """Pooled embeddings ``[B, sum of feature dims]`` of every feature, features in layout order.

    ``indices`` are row numbers local to each feature's table; ``offsets`` (length ``F * B + 1``) delimit
    the bags feature-major, as in a KeyedJaggedTensor. ``fused``: the layout's :class:`FusedArguments`, already
    on the weights' device (else they are built here).
    """
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling must be one of {sorted(POOLING_MODES)}, got {pooling!r}")
    if fbgemm_available(weights.device.type):
        return _fbgemm_lookup(weights, layout, indices, offsets, pooling, per_sample_weights, fused)
    return _torch_lookup(weights, layout, indices, offsets, pooling, per_sample_weights)


def _fbgemm_lookup(weights, layout, indices, offsets, pooling, per_sample_weights, fused=None):
    fused = fused if fused is not None else FusedArguments.of(layout, weights.device)
    weights_offsets, hash_size_cumsum, d_offsets = fused.tensors()
    return torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
        dev_weights=weights,
        weights_offsets=weights_offsets,
        D_offsets=d_offsets,
        total_D=fused.total_dim,
        max_D=fused.max_dim,
        hash_size_cumsum=hash_size_cumsum,
        total_hash_size_bits=fused.total_hash_size_bits,
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
