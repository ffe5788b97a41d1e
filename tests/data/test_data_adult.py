"""UCI Adult: the standard split, label balance, features."""
from __future__ import annotations

import pytest
import torch

from lightning_persia.data import (
    ADULT_CARDINALITIES,
    ADULT_DENSE_FEATURES,
    ADULT_NUM_TEST,
    ADULT_NUM_TRAIN,
    ADULT_SPARSE_FEATURES,
    AdultDataModule,
    CriteoBatch,
)


@pytest.fixture(scope="module")
def dm() -> AdultDataModule:
    dm = AdultDataModule(batch_size=512)
    dm.setup("fit")
    return dm


def _rows(loader):
    batches = list(loader)
    assert all(isinstance(b, CriteoBatch) for b in batches)
    return torch.cat([b.labels for b in batches]), torch.cat([b.dense_features for b in batches])


def test_standard_split_sizes_and_label_balance(dm):
    assert (ADULT_NUM_TRAIN, ADULT_NUM_TEST) == (32_561, 16_281)
    train_labels, train_dense = _rows(dm.train_dataloader())
    test_labels, _ = _rows(dm.test_dataloader())
    val_labels, _ = _rows(dm.val_dataloader())
    assert len(train_labels) == 32_561 and len(test_labels) == len(val_labels) == 16_281
    # adult.data has 7,841 positives (24.08%), adult.test 3,846 (23.62%)
    assert int(train_labels.sum()) == 7_841 and int(test_labels.sum()) == 3_846
    assert not torch.isnan(train_dense).any()


def test_training_rows_are_the_original_adult_data(dm):
    table = dm.table
    train = table.split("train")
    first = table.dense[train][0].double() * torch.from_numpy(table.std) + torch.from_numpy(table.mean)
    # adult.data starts "39, State-gov, 77516, Bachelors, 13, ..."
    assert first[:3].round().tolist() == [39.0, 77516.0, 13.0]
    assert table.ids[train][0, 0] == table.vocabularies["workclass"]["State-gov"]
    # dense features standardised with training statistics
    torch.testing.assert_close(table.dense[train].mean(0), torch.zeros(6), atol=1e-4, rtol=0)
    torch.testing.assert_close(table.dense[train].std(0), torch.ones(6), atol=1e-3, rtol=0)


def test_sparse_features(dm):
    assert dm.cardinalities == ADULT_CARDINALITIES
    batch = next(iter(dm.test_dataloader()))
    kjt = batch.sparse_features
    assert kjt.keys() == ADULT_SPARSE_FEATURES and len(ADULT_SPARSE_FEATURES) == 8
    assert batch.dense_features.shape[1] == len(ADULT_DENSE_FEATURES) == 6
    ids = batch.sparse_ids()
    assert bool((ids >= 0).all()) and bool((ids < torch.tensor(ADULT_CARDINALITIES)).all())
    # '?' (missing) is id 0: workclass, occupation and native-country have missing values
    all_ids = dm.table.ids
    assert {0} == {int(all_ids[:, i].min()) for i in (0, 3, 7)}
    assert int(all_ids[:, 1].min()) == 1  # education is never missing
