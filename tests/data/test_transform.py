"""FeatureTransform: what each data module says of its featurisation, and what a Lightning checkpoint records of it."""
from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_persia.data import (
    CRITEO_DENSE_FEATURES, CRITEO_SPARSE_FEATURES, CriteoBinaryDataModule, CriteoDataModule, FeatureTransform, ParquetDataModule,
    SyntheticCriteoDataModule, hash_categorical, transform_dense,
)
from lightning_persia.data.transform import recorded_transform


class _DenseOnly(L.LightningModule):
    """Reads the dense features of a CriteoBatch only (enough to write a checkpoint of a run with a data module)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(13, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.binary_cross_entropy_with_logits(self.linear(batch.dense_features).squeeze(1), batch.labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_checkpoint_of_a_run_with_a_data_module_records_its_transform(tmp_path):
    data = SyntheticCriteoDataModule(num_train_batches=1, num_val_batches=0, num_test_batches=0, batch_size=8, num_workers=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(_DenseOnly(), datamodule=data)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert recorded_transform(torch.load(tmp_path / "run.ckpt", weights_only=True)) == data.feature_transform()


def test_each_data_module_describes_what_its_reader_does():
    criteo = CriteoDataModule(["day_0.tsv"]).feature_transform()
    assert criteo == FeatureTransform(tuple(CRITEO_SPARSE_FEATURES), tuple(CRITEO_DENSE_FEATURES), ids="hash", dense="log1p", text_ids="hex")
    assert SyntheticCriteoDataModule(num_train_batches=1).feature_transform() == criteo  # it writes the same rows as TSV
    assert CriteoBinaryDataModule(["day_0"]).feature_transform().dense == "none"  # the .npy days hold transformed values
    parquet = ParquetDataModule(["f.parquet"], "label", ["i1", "i2"], {"user": "u", "item": "v"}, dense_transform="none")
    assert parquet.feature_transform() == FeatureTransform(("user", "item"), ("i1", "i2"), ids="hash", dense="none")


def test_applying_the_transform_to_a_row_gives_the_reader_s_ids_and_dense_values():
    transform = SyntheticCriteoDataModule(num_train_batches=1).feature_transform()
    ids = transform.sparse_ids("cat_3", ["0000002a", None])
    expected = hash_categorical(torch.tensor([[0, 0, 0, 42], [0, 0, 0, 0]]), torch.tensor([[False] * 4, [False] * 3 + [True]]))[:, 3]
    assert torch.equal(ids, expected)
    dense = [5, None] + [0] * 11
    torch.testing.assert_close(transform.dense_values(dense), transform_dense(torch.tensor([dense[0], 0] + dense[2:], dtype=torch.float64),
                                                                                torch.tensor([False, True] + [False] * 11)))


def test_a_transform_round_trips_and_refuses_what_it_cannot_be():
    transform = FeatureTransform(("a",), ("x",), ids="raw", dense="none")
    assert FeatureTransform.from_dict(transform.to_dict()) == transform
    assert recorded_transform({"state_dict": {}}) is None
    with pytest.raises(ValueError, match=r"unknown fields \['vocab'\]"):
        FeatureTransform.from_dict({**transform.to_dict(), "vocab": 3})
    with pytest.raises(ValueError, match="ids must be one of"):
        FeatureTransform(("a",), (), ids="vocab")
    with pytest.raises(ValueError, match="sparse feature names repeat"):
        FeatureTransform(("a", "a"), ())
