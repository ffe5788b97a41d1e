"""A tiny recommender and its data, shared by the strategy tests (and their subprocess scripts)."""
from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.remote_ps.store.initializers import initial_rows
from lightning_persia.remote_ps.table_config import Uniform

NUM_IDS = 40
FEATURES = ["f0", "f1", "f2"]
INIT = Uniform(-0.1, 0.1)
SEED = 0


def make_batches(count: int, batch_size: int = 16, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.randint(0, 4, (len(FEATURES) * batch_size,), generator=gen)
        values = torch.randint(0, NUM_IDS, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths)
        dense = torch.randn(batch_size, 3, generator=gen)
        labels = (torch.rand(batch_size, generator=gen) < 0.3).float()
        batches.append({"sparse": kjt, "dense": dense, "labels": labels})
    return batches


class ToyRecommender(L.LightningModule):
    """EBC with a table of its own for f0 and one shared by f1 and f2, plus a small MLP.

    ``t1_rows`` makes t1 larger than the ids the batches use (which stay below ``NUM_IDS``).
    """

    def __init__(self, device: str = "cpu", lr: float = 0.1, t1_rows: int = NUM_IDS) -> None:
        super().__init__()
        self.lr = lr
        self.mlp = nn.Sequential(nn.Linear(3 * 4 + 3, 8), nn.ReLU(), nn.Linear(8, 1))
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=NUM_IDS, feature_names=["f0"]),
                EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=t1_rows, feature_names=["f1", "f2"]),
            ],
            device=torch.device(device),
        )

    def forward(self, batch: dict) -> torch.Tensor:
        pooled = self.ebc(batch["sparse"]).values()
        return self.mlp(torch.cat([pooled, batch["dense"]], dim=1)).squeeze(1)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.binary_cross_entropy_with_logits(self(batch), batch["labels"])
        self.log("train_loss", loss, batch_size=batch["labels"].numel())
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss = nn.functional.binary_cross_entropy_with_logits(self(batch), batch["labels"])
        self.log("val_loss", loss, batch_size=batch["labels"].numel())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def load_ps_initial_rows(self) -> None:
        """Sets the local tables to the rows the parameter server would create (for comparisons)."""
        with torch.no_grad():
            for name in ("t0", "t1"):
                weight = self.ebc.embedding_bags[name].weight
                weight.copy_(initial_rows(INIT, SEED, f"ebc.{name}", torch.arange(weight.shape[0]), 4))


def loader(batches: list[dict]) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)


class Scale(L.Callback):
    """Scales the embedded shards after the given steps: ``{step: shard count}``, called on every rank as a Lightning
    callback is. ``wait=False``: training goes on during each move (a move waits for the one before it, and fit's end
    for the last). :attr:`reports` holds the moves' reports (rank 0's: the other ranks get None and keep none)."""

    def __init__(self, plan: dict[int, int], wait: bool = True) -> None:
        self.plan, self.wait = plan, wait
        self.reports = []
        self._moving = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in self.plan:
            self._settle()
            outcome = trainer.strategy.scale_shards(self.plan[trainer.global_step], wait=self.wait)
            if self.wait:
                self._keep(outcome)
            else:
                self._moving = outcome

    def on_train_end(self, trainer, pl_module) -> None:
        self._settle()

    def _settle(self) -> None:
        if self._moving is not None:
            self._keep(self._moving.result(timeout=300))
            self._moving = None

    def _keep(self, report) -> None:
        if report is not None:
            self.reports.append(report)
