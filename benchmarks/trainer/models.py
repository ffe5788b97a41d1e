"""The benchmarks' models, with their tables either remote (PersiaStrategy) or local and fused.

* ``dlrm`` (train_bench.py): the example DLRM;
* ``linear`` (pipeline_bench.py): the same 26 tables and one ``Linear`` over the dense features and the pooled
  embeddings, so that the embedding path, not the MLPs, is what a step costs (as on a GPU).

Every configuration builds the model with its ``EmbeddingBagCollection`` on the ``meta`` device right after
``torch.manual_seed(seed)``, so the dense layers start from the same weights everywhere. Then:

* remote runs hand the meta collection to ``PersiaStrategy``, which swaps it for its remote twin;
* the local baseline replaces it by a TorchRec ``FusedEmbeddingBagCollection`` on the run's device (FBGEMM's
  ``SplitTableBatchedEmbeddingBagsCodegen``, one batched kernel for all 26 tables, with the optimizer fused
  into the backward: ``EXACT_ROWWISE_ADAGRAD``) whose rows start from exactly the values the parameter
  server gives the same ids (its deterministic ``(seed, table, id)`` initialiser), so local and remote runs
  differ only in where the embeddings live and are updated.
"""
from __future__ import annotations

import math
from typing import List

import torch
from torch import nn
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad

from examples.common import RecommenderModule, embedding_bag_collection
from examples.dlrm.model import DLRM
from lightning_persia.data import CRITEO_NUM_DENSE, CRITEO_SPARSE_FEATURES, CriteoBatch
from lightning_persia.remote_ps.store.initializers import initial_rows
from lightning_persia.remote_ps.table_config import Uniform

EBC_PATH = "ebc"  # where DLRM keeps its collection: the remote tables are named "ebc.<table>"


class _FusedAware(RecommenderModule):
    """``configure_optimizers`` leaves a fused local collection (``self.ebc``) to its own (fused) optimizer."""

    ebc: nn.Module

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if isinstance(self.ebc, FusedEmbeddingBagCollection):
            fused = {id(p) for p in self.ebc.parameters()}
            dense = [p for p in self.parameters() if p.requires_grad and id(p) not in fused]
            return torch.optim.Adam(dense, lr=self.lr, weight_decay=self.weight_decay)
        return super().configure_optimizers()


class BenchDLRM(_FusedAware, DLRM):
    """The example DLRM (train_bench.py)."""


class BenchLinear(_FusedAware):
    """DLRM's 26 tables and one ``Linear`` over ``[dense features, pooled embeddings]`` (pipeline_bench.py)."""

    def __init__(self, num_embeddings: List[int], embedding_dim: int, lr: float) -> None:
        super().__init__(lr=lr, optimizer="adam")
        features = list(CRITEO_SPARSE_FEATURES)
        self._set_tables(features, num_embeddings, "meta")
        self.ebc = embedding_bag_collection(features, num_embeddings, embedding_dim, "meta")
        self.linear = nn.Linear(CRITEO_NUM_DENSE + len(features) * embedding_dim, 1)

    def forward(self, batch: CriteoBatch) -> torch.Tensor:
        pooled = self.ebc(batch.sparse_features).values()
        return self.linear(torch.cat([batch.dense_features, pooled], dim=1)).squeeze(1)


MODELS = ("dlrm", "linear")


def build_model(cardinalities: List[int], *, dim: int, seed: int, dense_lr: float, kind: str = "dlrm") -> _FusedAware:
    if kind not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {kind!r}")
    torch.manual_seed(seed)
    if kind == "linear":
        return BenchLinear(list(cardinalities), embedding_dim=dim, lr=dense_lr)
    return BenchDLRM(embedding_dim=dim, num_embeddings=list(cardinalities), embedding_device="meta", lr=dense_lr, optimizer="adam")


def ps_init(num_embeddings: int) -> Uniform:
    """The initialiser PersiaStrategy gives a TorchRec table without explicit bounds (TorchRec's default)."""
    bound = math.sqrt(1.0 / num_embeddings)
    return Uniform(-bound, bound)


def make_local_fused(model: _FusedAware, *, lr: float, eps: float, ps_seed: int, chunk_rows: int = 1 << 18,
                     device: torch.device = torch.device("cpu")) -> None:
    """Replaces ``model.ebc`` (meta) by a fused collection on ``device`` (FBGEMM's CPU or CUDA kernels) initialised
    as the parameter server would."""
    configs = model.ebc.embedding_bag_configs()
    fused = FusedEmbeddingBagCollection(
        tables=configs, optimizer_type=RowWiseAdagrad, optimizer_kwargs={"lr": lr, "eps": eps}, device=device,
    )
    weights = dict(fused.named_parameters())
    with torch.no_grad():
        for config in configs:
            weight = weights[f"embedding_bags.{config.name}.weight"]
            init = ps_init(config.num_embeddings)
            for first in range(0, config.num_embeddings, chunk_rows):
                ids = torch.arange(first, min(first + chunk_rows, config.num_embeddings))
                rows = initial_rows(init, ps_seed, f"{EBC_PATH}.{config.name}", ids, config.embedding_dim)
                weight[first : first + ids.numel()] = rows.to(weight.device)
    model.ebc = fused


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.device.type != "meta")
