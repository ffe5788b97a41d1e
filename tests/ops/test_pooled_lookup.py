"""The fused pooled lookup: FBGEMM's kernel and the torch fallback agree, forward and backward."""
import pytest
import torch

from lightning_persia.ops import pooled_lookup as pl
from lightning_persia.ops.pooled_lookup import FlatLayout, fbgemm_available, pooled_lookup

LAYOUT = FlatLayout(rows=(5, 3), dims=(4, 8), feature_tables=(0, 1, 0))
BATCH = 6


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * BATCH,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    indices = torch.cat([
        torch.randint(0, LAYOUT.rows[t], (int(lengths[f * BATCH : (f + 1) * BATCH].sum()),), generator=gen)
        for f, t in enumerate(LAYOUT.feature_tables)
    ])
    weights = torch.randn(sum(r * d for r, d in zip(LAYOUT.rows, LAYOUT.dims)), generator=gen)
    return weights, indices, offsets, torch.rand(indices.numel(), generator=gen)


@pytest.mark.skipif(not fbgemm_available("cpu"), reason="fbgemm-gpu-cpu is not installed")
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_fbgemm_and_torch_agree(pooling, weighted):
    weights, indices, offsets, psw = _inputs()
    a, b = weights.clone().requires_grad_(), weights.clone().requires_grad_()
    out_a = pl._fbgemm_lookup(a, LAYOUT, indices, offsets, pooling, psw if weighted else None)
    out_b = pl._torch_lookup(b, LAYOUT, indices, offsets, pooling, psw if weighted else None)
    torch.testing.assert_close(out_a, out_b)
    grad = torch.randn_like(out_a)
    out_a.backward(grad)
    out_b.backward(grad)
    torch.testing.assert_close(a.grad, b.grad)


def test_pooled_output_is_the_per_feature_bag_sum():
    weights, indices, offsets, _ = _inputs(1)
    out = pooled_lookup(weights, LAYOUT, indices, offsets, "sum")
    table1 = weights[20:].view(3, 8)
    bag = 2 * BATCH + 0  # feature 2 (table 0), sample 0: columns 12..16
    start, end = int(offsets[bag]), int(offsets[bag + 1])
    expected = weights[:20].view(5, 4)[indices[start:end]].sum(0)
    torch.testing.assert_close(out[0, 12:16], expected)
    bag = 1 * BATCH + 3  # feature 1 (table 1), sample 3: columns 4..12
    start, end = int(offsets[bag]), int(offsets[bag + 1])
    torch.testing.assert_close(out[3, 4:12], table1[indices[start:end]].sum(0))


def test_unknown_pooling_is_refused():
    weights, indices, offsets, _ = _inputs()
    with pytest.raises(ValueError, match="pooling must be one of"):
        pooled_lookup(weights, LAYOUT, indices, offsets, "max")
