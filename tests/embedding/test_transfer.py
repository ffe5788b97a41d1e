"""Copies of a step's tensors between host and device: none on the CPU, side streams and events on a GPU."""
from __future__ import annotations

import pytest
import torch

from lightning_persia.embedding.transfer import DeviceTransfer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI machines have none)")


def test_on_the_cpu_nothing_is_copied():
    transfer = DeviceTransfer(torch.device("cpu"))
    rows = torch.randn(6)
    assert not transfer.on_gpu
    assert transfer.upload(rows).get() is rows
    grad = torch.randn(6)
    assert transfer.download(grad, torch.float32).get().data_ptr() == grad.data_ptr()
    half = transfer.download(grad.half(), torch.float32).get()
    assert half.dtype == torch.float32 and torch.equal(half, grad.half().float())


@cuda
def test_an_upload_from_pageable_or_pinned_memory_arrives_for_work_on_the_current_stream():
    transfer = DeviceTransfer(torch.device("cuda"))
    for host in (torch.randn(1 << 20), torch.randn(1 << 20).pin_memory()):
        pending = transfer.upload(host)
        on_device = pending.get()
        assert on_device.device.type == "cuda"
        torch.testing.assert_close((on_device * 2).cpu(), host * 2)


@cuda
def test_a_download_waits_for_the_kernels_that_wrote_the_tensor():
    transfer = DeviceTransfer(torch.device("cuda"))
    base = torch.randn(1 << 20, device="cuda")
    for _ in range(3):  # queue work long enough that a copy that did not wait for it would read stale values
        base = torch.sin(base) + 1
    expected = base.cpu()
    written = torch.empty_like(base)
    written.copy_(base)
    host = transfer.download(written, torch.float32).get()
    assert host.is_pinned()
    torch.testing.assert_close(host, expected)
