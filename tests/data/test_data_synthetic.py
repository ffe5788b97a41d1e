"""The synthetic Criteo generator: determinism, skew, label rate, ceiling, TSV round trip, rank split."""
from __future__ import annotations

import json

import lightning as L
import numpy as np
import pytest
import torch

from lightning_persia.data import (
    CRITEO_SPARSE_FEATURES,
    CriteoDataModule,
    DataTransform,
    SyntheticCriteo,
    SyntheticCriteoDataModule,
    SyntheticCriteoDataset,
    binary_auc,
    missing_ids,
    scaled_cardinalities,
)


@pytest.fixture(scope="module")
def generator() -> SyntheticCriteo:
    return SyntheticCriteo(seed=3)


def _same(a, b) -> bool:
    return (
        torch.equal(a.sparse_ids(), b.sparse_ids())
        and torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
    )


def test_batch_schema(generator):
    batch = generator.batch("train", 0, 256)
    assert batch.sparse_features.keys() == CRITEO_SPARSE_FEATURES
    assert batch.sparse_features.lengths().tolist() == [1] * (256 * 26)
    assert batch.dense_features.shape == (256, 13) and batch.dense_features.dtype == torch.float32
    assert batch.labels.shape == (256,) and set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    assert bool((batch.dense_features >= 0).all()) and bool(torch.isfinite(batch.dense_features).all())
    assert bool((batch.sparse_ids() >= 0).all())


def test_deterministic_for_a_seed(generator):
    again = SyntheticCriteo(seed=3)
    assert _same(generator.batch("train", 5, 128), again.batch("train", 5, 128))
    assert again.bias == generator.bias
    # rows do not depend on the batch size
    whole = generator.batch("val", 0, 256)
    half = generator.batch("val", 1, 128)
    assert torch.equal(whole.sparse_ids()[128:], half.sparse_ids()) and torch.equal(whole.labels[128:], half.labels)
    # another seed, another split: other data
    assert not _same(SyntheticCriteo(seed=4).batch("train", 5, 128), again.batch("train", 5, 128))
    assert not _same(generator.batch("train", 0, 128), generator.batch("test", 0, 128))


def test_zipf_skew_and_missing_rates(generator):
    rows = generator.rows("train", 0, 50_000)
    card = generator.cardinalities[2]  # the largest table (about a million values)
    assert card > 500_000
    present = rows.cat_values[~rows.cat_missing[:, 2], 2]
    _, counts = np.unique(present, return_counts=True)
    counts = np.sort(counts)[::-1]
    # Zipf(1.1) over ~1M values: the top value alone is ~1/H of the mass (H = sum k^-1.1 ~ 9.5)
    assert 0.05 < counts[0] / present.size < 0.15
    assert counts[:100].sum() / present.size > 0.35  # 100 of ~1M values carry a third of the traffic
    assert counts[0] > 5 * counts[9] > 0
    assert len(counts) < 0.6 * present.size  # heavy repetition, far from uniform
    # a feature with 3 values stays within them
    assert len(np.unique(rows.cat_values[:, 8])) <= generator.cardinalities[8] == 3
    # Criteo-like missing rates: C22 about 76%, C1 never
    assert 0.7 < rows.cat_missing[:, 21].mean() < 0.82 and rows.cat_missing[:, 0].mean() == 0
    assert 0.4 < rows.dense_missing[:, 0].mean() < 0.5


def test_positive_rate_and_ground_truth_ceiling(generator):
    rows = generator.rows("holdout", 0, 40_000)
    assert 0.22 < rows.labels.mean() < 0.28
    ceiling = generator.ground_truth_auc(num_rows=40_000)
    assert ceiling == pytest.approx(binary_auc(rows.probabilities, rows.labels))
    assert 0.75 < ceiling < 0.88
    # the probabilities carry the signal: shuffled they are worthless
    assert binary_auc(np.random.default_rng(0).permutation(rows.probabilities), rows.labels) < 0.53


def test_binary_auc_matches_definition():
    scores = np.array([0.1, 0.4, 0.35, 0.8, 0.4])
    labels = np.array([0, 0, 1, 1, 1])
    pairs = [(p, n) for p in scores[labels == 1] for n in scores[labels == 0]]
    expected = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)
    assert binary_auc(scores, labels) == pytest.approx(expected)


