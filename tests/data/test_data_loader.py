"""DataLoaders that fit their trainer: workers by the cores, pinned batches when the trainer is on a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_persia.data import _loader
from lightning_persia.data._loader import auto_workers, batch_loader


def _trainer(device: str, num_devices: int = 1):
    return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), num_devices=num_devices)


@pytest.mark.parametrize("cores, ranks, workers", [(2, 1, 0), (4, 1, 1), (8, 1, 3), (16, 1, 7), (64, 1, 8), (16, 4, 1)])
def test_auto_workers_leave_the_trainer_its_cores(monkeypatch, cores, ranks, workers):
    monkeypatch.setattr(_loader.os, "cpu_count", lambda: cores)
    assert auto_workers(_trainer("cpu", ranks)) == workers


def test_batches_are_pinned_when_the_trainer_is_on_a_gpu():
    dataset = [torch.zeros(2)]
    assert batch_loader(dataset, 0, None, _trainer("cuda")).pin_memory
    assert not batch_loader(dataset, 0, None, _trainer("cpu")).pin_memory
    assert not batch_loader(dataset, 0, False, _trainer("cuda")).pin_memory
    loader = batch_loader(dataset, 2, None, None)
    assert loader.num_workers == 2 and loader.persistent_workers  # workers kept across epochs
    with pytest.raises(ValueError, match="num_workers must be >= 0, got -1"):
        batch_loader(dataset, -1, None, None)
