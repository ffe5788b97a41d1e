"""One training run of ``wal_bench.py``: a small DLRM on synthetic Criteo batches under PersiaStrategy, its tables on
the shards at ``--ps-addresses`` (started and killed by the bench). Prints the ``PHASE`` marks of
``lightning_persia.testing.phases`` and ``ROLLBACKS``; at the end writes the dense weights and a PS checkpoint of
every table row under ``--out``, and in ``result.json`` the test AUC and the lag of the steps' lookups (how many
earlier steps' updates were unacknowledged when each lookup went out and when it was answered, read from the
trainer's Prometheus metrics: ``wal/lag.py``).

    python -m benchmarks.wal.train --ps-addresses 127.0.0.1:5000,127.0.0.1:5001 --out /tmp/run --steps 300
"""
from __future__ import annotations

import argparse
import json
import os
import urllib.request
from pathlib import Path

import torch

TEST_BATCHES = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ps-addresses", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same arithmetic in every run: the weights are compared bit for bit

    import lightning as L

    from benchmarks.wal.lag import lag_figures
    from examples.dlrm.model import DLRM
    from lightning_persia import Adagrad, PersiaStrategy, PSSettings
    from lightning_persia.data import SyntheticCriteoDataModule
    from lightning_persia.strategy.recovery import RecoveryConfig
    from lightning_persia.strategy.metrics import MetricsEndpoint
    from lightning_persia.testing.phases import PhaseMarks

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_batches=args.steps, num_val_batches=TEST_BATCHES, num_test_batches=TEST_BATCHES,
                                     batch_size=args.batch_size, cardinality_scale=0.01, seed=0)
    model = DLRM(embedding_dim=8, bottom_mlp=[32], top_mlp=[32], embedding_device="meta")
    strategy = PersiaStrategy(
        ps=PSSettings(addresses=args.ps_addresses.split(","), timeout_s=5.0), staleness=args.staleness,
        embedding_optimizer=Adagrad(lr=0.2, rowwise=True), wire_dtype="fp32",
        recovery=RecoveryConfig(wait_for_shards_s=120, max_rollbacks=50, client_backoff_s=0.05, client_max_backoff_s=0.2),
        metrics=MetricsEndpoint(port=0),  # a free port: the lag histograms are read from it below
    )
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=args.checkpoint_every,
                                                      save_top_k=1, monitor="step", mode="max")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, max_epochs=1, strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[PhaseMarks(), checkpoints])
    trainer.fit(model, datamodule=data)
    with urllib.request.urlopen(strategy.metrics_url, timeout=30) as page:
        lag = lag_figures(page.read().decode())
    metrics = trainer.test(model, datamodule=data, verbose=False)[0]
    torch.save({k: v for k, v in model.state_dict().items() if not k.startswith("ebc.")}, args.out / "dense.pt")
    strategy.client.save(str(args.out / "tables"))
    result = {"test_auc": float(metrics["test_auc"]), "rollbacks": len(strategy.rollbacks), "global_step": trainer.global_step, "lag": lag}
    (args.out / "result.json").write_text(json.dumps(result))
    strategy.close()
    os._exit(0)  # the shards belong to the bench; nothing else to wait for


if __name__ == "__main__":
    main()
