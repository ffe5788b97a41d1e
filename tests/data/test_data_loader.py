"""DataLoaders that fit their trainer: workers by the cores, pinned batches when the trainer is on a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from lightning_persia.data import CriteoBinaryDataModule, ParquetDataModule, _loader
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


class _Tiny(LightningModule):
    """A logistic regression on the dense features: enough to run Lightning's loops over the data modules."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(13, 1)
        self.validated_at: list = []

    def training_step(self, batch, batch_idx):
        return F.binary_cross_entropy_with_logits(self.linear(batch.dense_features).squeeze(1), batch.labels)

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.validated_at.append(self.trainer.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("layout, num_workers", [("binary", 0), ("parquet", 0), ("parquet", 3)])
def test_the_datasets_lengths_let_lightning_count_batches_and_validate_at_a_fraction(tmp_path, layout, num_workers):
    """Lightning's bar counts the batches (not 0/?), and val_check_interval=0.25 validates every quarter epoch."""
    from click_files import NVT_COLUMNS, nvtabular_table, synthetic_rows, write_nvtabular_output, write_torchrec_day

    if layout == "binary":
        module = CriteoBinaryDataModule(train_files=[write_torchrec_day(str(tmp_path / "day_0"), synthetic_rows(1000))],
                                        val_files=[write_torchrec_day(str(tmp_path / "day_1"), synthetic_rows(100))],
                                        batch_size=64, num_workers=num_workers)
    else:
        module = ParquetDataModule(train_files=[write_nvtabular_output(tmp_path / "train", nvtabular_table(synthetic_rows(1000)), 4, 50)],
                                   val_files=[write_nvtabular_output(tmp_path / "val", nvtabular_table(synthetic_rows(100)), 1, 50)],
                                   batch_size=64, num_workers=num_workers, **NVT_COLUMNS)
    model = _Tiny()
    trainer = Trainer(max_epochs=1, val_check_interval=0.25, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, module)
    # 1000 rows in batches of 64; 3 workers cut their own 7, 7 and 6 row groups of 50 rows: 6 + 6 + 5 batches
    batches = 17 if num_workers == 3 else 16
    assert trainer.num_training_batches == batches == trainer.global_step
    assert model.validated_at[:4] == [4, 8, 12, 16]
