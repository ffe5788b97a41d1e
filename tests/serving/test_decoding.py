"""CriteoRequestDecoder: request bodies -> CriteoBatch, and the field every refusal names."""
from __future__ import annotations

import math

import pytest
import torch

from lightning_persia.data import DataTransform, hash_categorical, hash_feature_ids, make_batch, string_key
from lightning_persia.serving import CriteoRequestDecoder, RequestError

DECODER = CriteoRequestDecoder(["a", "b"], num_dense=2)


def test_rows_collate_into_the_batch_the_data_modules_make():
    bodies = [{"transformed": True, "sparse": {"a": [3], "b": [-5]}, "dense": [0.5, 1]}, {"transformed": True, "sparse": {"a": [7], "b": [2 ** 62]}, "dense": [2.0, -1.5]}]
    batch = DECODER.collate([DECODER.decode(body) for body in bodies])
    reference = make_batch(torch.tensor([[3, -5], [7, 2 ** 62]]), torch.tensor([[0.5, 1.0], [2.0, -1.5]]), torch.zeros(2), ["a", "b"])
    assert batch.sparse_features.keys() == ["a", "b"]
    assert torch.equal(batch.sparse_features.values(), reference.sparse_features.values())
    assert torch.equal(batch.sparse_features.lengths(), reference.sparse_features.lengths())
    assert torch.equal(batch.dense_features, reference.dense_features)


def test_rows_with_several_ids_or_none_per_feature():
    rows = [DECODER.decode({"transformed": True, "sparse": {"a": [1, 2, 3], "b": []}, "dense": [0, 0]}), DECODER.decode({"transformed": True, "sparse": {"a": [], "b": [9]}, "dense": [0, 0]})]
    features = DECODER.collate(rows).sparse_features.to_dict()
    assert features["a"].lengths().tolist() == [3, 0] and features["a"].values().tolist() == [1, 2, 3]
    assert features["b"].lengths().tolist() == [0, 1] and features["b"].values().tolist() == [9]


