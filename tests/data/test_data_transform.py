"""DataTransform: each feature's id mode, nulls under each, what each data module says of its featurisation, the
record a checkpoint and a bundle keep, one row applied as the readers do, errors that name the setting or the value."""
from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from lightning_persia.data import (
    CRITEO_DENSE_FEATURES, CRITEO_SPARSE_FEATURES, CriteoBinaryDataModule, CriteoDataModule, DataTransform, ParquetDataModule,
    SyntheticCriteoDataModule, TransformError, hash_categorical, hash_feature_ids, recorded_transform, string_key, transform_dense,
)
from lightning_persia.data._batching import sparse_columns
from lightning_persia.data.transform import resolve_ids


class _DenseOnly(L.LightningModule):
    """Reads the dense features of a CriteoBatch only (enough to write a checkpoint of a run with a data module)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(13, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.binary_cross_entropy_with_logits(self.linear(batch.dense_features).squeeze(1), batch.labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_null_is_the_missing_id_when_hashed_and_no_id_when_raw():
    transform = DataTransform(("a", "b"), ("raw", "hash"), ("x",), "none")
    values = torch.tensor([[5, 7], [-3, 1 << 40], [0, 0]])
    missing = torch.tensor([[False, False], [False, False], [True, True]])
    bags = sparse_columns(transform, values, missing)
    assert bags.lengths.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert bags.values[0].tolist() == [5, -3]  # raw: as stored, the null row has none
    assert bags.values[1].tolist() == hash_feature_ids(torch.tensor([7, 1 << 40, 0]), 1, torch.tensor([False, False, True])).tolist()
    assert transform.raw_features == ("a",)
    assert transform.dense(torch.tensor([[2.0], [3.0]]), torch.tensor([[False], [True]])).tolist() == [[2.0], [0.0]]


def test_settings_are_checked_naming_what_is_wrong():
    assert resolve_ids({"b": "raw"}, ["a", "b"], "hash") == ("hash", "raw")
    with pytest.raises(ValueError, match=r"ids of feature 'a' must be one of \('hash', 'raw'\), got 'vocab'"):
        resolve_ids("vocab", ["a"], "raw")
    with pytest.raises(ValueError, match=r"ids names features the data has not: \['z'\]; its features: \['a'\]"):
        resolve_ids({"z": "raw"}, ["a"], "raw")
    with pytest.raises(ValueError, match=r"2 id modes for 1 sparse features"):
        DataTransform(("a",), ("raw", "raw"), (), "none")
    with pytest.raises(ValueError, match=r"dense_transform must be one of \('log1p', 'none'\), got 'zscore'"):
        DataTransform(("a",), ("raw",), (), "zscore")
    with pytest.raises(ValueError, match=r"text_ids must be one of \('hex', 'decimal', 'string'\), got 'octal'"):
        DataTransform(("a",), ("raw",), (), "none", text_ids="octal")
    with pytest.raises(ValueError, match="sparse feature names repeat"):
        DataTransform(("a", "a"), ("raw", "raw"), (), "none")


def test_a_checkpoint_of_a_run_with_a_data_module_records_its_transform(tmp_path):
    data = SyntheticCriteoDataModule(num_train_batches=1, num_val_batches=0, num_test_batches=0, batch_size=8, num_workers=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(_DenseOnly(), datamodule=data)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert recorded_transform(torch.load(tmp_path / "run.ckpt", weights_only=True)) == data.transform


def test_each_data_module_describes_what_its_reader_does():
    criteo = CriteoDataModule(train_files=["day_0.tsv"]).transform
    assert criteo == DataTransform(tuple(CRITEO_SPARSE_FEATURES), ("hash",) * 26, tuple(CRITEO_DENSE_FEATURES), "log1p", text_ids="hex")
    assert SyntheticCriteoDataModule(num_train_batches=1).transform == criteo  # it writes the same rows as TSV
    binary = CriteoBinaryDataModule(train_files=["day_0"], ids={"cat_3": "hash"}).transform
    assert binary.dense_transform == "none" and binary.text_ids == "decimal"  # the .npy days hold transformed values
    assert binary.raw_features == tuple(f for f in CRITEO_SPARSE_FEATURES if f != "cat_3")
    parquet = ParquetDataModule(train_files=["f.parquet"], label_column="label", dense_columns=["i1", "i2"],
                                sparse_columns={"user": "u", "item": "v"}, dense_transform="none", ids={"item": "hash"})
    assert parquet.transform == DataTransform(("user", "item"), ("raw", "hash"), ("i1", "i2"), "none", text_ids="string")


def test_applying_the_transform_to_a_row_gives_the_reader_s_ids_and_dense_values():
    transform = SyntheticCriteoDataModule(num_train_batches=1).transform
    ids = transform.parse_ids("cat_3", ["0000002a", None])
    expected = hash_categorical(torch.tensor([[0, 0, 0, 42], [0, 0, 0, 0]]), torch.tensor([[False] * 4, [False] * 3 + [True]]))[:, 3]
    assert torch.equal(ids, expected)
    dense = [5, None] + [0] * 11
    torch.testing.assert_close(transform.parse_dense(dense), transform_dense(torch.tensor([[dense[0], 0] + dense[2:]], dtype=torch.float64),
                                                                             torch.tensor([[False, True] + [False] * 11]))[0])
    mixed = DataTransform(("user", "item"), ("raw", "hash"), ("x",), "none", text_ids="string")
    assert mixed.parse_ids("user", [7, None, 1 << 40]).tolist() == [7, 1 << 40]  # raw: as given, a null is no id
    assert mixed.parse_ids("item", ["US", 3]).tolist() == hash_feature_ids(torch.tensor([string_key("US"), 3]), 1).tolist()
    assert mixed.parse_dense([None]).tolist() == [0.0]


def test_a_bad_value_is_named_by_its_field_and_position():
    transform = DataTransform(("a", "b"), ("hash", "raw"), ("x",), "log1p", text_ids="hex")
    with pytest.raises(TransformError, match=r"sparse.a\[1\]: 'zz' is not a hex categorical value"):
        transform.parse_ids("a", ["0a", "zz"])
    with pytest.raises(TransformError, match=r"sparse.a\[0\]: 'ffffffffffffffffff' does not fit in 64 bits"):
        transform.parse_ids("a", ["ffffffffffffffffff"])
    with pytest.raises(TransformError, match=r"sparse.b\[0\]: True is not an integer or text categorical value"):
        transform.parse_ids("b", [True])
    with pytest.raises(TransformError, match=r"sparse.c: unknown feature"):
        transform.parse_ids("c", [1])
    with pytest.raises(TransformError, match=r"dense\[0\]: 'inf' is not a finite number"):
        transform.parse_dense(["inf"])
    with pytest.raises(TransformError, match=r"dense: 2 values for the 1 dense features \['x'\]"):
        transform.parse_dense([1, 2])
    strings = DataTransform(("a",), ("raw",), (), "none", text_ids="string")
    with pytest.raises(TransformError, match=r"sparse.a\[0\]: 'US' is text; raw ids are integers"):
        strings.parse_ids("a", ["US"])


def test_a_transform_round_trips_and_refuses_what_it_cannot_be():
    transform = DataTransform(("a", "b"), ("raw", "hash"), ("x",), "none", text_ids="hex")
    assert DataTransform.from_dict(json.loads(json.dumps(transform.as_dict()))) == transform
    assert recorded_transform({"state_dict": {}}) is None
    with pytest.raises(ValueError, match=r"unknown fields \['vocab'\]"):
        DataTransform.from_dict({**transform.as_dict(), "vocab": 3})
    with pytest.raises(ValueError, match="dense_transform"):
        DataTransform.from_dict({k: v for k, v in transform.as_dict().items() if k != "dense_transform"})
