"""Trains a tiny DLRM under PersiaStrategy (2 shards, fp32 wire) in its own process, for the serving tests.

    python train_tiny.py --out DIR

Writes ``DIR/model.ckpt`` (+ ``model.ckpt.ps/``) and ``DIR/expected.pt``: the requests of a few batches (sparse
ids per feature and dense values per row, an id never trained among them) and ``trainer.predict``'s scores for them.
One table (``cat_2``, 8 rows) is kept on the trainer (``data_parallel_max_rows``), the others are remote.
"""
from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_dlrm import FEATURES, NUM_DENSE, NUM_EMBEDDINGS, ROOT, UNSEEN_ID  # noqa: E402

sys.path.insert(0, str(ROOT))  # the examples
from examples.dlrm.model import DLRM  # noqa: E402

from lightning_persia import SGD, PersiaStrategy, PSSettings  # noqa: E402
from lightning_persia.data import make_batch  # noqa: E402


def batches(count: int, seed: int, batch_size: int = 16) -> list:
    """Vocabulary ids (each below its table's rows, as a data module with ``ids: raw`` gives them), dense in [0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.tensor(NUM_EMBEDDINGS)
    return [
        make_batch((torch.rand(batch_size, len(FEATURES), generator=gen) * rows).long(), torch.rand(batch_size, NUM_DENSE, generator=gen),
                   (torch.rand(batch_size, generator=gen) < 0.3).float(), FEATURES)
        for _ in range(count)
    ]


def make_model() -> DLRM:
    torch.manual_seed(0)
    return DLRM(embedding_dim=4, num_embeddings=NUM_EMBEDDINGS, sparse_features=FEATURES, num_dense_features=NUM_DENSE,
                bottom_mlp=[8], top_mlp=[8], embedding_device="meta")


def make_strategy() -> PersiaStrategy:
    return PersiaStrategy(ps=PSSettings(num_local_shards=2, seed=3), staleness=0, embedding_optimizer=SGD(lr=0.1), wire_dtype="fp32",
                          data_parallel_max_rows=8)


def test_batches() -> list:
    """The batches whose scores the tests compare; row 0 of cat_0 holds an id the tables never saw."""
    test = batches(3, seed=1)
    test[0].sparse_features.values()[0] = UNSEEN_ID
    return test


def requests_of(test: list) -> list[dict]:
    """The JSON bodies of the rows of ``test``, one request per row."""
    requests = []
    for batch in test:
        ids = batch.sparse_ids()
        requests += [{"transformed": True, "sparse": {f: [int(ids[row, i])] for i, f in enumerate(FEATURES)}, "dense": batch.dense_features[row].tolist()}
                     for row in range(batch.batch_size)]
    return requests


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, strategy = make_model(), make_strategy()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=30, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(batches(30, seed=0), batch_size=None))
    trainer.save_checkpoint(os.path.join(args.out, "model.ckpt"))
    test = test_batches()
    scores = trainer.predict(model, torch.utils.data.DataLoader(test, batch_size=None))
    torch.save({"batches": test, "scores": scores, "requests": requests_of(test), "flat_scores": torch.cat(scores).tolist()},
               os.path.join(args.out, "expected.pt"))
    strategy.close()


if __name__ == "__main__":
    main()