@pytest.mark.parametrize("body, field, message", [
    ({"transformed": True, "sparse": {"a": [1], "b": [2]}, "dense": [0, 0], "label": 1}, "label", "unknown field"),
    ({"transformed": True, "dense": [0, 0]}, "sparse", "missing or not an object"),
    ({"transformed": True, "sparse": [1, 2], "dense": [0, 0]}, "sparse", "missing or not an object"),
    ({"transformed": True, "sparse": {"a": [1]}, "dense": [0, 0]}, "sparse.b", "missing feature"),
    ({"transformed": True, "sparse": {"a": [1], "b": [2], "c": [3]}, "dense": [0, 0]}, "sparse.c", "unknown feature"),
    ({"transformed": True, "sparse": {"a": 1, "b": [2]}, "dense": [0, 0]}, "sparse.a", "must be a list of integer ids"),
    ({"transformed": True, "sparse": {"a": [True], "b": [2]}, "dense": [0, 0]}, "sparse.a[0]", "True is not an integer id"),
    ({"transformed": True, "sparse": {"a": [1], "b": [2, 2 ** 63]}, "dense": [0, 0]}, "sparse.b[1]", "does not fit in 64 bits"),
    ({"transformed": True, "sparse": {"a": [1], "b": [2]}}, "dense", "missing or not a list"),
    ({"transformed": True, "sparse": {"a": [1], "b": [2]}, "dense": [0, 0, 0]}, "dense", "3 numbers, the model takes 2"),
    ({"transformed": True, "sparse": {"a": [1], "b": [2]}, "dense": [0, float("nan")]}, "dense[1]", "nan is not a finite number"),
    ({"transformed": True, "sparse": {"a": [1], "b": [2]}, "dense": ["1", 0]}, "dense[0]", "'1' is not a finite number"),
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


HASHED = DataTransform(("a", "b"), ("hash", "hash"), ("x", "y"), "log1p", text_ids="hex")
RAW_DECODER = CriteoRequestDecoder(["a", "b"], num_dense=2, transform=HASHED)


def test_raw_features_get_the_data_module_s_transform_and_equal_the_transformed_request():
    # Criteo TSV cells: hex categorical values (null: missing), dense counts (null: missing)
    raw = {"sparse": {"a": "68fd1e64", "b": [None]}, "dense": [3, None]}
    values = torch.tensor([[0x68FD1E64, 0]])
    ids = hash_categorical(values, torch.tensor([[False, True]]))[0].tolist()
    transformed = {"transformed": True, "sparse": {"a": [ids[0]], "b": [ids[1]]}, "dense": [math.log1p(3), 0.0]}
    from_raw, from_transformed = (RAW_DECODER.collate([RAW_DECODER.decode(body)]) for body in (raw, transformed))
    assert torch.equal(from_raw.sparse_features.values(), from_transformed.sparse_features.values())
    torch.testing.assert_close(from_raw.dense_features, from_transformed.dense_features)


def test_a_raw_id_sent_to_a_model_of_hashed_ids_is_hashed_not_read_as_it_is():
    (ids_a, ids_b), _ = RAW_DECODER.decode({"sparse": {"a": [5], "b": []}, "dense": [0, 0]})
    assert ids_a == [int(hash_feature_ids(torch.tensor([5]), 0)[0])] and ids_a != [5] and ids_b == []


def test_each_feature_s_ids_as_its_mode_says_and_raw_ids_within_their_kept_table():
    # a raw feature (vocabulary ids; its table of 100 rows kept on the trainers) and a hashed string feature (Parquet)
    transform = DataTransform(("a", "b"), ("hash", "raw"), ("x",), "none", text_ids="string")
    decoder = CriteoRequestDecoder(["a", "b"], num_dense=1, transform=transform, raw_id_rows={"b": 100})
    (ids_a, ids_b), dense = decoder.decode({"sparse": {"a": ["US", None], "b": [7, None, 99]}, "dense": [-2.5]})
    assert ids_a == hash_feature_ids(torch.tensor([string_key("US"), 0]), 0, torch.tensor([False, True])).tolist()
    assert (ids_b, dense) == ([7, 99], [-2.5])  # raw: as sent, a null is no id (as the readers leave it out)
    for body in ({"sparse": {"a": [], "b": [100]}, "dense": [0]}, {"transformed": True, "sparse": {"a": [], "b": [-1]}, "dense": [0]}):
        with pytest.raises(RequestError) as caught:
            decoder.decode(body)
        assert caught.value.field == "sparse.b" and "is outside the 100 rows of the feature's table kept on the trainers" in str(caught.value)
    with pytest.raises(RequestError, match=r"sparse.b\[0\]: 'x7' is text; raw ids are integers"):
        decoder.decode({"sparse": {"a": [], "b": ["x7"]}, "dense": [0]})
    unkept = CriteoRequestDecoder(["b"], num_dense=1, transform=transform)  # a raw feature on a remote table: any int64
    assert unkept.decode({"sparse": {"b": [2 ** 40]}, "dense": [0]})[0] == [[2 ** 40]]


@pytest.mark.parametrize("body, field, message", [
    ({"sparse": {"a": ["zz"], "b": []}, "dense": [0, 0]}, "sparse.a[0]", "'zz' is not a hex categorical value"),
    ({"sparse": {"a": [2 ** 64], "b": []}, "dense": [0, 0]}, "sparse.a[0]", "does not fit in 64 bits"),
    ({"sparse": {"a": [1.5], "b": []}, "dense": [0, 0]}, "sparse.a[0]", "1.5 is not an integer or text categorical value"),
    ({"sparse": {"a": [1], "b": []}, "dense": [0]}, "dense", "1 values for the 2 dense features ['x', 'y']"),
    ({"sparse": {"a": [1], "b": []}, "dense": [0, "3"]}, "dense[1]", "'3' is not a finite number or null"),
    ({"transformed": "yes", "sparse": {"a": [1], "b": []}, "dense": [0, 0]}, "transformed", "must be true or false"),
])
def test_every_refusal_of_a_raw_request_names_its_field(body, field, message):
    with pytest.raises(RequestError) as caught:
        RAW_DECODER.decode(body)
    assert caught.value.field == field and message in str(caught.value)


def test_a_raw_request_to_a_model_whose_bundle_records_no_transform_is_refused_saying_how_to_send_it():
    with pytest.raises(RequestError, match='transformed: .*records no data transform.*"transformed": true'):
        DECODER.decode({"sparse": {"a": [1], "b": [2]}, "dense": [0, 0]})


def test_a_transform_that_does_not_make_the_model_s_features_is_refused():
    with pytest.raises(ValueError, match=r"the model reads features \['c'\]"):
        CriteoRequestDecoder(["a", "c"], num_dense=2, transform=HASHED)
    with pytest.raises(ValueError, match="the model takes 3 dense features, its data module's transform makes 2"):
        CriteoRequestDecoder(["a"], num_dense=3, transform=HASHED)
