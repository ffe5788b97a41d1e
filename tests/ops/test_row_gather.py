"""The row gather's backward as a segment sum equals autograd's ``index_select`` backward to the bit."""
from __future__ import annotations

import pytest
import torch

from lightning_persia.ops.row_gather import gather_rows, segment_sum_rows


def _zipf_index(n: int, rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.1  # hot rows read by many ids, some rows by none
    return torch.multinomial(weights, n, replacement=True, generator=generator)


@pytest.mark.parametrize("n,rows,dim", [(50_000, 3_000, 16), (7, 10, 3), (0, 4, 8)])
def test_segment_sum_equals_autograds_gather_backward_bit_for_bit(n, rows, dim):
    index = _zipf_index(n, rows, seed=n) if n else torch.empty(0, dtype=torch.int64)
    grad = torch.randn(n, dim, generator=torch.Generator().manual_seed(1))
    table = torch.zeros(rows, dim, requires_grad=True)
    table.index_select(0, index).backward(grad)
    got = segment_sum_rows(grad, index, rows)
    assert got.shape == (rows, dim)
    assert torch.equal(got, table.grad)


def test_gather_rows_forward_and_backward_are_the_autograd_gathers():
    index = _zipf_index(20_000, 500, seed=3)
    table = torch.randn(500, 8, requires_grad=True)
    ours = table.detach().clone().requires_grad_(True)
    weights = torch.randn(20_000, 8)
    (table.index_select(0, index) * weights).sum().backward()
    out = gather_rows(ours, index)
    assert torch.equal(out, table.index_select(0, index))
    (out * weights).sum().backward()
    assert torch.equal(ours.grad, table.grad)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match=r"expected grad \[n, dim\] and index \[n\], got \(3, 2\) and \(4,\)"):
        segment_sum_rows(torch.zeros(3, 2), torch.zeros(4, dtype=torch.int64), 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sort-and-segment-sum backward runs on CUDA tensors only "
                    "(on the CPU gather_rows keeps index_add_, tested above); this machine has no CUDA device")
def test_on_a_gpu_the_backward_is_the_segment_sum_and_equals_the_cpus():
    index = _zipf_index(100_000, 4_000, seed=5)
    grad = torch.randn(100_000, 16)
    table = torch.zeros(4_000, 16, requires_grad=True)
    table.index_select(0, index).backward(grad)
    on_gpu = torch.zeros(4_000, 16, device="cuda", requires_grad=True)
    gather_rows(on_gpu, index.cuda()).backward(grad.cuda())
    assert torch.equal(on_gpu.grad.cpu(), table.grad)
