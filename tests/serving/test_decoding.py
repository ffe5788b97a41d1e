"""CriteoRequestDecoder: request bodies -> CriteoBatch, and the field every refusal names."""
from __future__ import annotations

import pytest
import torch

from lightning_persia.data import make_batch
from lightning_persia.serving import CriteoRequestDecoder, RequestError

DECODER = CriteoRequestDecoder(["a", "b"], num_dense=2)


def test_rows_collate_into_the_batch_the_data_modules_make():
    bodies = [{"sparse": {"a": [3], "b": [-5]}, "dense": [0.5, 1]}, {"sparse": {"a": [7], "b": [2 ** 62]}, "dense": [2.0, -1.5]}]
    batch = DECODER.collate([DECODER.decode(body) for body in bodies])
    reference = make_batch(torch.tensor([[3, -5], [7, 2 ** 62]]), torch.tensor([[0.5, 1.0], [2.0, -1.5]]), torch.zeros(2), ["a", "b"])
    assert batch.sparse_features.keys() == ["a", "b"]
    assert torch.equal(batch.sparse_features.values(), reference.sparse_features.values())
    assert torch.equal(batch.sparse_features.lengths(), reference.sparse_features.lengths())
    assert torch.equal(batch.dense_features, reference.dense_features)


def test_rows_with_several_ids_or_none_per_feature():
    rows = [DECODER.decode({"sparse": {"a": [1, 2, 3], "b": []}, "dense": [0, 0]}), DECODER.decode({"sparse": {"a": [], "b": [9]}, "dense": [0, 0]})]
    features = DECODER.collate(rows).sparse_features.to_dict()
    assert features["a"].lengths().tolist() == [3, 0] and features["a"].values().tolist() == [1, 2, 3]
    assert features["b"].lengths().tolist() == [0, 1] and features["b"].values().tolist() == [9]


@pytest.mark.parametrize("body, field, message", [
    ({"sparse": {"a": [1], "b": [2]}, "dense": [0, 0], "label": 1}, "label", "unknown field"),
    ({"dense": [0, 0]}, "sparse", "missing or not an object"),
    ({"sparse": [1, 2], "dense": [0, 0]}, "sparse", "missing or not an object"),
    ({"sparse": {"a": [1]}, "dense": [0, 0]}, "sparse.b", "missing feature"),
    ({"sparse": {"a": [1], "b": [2], "c": [3]}, "dense": [0, 0]}, "sparse.c", "unknown feature"),
    ({"sparse": {"a": 1, "b": [2]}, "dense": [0, 0]}, "sparse.a", "must be a list of integer ids"),
    ({"sparse": {"a": [True], "b": [2]}, "dense": [0, 0]}, "sparse.a[0]", "True is not an integer id"),
    ({"sparse": {"a": [1], "b": [2, 2 ** 63]}, "dense": [0, 0]}, "sparse.b[1]", "does not fit in 64 bits"),
    ({"sparse": {"a": [1], "b": [2]}}, "dense", "missing or not a list"),
    ({"sparse": {"a": [1], "b": [2]}, "dense": [0, 0, 0]}, "dense", "3 numbers, the model takes 2"),
    ({"sparse": {"a": [1], "b": [2]}, "dense": [0, float("nan")]}, "dense[1]", "nan is not a finite number"),
    ({"sparse": {"a": [1], "b": [2]}, "dense": ["1", 0]}, "dense[0]", "'1' is not a finite number"),
])
def test_every_refusal_names_its_field(body, field, message):
    with pytest.raises(RequestError) as caught:
        DECODER.decode(body)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ") and message in str(caught.value)


def test_scores_need_one_number_per_row():
    assert DECODER.scores(torch.tensor([[0.25], [0.5]]), 2) == [0.25, 0.5]
    with pytest.raises(TypeError, match=r"predict_step returned \(2, 2\) for 2 rows"):
        DECODER.scores(torch.zeros(2, 2), 2)
