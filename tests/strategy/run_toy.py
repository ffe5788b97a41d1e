"""Trains ToyRecommender under PersiaStrategy in its own process (the DDP launcher re-executes this script).

    python run_toy.py --out DIR [--devices 2] [--steps 50] [--staleness 0] [--shards 2]
                      [--epoch-batches N] [--checkpoint-every N] [--resume CKPT]
                      [--slow-after N] [--adagrad] [--no-merge] [--metrics-port P] [--lightning-sampler]
                      [--scale STEP:SHARDS,...] [--scale-in-background]

Every rank writes ``DIR/rank<R>.pt`` (dense state, losses); rank 0 also writes the tables fetched back from
the shards. ``--slow-after N`` writes ``DIR/started`` after N steps and then slows down (for Ctrl-C tests).
With ``--metrics-port P`` every rank serves its metrics, asks the shards for an unknown table once (a PS error),
then scrapes its own endpoint over HTTP and keeps the URL and the text in its file. ``--scale 8:3,16:2`` calls
``scale_shards`` on every rank after those steps (``--scale-in-background``: ``wait=False``); rank 0 keeps the reports.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import INIT, NUM_IDS, Scale, ToyRecommender, loader, make_batches  # noqa: E402

from lightning_persia import SGD, Adagrad, EmbeddingWorkerSettings, MetricsEndpoint, PersiaStrategy, PSSettings  # noqa: E402


class _Record(L.Callback):
    def __init__(self, out: str, slow_after: int) -> None:
        self.out, self.slow_after, self.losses, self.batches = out, slow_after, [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.batches.append(int(batch["index"]))
        if self.slow_after and trainer.global_step >= self.slow_after:
            if trainer.is_global_zero:
                open(os.path.join(self.out, "started"), "w").close()
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--epoch-batches", type=int, default=0, help="batches per epoch (default: --steps)")
    parser.add_argument("--resume")
    parser.add_argument("--slow-after", type=int, default=0)
    parser.add_argument("--data-parallel-max-rows", type=int, default=0)
    parser.add_argument("--t1-rows", type=int, default=NUM_IDS)
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--adagrad", action="store_true", help="row-wise Adagrad on the tables (default SGD)")
    parser.add_argument("--no-merge", action="store_true", help="merge_rank_gradients=False")
    parser.add_argument("--metrics-port", type=int)
    parser.add_argument("--no-workers", action="store_true", help="embedding_workers.count=0 (the trainer's own client calls the shards)")
    parser.add_argument("--lightning-sampler", action="store_true",
                        help="let Lightning deal the batches to the ranks (default: every rank trains every batch)")
    parser.add_argument("--scale", default="", help="STEP:SHARDS,...: scale_shards(SHARDS) after STEP")
    parser.add_argument("--scale-in-background", action="store_true", help="scale_shards(..., wait=False)")
    args = parser.parse_args()

    batches = make_batches(args.epoch_batches or args.steps)  # the same batches in the same order every epoch
    for index, batch in enumerate(batches):
        batch["index"] = torch.tensor([index])
    torch.manual_seed(0)
    model = ToyRecommender(device="meta", t1_rows=args.t1_rows)
    strategy = PersiaStrategy(
        ps=PSSettings(num_local_shards=args.shards, timeout_s=30.0), staleness=args.staleness,
        embedding_optimizer=Adagrad(lr=0.1, rowwise=True) if args.adagrad else SGD(lr=0.1),
        embedding_init=INIT, wire_dtype="fp32", data_parallel_max_rows=args.data_parallel_max_rows,
        merge_rank_gradients=not args.no_merge, embedding_workers=EmbeddingWorkerSettings(count=0) if args.no_workers else None,
        metrics=MetricsEndpoint(port=args.metrics_port) if args.metrics_port is not None else None,
    )
    record = _Record(args.out, args.slow_after)
    scale = Scale({int(step): int(shards) for step, shards in (item.split(":") for item in args.scale.split(",") if item)},
                   wait=not args.scale_in_background)
    callbacks: list[L.Callback] = [record, scale]
    if args.checkpoint_every:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), every_n_train_steps=args.checkpoint_every, save_top_k=1, monitor="step", mode="max"))
    # By default every rank trains every batch, in order: the tests compare the ranks' result with references
    # computed from the whole batch list (Lightning's sampler would deal each rank a shuffled share instead).
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.steps, max_epochs=-1, strategy=strategy,
        use_distributed_sampler=args.lightning_sampler, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(args.checkpoint_every), callbacks=callbacks, accumulate_grad_batches=args.accumulate,
    )
    trainer.fit(model, loader(batches), ckpt_path=args.resume)
    state = {"dense": {k: v.clone() for k, v in model.state_dict().items()}, "losses": record.losses, "batches": record.batches,
             "scale_reports": [(r.from_shards, r.to_shards, r.map_version, r.rows_moved) for r in scale.reports]}
    if trainer.is_global_zero:
        remote = [t.name for t in model.ebc.remote_tables]
        state["tables"] = strategy.client.lookup({name: torch.arange(NUM_IDS) for name in remote}, train=False, wire_dtype="fp32")
    if strategy.metrics_url is not None:
        try:
            strategy.client.lookup({"no.such.table": torch.arange(2)}, train=False)
        except Exception:  # noqa: BLE001 - the refusal is what the metrics must count
            pass
        state["metrics_url"] = strategy.metrics_url
        with urllib.request.urlopen(strategy.metrics_url, timeout=10) as response:
            state["metrics_text"] = response.read().decode()
    torch.save(state, os.path.join(args.out, f"rank{trainer.global_rank}.pt"))
    strategy.close()


if __name__ == "__main__":
    main()
