"""Predictor.from_bundle: equals trainer.predict, with embedded or external inference shards of any count."""
from __future__ import annotations

import pytest
import torch

from lightning_persia.data import DataTransform
from lightning_persia.remote_ps.client import PSClient
from lightning_persia.serving import BundleError, CriteoRequestDecoder, Predictor, RequestError, export_bundle
from tiny_dlrm import FEATURES, MODEL_CLASS


def _check_equal(predictor: Predictor, expected: dict, atol: float) -> None:
    for batch, reference in zip(expected["batches"], expected["scores"]):
        prediction = predictor.predict(batch)
        assert prediction.version == 1
        torch.testing.assert_close(prediction.output, reference, atol=atol, rtol=0)


def test_embedded_read_only_shards_answer_as_trainer_predict_and_insert_nothing(trained, bundle):
    with Predictor.from_bundle(bundle.path) as predictor:
        assert len(predictor.ps_addresses) == bundle.num_shards == 2
        assert predictor.sparse_features == FEATURES and predictor.version == 1
        assert predictor.raw_id_rows == {}  # no transform recorded: the kept table folds ids, as training did
        _check_equal(predictor, trained.expected, atol=1e-6)  # the first batch holds an id training never saw
        with PSClient(predictor.ps_addresses) as client:
            tables = {name: stats for shard in client.stats() for name, stats in shard["tables"].items()}
        assert sorted(tables) == sorted(bundle.remote_tables)
        assert all(stats["inserted"] == 0 for stats in tables.values())


@pytest.mark.parametrize("num_shards", [1, 3])
def test_a_two_shard_bundle_served_by_other_shard_counts(trained, bundle, start_ps_cluster, num_shards):
    shards = start_ps_cluster(num_shards, extra_args=["--read-only", "--restore-from", str(bundle.path)])
    with Predictor.from_bundle(bundle.path, ps_addresses=shards.addresses) as predictor:
        _check_equal(predictor, trained.expected, atol=1e-6)
    if num_shards == 1:  # rows in fp16 on the wire (training used fp32)
        with Predictor.from_bundle(bundle.path, ps_addresses=shards.addresses, wire_dtype="fp16") as predictor:
            _check_equal(predictor, trained.expected, atol=1e-3)


def test_shards_that_do_not_serve_the_bundle_are_refused(bundle, ps_cluster):
    with pytest.raises(BundleError, match=r"do not serve table 'ebc\.cat_0' \(dim 4\).*--read-only --restore-from"):
        Predictor.from_bundle(bundle.path, ps_addresses=ps_cluster.addresses)


def test_a_bundle_records_the_data_transform_and_raw_requests_score_as_the_transformed(trained, tmp_path):
    # The tiny model trained on vocabulary ids and untransformed dense values: its data module's transform is raw/none.
    transform = DataTransform(tuple(FEATURES), ("raw",) * len(FEATURES), ("d0", "d1", "d2"), "none")
    raw_bundle = export_bundle(trained.ckpt, tmp_path / "bundle", model_class=MODEL_CLASS, data_transform=transform)
    assert raw_bundle.data_transform == transform
    requests, expected = trained.expected["requests"][:8], trained.expected["flat_scores"][:8]
    with Predictor.from_bundle(raw_bundle.path) as predictor:
        assert predictor.raw_id_rows == {"cat_2": 8}  # the kept table indexes its raw ids directly, as in training
        decoder = CriteoRequestDecoder.from_predictor(predictor)
        assert decoder.transform == transform and decoder.raw_id_rows == {"cat_2": 8}
        raw = [{"sparse": body["sparse"], "dense": body["dense"]} for body in requests]  # not marked: the transform applies
        for bodies in (requests, raw):
            scores = decoder.scores(predictor.predict(decoder.collate([decoder.decode(b) for b in bodies])).output, len(bodies))
            torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), atol=1e-6, rtol=0)
        outside = {"sparse": {"cat_0": [1], "cat_1": [1], "cat_2": [8]}, "dense": [0.0, 0.0, 0.0]}
        for body in (outside, {**outside, "transformed": True}):
            with pytest.raises(RequestError, match=r"sparse.cat_2: raw id 8 is outside the 8 rows of the feature's table kept"):
                decoder.decode(body)
        with pytest.raises(ValueError, match=r"feature 'cat_2': id 8 is outside its table of 8 rows"):  # not folded into a row
            predictor.predict(CriteoRequestDecoder(FEATURES, 3).collate([CriteoRequestDecoder(FEATURES, 3).decode({**outside, "transformed": True})]))
