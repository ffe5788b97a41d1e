"""The GPU path: batch-local tables on the CUDA device, FBGEMM's CUDA kernel where installed, torch's otherwise."""
from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_persia import SGD, PersiaStrategy
from lightning_persia.ops.pooled_lookup import fbgemm_available
from toy import INIT, NUM_IDS, ToyRecommender, loader, make_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI machines have none)")


def _fit(model, steps, strategy=None, precision="32-true"):
    extra = dict(strategy=strategy) if strategy else {}
    L.Trainer(accelerator="gpu", devices=1, max_steps=steps, precision=precision, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, **extra).fit(model, loader(make_batches(steps)))


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_gpu_training_matches_local_gpu_training(precision):
    torch.manual_seed(0)
    local = ToyRecommender()
    local.load_ps_initial_rows()
    remote = ToyRecommender(device="meta")
    remote.mlp.load_state_dict(local.mlp.state_dict())
    _fit(local, 10, precision=precision)
    strategy = PersiaStrategy(staleness=0, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, wire_dtype="fp32")
    try:
        _fit(remote, 10, strategy, precision=precision)
        assert strategy.pipeline.device.type == "cuda"
        print("fbgemm CUDA kernel in use:", fbgemm_available("cuda"))
        tolerance = 1e-4 if precision == "32-true" else 5e-3
        for table in ("t0", "t1"):
            rows = strategy.client.lookup({f"ebc.{table}": torch.arange(NUM_IDS)}, train=False, wire_dtype="fp32")[f"ebc.{table}"]
            torch.testing.assert_close(rows, local.ebc.embedding_bags[table].weight.detach().cpu(), rtol=0, atol=tolerance)
    finally:
        strategy.close()
