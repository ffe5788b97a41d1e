"""Smoke test of an installed lightning-persia (scripts/wheel_smoke.sh runs it in a fresh virtualenv).

Run it outside the source checkout, so that ``import lightning_persia`` finds the installed package. Checks
that the package and its console script are installed, that its native kernels were compiled into it, and
that a Trainer with PersiaStrategy trains a TorchRec model for a few steps on two embedded shards.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import lightning_persia
from lightning_persia import Adagrad, PersiaStrategy, PSSettings
from lightning_persia.ops import native
from lightning_persia.remote_ps.store import native as store_native


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=1 << 40, feature_names=["f"])],
            device=torch.device("meta"),
        )
        self.head = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.ebc(batch["sparse"]).values()).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batches(count: int) -> list:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        lengths = torch.randint(1, 3, (8,), generator=gen)
        ids = torch.randint(0, 1 << 40, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=lengths)
        out.append({"sparse": kjt, "labels": (torch.rand(8, generator=gen) < 0.5).float()})
    return out


def main() -> None:
    installed = Path(lightning_persia.__file__).resolve().parent
    assert "site-packages" in installed.parts, f"lightning_persia imported from {installed}, not from an installed package"
    assert native.available() and store_native.available(), "the native kernels were not compiled into the installed package"
    script = shutil.which("lightning-persia", path=os.path.dirname(sys.executable))
    assert script, "the lightning-persia console script is not installed beside this Python"
    usage = subprocess.run([script, "--help"], capture_output=True, text=True, check=True).stdout
    assert "ps" in usage and "fit" in usage, usage

    strategy = PersiaStrategy(ps=PSSettings(num_local_shards=2), staleness=1, embedding_optimizer=Adagrad(lr=0.1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(batches(4), batch_size=None))
    stats = strategy.client.stats()
    rows = sum(table["rows"] for shard in stats for table in shard["tables"].values())
    strategy.close()
    assert trainer.global_step == 4 and rows > 0, (trainer.global_step, rows)
    print(f"smoke test passed: lightning_persia from {installed}, native kernels {native.LIBRARY.built().name} and "
          f"{store_native.LIBRARY.built().name}, "
          f"4 steps on 2 shards holding {rows} rows")


if __name__ == "__main__":
    main()