@pytest.mark.parametrize("gz", [False, True])
def test_written_tsv_reads_back_as_the_generated_batches(tmp_path, gz):
    dm = SyntheticCriteoDataModule(num_train_batches=3, num_val_batches=1, batch_size=100, seed=11, cardinality_scale=0.01)
    path = dm.write_tsv(str(tmp_path / ("train.tsv.gz" if gz else "train.tsv")), num_rows=300)
    with open(path, "rb") as handle:
        assert (handle.read(2) == b"\x1f\x8b") == gz
    generated = list(dm.train_dataloader())
    read = list(CriteoDataModule(train_files=[path], batch_size=100).train_dataloader())
    assert len(generated) == len(read) == 3
    for a, b in zip(generated, read):
        assert _same(a, b)
    # the file has empty dense and categorical fields, and 8-digit hex ids
    with (__import__("gzip").open(path, "rt") if gz else open(path)) as handle:
        fields = [line.rstrip("\n").split("\t") for line in handle]
    assert all(len(f) == 40 for f in fields)
    assert any(f[1] == "" for f in fields) and any(f[14 + 21] == "" for f in fields)
    assert all(len(c) == 8 for f in fields for c in f[14:] if c)
    assert missing_ids(26)[21] in torch.cat([b.sparse_ids()[:, 21] for b in read])


def test_rank_split_of_batches():
    dm = SyntheticCriteoDataModule(num_train_batches=5, batch_size=32, seed=0, cardinality_scale=0.01)
    single = list(dm.train_dataloader())  # no trainer, no process group: one rank
    assert len(single) == 5 and _same(single[3], SyntheticCriteoDataset(dm.generator, "train", 5, 32)[3])
    parts = [list(dm.dataloader("train", rank=r, world_size=2)) for r in range(2)]
    assert [len(p) for p in parts] == [3, 3]  # every rank runs as many steps: 6 >= 5 batches in all
    assert _same(parts[0][0], single[0]) and _same(parts[1][0], single[1]) and _same(parts[0][2], single[4])
    assert _same(parts[1][2], single[0])  # the step rank 1 lacks repeats the first batch
    with pytest.raises(IndexError):
        SyntheticCriteoDataset(dm.generator, "train", 5, 32)[5]


class _Dense(L.LightningModule):
    """Logistic regression on the dense features: enough to run Lightning's loops over the batches."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(13, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.binary_cross_entropy_with_logits(self.linear(batch.dense_features).squeeze(1), batch.labels)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx), batch_size=batch.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_data_module_passes_lightning_s_dataloader_checks_without_a_warning(recwarn):
    """Lightning warns about an IterableDataset with a length; the batches are a map-style dataset instead."""
    dm = SyntheticCriteoDataModule(num_train_batches=3, num_val_batches=1, batch_size=16, seed=0, cardinality_scale=0.01)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_Dense(), datamodule=dm)
    assert trainer.num_training_batches == 3 and trainer.global_step == 3
    assert [str(w.message) for w in recwarn if "IterableDataset" in str(w.message)] == []


def test_scaled_cardinalities():
    cards = scaled_cardinalities(0.1)
    assert len(cards) == 26 and 3_000_000 < sum(cards) < 4_000_000
    assert cards[8] == 3 and cards[2] == 1_013_123
    with pytest.raises(ValueError):
        scaled_cardinalities(0)


def test_the_transform_says_how_the_batches_are_made():
    """datamodule.transform: hashed ids and log1p'd counts, as the TSV reader's; repeating it on the generator's raw
    values gives the batch (what a server must do with raw features)."""
    module = SyntheticCriteoDataModule(num_train_batches=1, batch_size=32, cardinality_scale=0.001, num_workers=0)
    transform = module.transform
    assert transform.raw_features == () and transform.dense_transform == "log1p"
    assert transform.sparse_features == tuple(CRITEO_SPARSE_FEATURES) and len(transform.dense_features) == 13
    rows = module.generator.rows("train", 0, 32)
    batch = module.generator.to_batch(rows)
    ids = torch.stack([transform.feature_ids(f, torch.from_numpy(rows.cat_values[:, f]), torch.from_numpy(rows.cat_missing[:, f]))
                       for f in range(26)], dim=1)
    assert torch.equal(ids, batch.sparse_ids())
    torch.testing.assert_close(transform.dense(torch.from_numpy(rows.dense_values), torch.from_numpy(rows.dense_missing)),
                               batch.dense_features)
    assert DataTransform.from_dict(json.loads(json.dumps(transform.as_dict()))) == transform
