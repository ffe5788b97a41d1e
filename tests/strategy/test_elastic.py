"""Shards added and drained while a Trainer fits: at staleness 0 the run ends with exactly the weights of a run that
never scaled (embedded shards, embedding workers on, real processes)."""
from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_persia import SGD, PersiaStrategy
from toy import INIT, NUM_IDS, Scale, ToyRecommender, loader, make_batches

STEPS = 24


def _fit(staleness: int, plan: dict[int, int], wait: bool = True):
    torch.manual_seed(0)
    model = ToyRecommender(device="meta")
    strategy = PersiaStrategy(staleness=staleness, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, wire_dtype="fp32")
    scale = Scale(plan, wait)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, strategy=strategy, callbacks=[scale])
    try:
        trainer.fit(model, loader(make_batches(STEPS)))
        rows = {t: strategy.client.lookup({f"ebc.{t}": torch.arange(NUM_IDS)}, train=False, wire_dtype="fp32")[f"ebc.{t}"]
                for t in ("t0", "t1")}
        return rows, {k: v.clone() for k, v in model.mlp.state_dict().items()}, scale.reports, strategy.client
    finally:
        strategy.close()


def test_scaling_2_3_2_at_staleness_zero_ends_with_the_weights_of_a_run_that_never_scaled():
    rows, dense, _, _ = _fit(0, {})
    scaled_rows, scaled_dense, reports, client = _fit(0, {8: 3, 16: 2})
    assert [(r.from_shards, r.to_shards, r.map_version) for r in reports] == [(2, 3, 1), (3, 2, 2)]
    assert all(r.rows_moved > 0 for r in reports)
    assert client.shard_map.version == 2
    for table in rows:
        assert torch.equal(scaled_rows[table], rows[table]), table
    for name in dense:
        assert torch.equal(scaled_dense[name], dense[name]), name


@pytest.mark.scenario  # half a minute of processes or more: CI's scenario step (`make scenarios`), not `make test`
def test_scaling_in_the_background_while_training_goes_on_ends_with_the_same_weights():
    rows, dense, _, _ = _fit(0, {})
    scaled_rows, scaled_dense, reports, _ = _fit(0, {6: 3, 14: 2}, wait=False)
    assert [(r.from_shards, r.to_shards, r.map_version) for r in reports] == [(2, 3, 1), (3, 2, 2)]
    for table in rows:
        assert torch.equal(scaled_rows[table], rows[table]), table
    for name in dense:
        assert torch.equal(scaled_dense[name], dense[name]), name


def test_scaling_refuses_a_cluster_it_did_not_start():
    strategy = PersiaStrategy()
    with pytest.raises(RuntimeError, match="did not start"):
        strategy.scale_shards(3)
