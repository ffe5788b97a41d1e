"""Wide & Deep (Cheng et al., 2016) for the UCI Adult census income task.

    wide: sum_f w_f[id_f] (dim-1 tables, zero-initialised) + linear(dense)
    deep: MLP([e_1 .. e_F, dense]) over dim-D embeddings
    logit = wide + deep
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor, nn

from examples.common import RecommenderModule, embedding_bag_collection
from lightning_persia.data import ADULT_CARDINALITIES, ADULT_DENSE_FEATURES, ADULT_SPARSE_FEATURES, CriteoBatch


class WideAndDeep(RecommenderModule):
    """Wide & Deep over the Adult batches (8 sparse features, 6 dense).

    Args:
        embedding_dim: dimension of the deep part's embeddings.
        num_embeddings: rows per table (default :data:`~lightning_persia.data.ADULT_CARDINALITIES`).
        sparse_features: KJT keys, one table each (default: the Adult categorical columns).
        num_dense_features: width of ``batch.dense_features``.
        deep_mlp: hidden sizes of the deep MLP (a last layer of size 1 is added).
        dropout: dropout after each hidden layer of the deep MLP.
        embedding_device: ``cpu`` to train the tables here, ``meta`` when a strategy replaces them.
        embedding_init_scale: rows of the deep tables start in ``U(-s, s)`` (default TorchRec's).
        lr, optimizer, weight_decay, embedding_lr, embedding_optimizer: see :class:`RecommenderModule`.
    """

    def __init__(
        self,
        embedding_dim: int = 8,
        num_embeddings: Optional[List[int]] = None,
        sparse_features: Optional[List[str]] = None,
        num_dense_features: int = len(ADULT_DENSE_FEATURES),
        deep_mlp: List[int] = [64, 32],
        dropout: float = 0.0,
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
        features = list(sparse_features or ADULT_SPARSE_FEATURES)
        rows = list(num_embeddings or ADULT_CARDINALITIES)
        self._set_tables(features, rows, embedding_device)
        self.wide_sparse = embedding_bag_collection(features, rows, 1, embedding_device, zero_init=True, table_prefix="wide_")
        self.wide_dense = nn.Linear(num_dense_features, 1)
        self.deep_embeddings = embedding_bag_collection(
            features, rows, embedding_dim, embedding_device, init_scale=embedding_init_scale, table_prefix="deep_"
        )
        layers: List[nn.Module] = []
        width = len(features) * embedding_dim + num_dense_features
        for size in deep_mlp:
            layers += [nn.Linear(width, size), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout > 0 else [])
            width = size
        layers.append(nn.Linear(width, 1))
        self.deep = nn.Sequential(*layers)

    def forward(self, batch: CriteoBatch) -> Tensor:
        ids = self.table_ids(batch.sparse_features)
        dense = batch.dense_features
        wide = self.wide_sparse(ids).values().sum(1) + self.wide_dense(dense).squeeze(1)
        deep = self.deep(torch.cat([self.deep_embeddings(ids).values(), dense], dim=1)).squeeze(1)
        return wide + deep
