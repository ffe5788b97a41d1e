"""DeepFM (Guo et al., 2017): first-order terms + factorisation machine + deep MLP over shared embeddings.

    first order: sum_f w_f[id_f] (dim-1 tables, zero-initialised) + linear(dense)
    FM:          0.5 * sum_d ((sum_f e_f)_d ** 2 - sum_f (e_f)_d ** 2)     over the dim-D embeddings
    deep:        MLP([e_1 .. e_F, dense])
    logit = bias + first order + FM + deep
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor, nn

from examples.common import RecommenderModule, embedding_bag_collection, mlp
from lightning_persia.data import CRITEO_NUM_DENSE, CRITEO_SPARSE_FEATURES, SYNTHETIC_DEFAULT_CARDINALITIES, CriteoBatch


class DeepFM(RecommenderModule):
    """DeepFM for Criteo-shaped batches.

    Args:
        embedding_dim: dimension D of the shared embeddings (FM and deep part).
        num_embeddings: rows per table, one per sparse feature (default: the synthetic data's cardinalities);
            the first-order tables have as many rows.
        sparse_features: KJT keys, one table each (default: ``cat_0`` .. ``cat_25``).
        num_dense_features: width of ``batch.dense_features``.
        deep_mlp: hidden sizes of the deep MLP (a last layer of size 1 is added).
        embedding_device: ``cpu`` to train the tables here, ``meta`` when a strategy replaces them.
        embedding_init_scale: rows of the dim-D tables start in ``U(-s, s)`` (default TorchRec's).
        lr, optimizer, weight_decay, embedding_lr, embedding_optimizer: see :class:`RecommenderModule`.
    """

    def __init__(
        self,
        embedding_dim: int = 16,
        num_embeddings: Optional[List[int]] = None,
        sparse_features: Optional[List[str]] = None,
        num_dense_features: int = CRITEO_NUM_DENSE,
        deep_mlp: List[int] = [256, 128],
        embedding_device: str = "cpu",
        embedding_init_scale: Optional[float] = None,
        lr: float = 1e-3,
        optimizer: str = "adam",
        weight_decay: float = 0.0,
        embedding_lr: float = 0.05,
        embedding_optimizer: str = "adagrad",
    ) -> None:
        super().__init__(lr, optimizer, weight_decay, embedding_lr, embedding_optimizer)
        self.save_hyperparameters()
        features = list(sparse_features or CRITEO_SPARSE_FEATURES)
        rows = list(num_embeddings or SYNTHETIC_DEFAULT_CARDINALITIES)
        self._set_tables(features, rows, embedding_device)
        self.embedding_dim = embedding_dim
        self.ebc = embedding_bag_collection(features, rows, embedding_dim, embedding_device, init_scale=embedding_init_scale)
        self.first_order = embedding_bag_collection(
            features, rows, 1, embedding_device, zero_init=True, table_prefix="first_order_"
        )
        self.dense_linear = nn.Linear(num_dense_features, 1)
        self.deep = mlp(len(features) * embedding_dim + num_dense_features, [*deep_mlp, 1], final_activation=False)

    def forward(self, batch: CriteoBatch) -> Tensor:
        ids = self.table_ids(batch.sparse_features)
        dense = batch.dense_features
        first = self.first_order(ids).values().sum(1) + self.dense_linear(dense).squeeze(1)
        embeddings = self.ebc(ids).values()  # [B, F * D]
        e = embeddings.view(embeddings.shape[0], -1, self.embedding_dim)  # [B, F, D]
        fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1)
        deep = self.deep(torch.cat([embeddings, dense], dim=1)).squeeze(1)
        return first + fm + deep
