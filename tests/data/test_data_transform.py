"""DataTransform: each feature's id mode, nulls under each, the record a bundle keeps, errors that name the setting."""
from __future__ import annotations

import pytest
import torch

from lightning_persia.data import DataTransform, hash_feature_ids
from lightning_persia.data._batching import sparse_columns
from lightning_persia.data.transform import resolve_ids


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
