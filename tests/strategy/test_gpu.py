"""The GPU path: batch-local tables on the CUDA device, their copies on side streams, FBGEMM's CUDA kernel where
installed (torch's otherwise). At staleness 0 it trains exactly like the same model trained locally on the GPU,
for every kind of module the strategy serves, with a table kept on the trainer, at every precision.

Run once with ``TORCH_CUDA_SANITIZER=1`` to check the side streams for races (CUDA machines only)."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia import SGD, PersiaStrategy
from lightning_persia.ops.pooled_lookup import kernel_in_use
from lightning_persia.remote_ps.store.initializers import initial_rows
from toy import FEATURES, INIT, NUM_IDS, SEED, make_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI machines have none)")

STEPS = 10
KEPT_ROWS = 8  # t_small's rows: kept on the trainer with data_parallel_max_rows=KEPT_ROWS


def _batches() -> list[dict]:
    """The toy batches, with f2's ids within the kept table, and ids for the plain modules ("item", "bag_ids")."""
    batches = make_batches(STEPS)
    gen = torch.Generator().manual_seed(1)
    for batch in batches:
        kjt = batch["sparse"]
        values = torch.cat([kjt[f].values() if f != "f2" else kjt[f].values() % KEPT_ROWS for f in FEATURES])
        batch["sparse"] = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=kjt.lengths())
        size = batch["labels"].numel()
        batch["item"] = torch.randint(0, NUM_IDS, (size,), generator=gen)
        batch["bag_ids"] = torch.randint(0, NUM_IDS, (size, 2), generator=gen)
    return batches


class _EveryKind(L.LightningModule):
    """A pooled collection (one table remote, one small enough to stay on the trainer), a sequence collection,
    ``nn.EmbeddingBag`` and ``nn.Embedding``, over the toy batches."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        meta = torch.device(device)
        self.ebc = EmbeddingBagCollection(device=meta, tables=[
            EmbeddingBagConfig(name="t_big", embedding_dim=4, num_embeddings=NUM_IDS, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="t_small", embedding_dim=4, num_embeddings=KEPT_ROWS, feature_names=["f2"]),
        ])
        self.ec = EmbeddingCollection(device=meta, tables=[EmbeddingConfig(name="t_seq", embedding_dim=4, num_embeddings=NUM_IDS, feature_names=["f1"])])
        self.bag = nn.EmbeddingBag(NUM_IDS, 4, mode="mean", device=meta)
        self.emb = nn.Embedding(NUM_IDS, 4, device=meta)
        self.mlp = nn.Sequential(nn.Linear(3 * 4 + 4 + 4 + 4 + 3, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, batch: dict) -> torch.Tensor:
        kjt = batch["sparse"]
        pooled = self.ebc(kjt).values()
        seq = self.ec(kjt)["f1"]
        per_row = torch.zeros(kjt.stride(), 4, device=pooled.device, dtype=seq.values().dtype)
        per_row = per_row.index_add(0, torch.repeat_interleave(torch.arange(kjt.stride(), device=pooled.device), seq.lengths()), seq.values())
        bag = self.bag(batch["bag_ids"])
        item = self.emb(batch["item"])
        return self.mlp(torch.cat([pooled, per_row, bag, item, batch["dense"]], dim=1)).squeeze(1)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(self(batch), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def tables(self) -> dict[str, torch.Tensor]:
        """Every table's weight by its name on the shards."""
        out = {f"ebc.{name}": bag.weight for name, bag in self.ebc.embedding_bags.items()}
        out["ec.t_seq"] = self.ec.embeddings["t_seq"].weight
        out["bag"], out["emb"] = self.bag.weight, self.emb.weight
        return out


def _fit(model: L.LightningModule, strategy=None, precision: str = "32-true") -> None:
    extra = dict(strategy=strategy) if strategy else {}
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=STEPS, precision=precision, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **extra)
    trainer.fit(model, torch.utils.data.DataLoader(_batches(), batch_size=None))


@pytest.mark.parametrize("precision,tolerance", [("32-true", 1e-5), ("16-mixed", 5e-3), ("bf16-mixed", 2e-2)])
def test_every_module_kind_trains_on_the_gpu_exactly_like_local_gpu_training(precision, tolerance, capsys):
    torch.manual_seed(0)
    local = _EveryKind()
    with torch.no_grad():
        for name, weight in local.tables().items():
            weight.copy_(initial_rows(INIT, SEED, name, torch.arange(weight.shape[0]), weight.shape[1]))
    remote = _EveryKind(device="meta")
    remote.mlp.load_state_dict(local.mlp.state_dict())
    _fit(local, precision=precision)
    strategy = PersiaStrategy(staleness=0, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, wire_dtype="fp32",
                              data_parallel_max_rows=KEPT_ROWS)
    try:
        _fit(remote, strategy, precision=precision)
        assert strategy.pipeline.device.type == "cuda" and strategy.pipeline.transfer.on_gpu
        assert strategy.pipeline.prefetch_misses == 0, "a module's input was not recognised as the planned one"
        trained = local.tables()
        for name in ("ebc.t_big", "ec.t_seq", "bag", "emb"):
            rows = strategy.client.lookup({name: torch.arange(NUM_IDS)}, train=False, wire_dtype="fp32")[name]
            torch.testing.assert_close(rows, trained[name].detach().cpu(), rtol=0, atol=tolerance, msg=f"table {name}")
        kept = remote.ebc.data_parallel
        torch.testing.assert_close(kept.table_view(0).detach().cpu(), trained["ebc.t_small"].detach().cpu(), rtol=0, atol=tolerance)
        for name, value in local.mlp.state_dict().items():
            torch.testing.assert_close(remote.mlp.state_dict()[name].cpu(), value.cpu(), rtol=0, atol=tolerance)
    finally:
        strategy.close()


def test_the_start_up_line_names_the_pooled_lookup_kernel(caplog):
    strategy = PersiaStrategy(staleness=1, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT)
    try:
        with caplog.at_level("INFO"):
            _fit(_EveryKind(device="meta"), strategy)
        line = next(r.getMessage() for r in caplog.records if "pooled lookups on cuda" in r.getMessage())
        assert kernel_in_use("cuda") in line
    finally:
        strategy.close()

