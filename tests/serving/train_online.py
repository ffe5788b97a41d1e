"""Goes on training the tiny DLRM of train_tiny.py from its checkpoint, publishing a version every few steps.

    python train_online.py --ckpt DIR/model.ckpt --deltas DELTAS --out OUT [--devices 2] [--versions 3] [--every 2]

Resumes from ``--ckpt`` (the checkpoint the tests' bundle, version 1, is exported from) with
``PublishDeltas(DELTAS, every_n_train_steps=--every)``, and trains ``--versions`` times ``--every`` more steps,
one ``fit`` per version; after each, ``trainer.predict`` on the test batches. Writes ``OUT/online.pt``:
``{version: scores (one tensor per batch)}`` (rank 0; with 2 ranks every rank predicts every batch).
"""
from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tiny import batches, make_model, make_strategy, test_batches  # noqa: E402

from lightning_persia import PublishDeltas  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--deltas", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--every", type=int, default=2)
    args = parser.parse_args()
    model, strategy = make_model(), make_strategy()
    publish = PublishDeltas(args.deltas, every_n_train_steps=args.every)
    start = torch.load(args.ckpt, weights_only=True)["global_step"]
    # Every rank trains every batch (no distributed sampler): the published deltas do not depend on the rank count.
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_steps=start + args.every, strategy=strategy, callbacks=[publish],
                        use_distributed_sampler=False, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    data = torch.utils.data.DataLoader(batches(10, seed=2), batch_size=None)
    test = torch.utils.data.DataLoader(test_batches(), batch_size=None)
    expected = {}
    for round_ in range(args.versions):
        trainer.fit_loop.epoch_loop.max_steps = start + (round_ + 1) * args.every
        trainer.fit(model, data, ckpt_path=args.ckpt if round_ == 0 else None)
        scores = trainer.predict(model, test)
        if trainer.is_global_zero:
            expected[publish.version] = scores
    if trainer.is_global_zero:
        torch.save(expected, os.path.join(args.out, "online.pt"))
    strategy.close()


if __name__ == "__main__":
    main()
