"""DLRM (Naumov et al., 2019): bottom MLP on the dense features, one embedding per sparse feature, pairwise
dot-product interactions, top MLP.

    dense [B, 13] --bottom MLP--> x [B, D]
    sparse KJT    --EBC-------->  e_1..e_F [B, D]
    z = upper triangle of [x, e_1..e_F] [x, e_1..e_F]^T      (F + 1) F / 2 dot products
    logit = top MLP([x, z])
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from examples.common import RecommenderModule, embedding_bag_collection, mlp
from lightning_persia.data import CRITEO_NUM_DENSE, CRITEO_SPARSE_FEATURES, SYNTHETIC_DEFAULT_CARDINALITIES, CriteoBatch


class DLRM(RecommenderModule):
    """DLRM for Criteo-shaped batches.

    Args:
        embedding_dim: dimension D of every embedding (and of the bottom MLP's output).
        num_embeddings: rows per table, one per sparse feature (default: the synthetic data's cardinalities;
            the Criteo Kaggle ones are ``lightning_persia.data.CRITEO_KAGGLE_CARDINALITIES``).
        sparse_features: KJT keys, one table each (default: ``cat_0`` .. ``cat_25``).
        num_dense_features: width of ``batch.dense_features``.
        bottom_mlp: hidden sizes of the bottom MLP (a last layer of size D is added).
        top_mlp: hidden sizes of the top MLP (a last layer of size 1 is added).
        embedding_device: where the tables are created: ``cpu`` to train them here, ``meta`` (no memory) when a
            strategy replaces them by remote tables.
        embedding_init_scale: rows start in ``U(-s, s)``; default TorchRec's ``sqrt(1 / num_embeddings)``.
        lr, optimizer, weight_decay, embedding_lr, embedding_optimizer: see :class:`RecommenderModule`.
    """

    def __init__(
        self,
        embedding_dim: int = 16,
        num_embeddings: Optional[List[int]] = None,
        sparse_features: Optional[List[str]] = None,
        num_dense_features: int = CRITEO_NUM_DENSE,
        bottom_mlp: List[int] = [256, 64],
        top_mlp: List[int] = [256, 128],
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
        self.ebc = embedding_bag_collection(features, rows, embedding_dim, embedding_device, init_scale=embedding_init_scale)
        self.bottom = mlp(num_dense_features, [*bottom_mlp, embedding_dim])
        num_vectors = len(features) + 1
        rows_i, cols_i = torch.triu_indices(num_vectors, num_vectors, offset=1)
        self.register_buffer("_pair_rows", rows_i, persistent=False)
        self.register_buffer("_pair_cols", cols_i, persistent=False)
        self.top = mlp(embedding_dim + len(rows_i), [*top_mlp, 1], final_activation=False)

    def forward(self, batch: CriteoBatch) -> Tensor:
        x = self.bottom(batch.dense_features)  # [B, D]
        pooled = self.ebc(self.table_ids(batch.sparse_features))  # KeyedTensor, keys = features
        embeddings = pooled.values().view(x.shape[0], -1, x.shape[1])  # [B, F, D]
        vectors = torch.cat([x.unsqueeze(1), embeddings], dim=1)  # [B, F + 1, D]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self._pair_rows, self._pair_cols]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


#: MLPerf DLRM-DCNv2's table sizes (its --num_embeddings_per_feature, the 40M cap on the largest), cat_0 .. cat_25.
MLPERF_NUM_EMBEDDINGS: List[int] = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938, 155, 4, 976, 14,
    40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]  # fmt: skip


class DLRMDCN(RecommenderModule):
    """DLRM-DCNv2, the model of MLPerf Training's recommendation benchmark: TorchRec's ``DLRM_DCN`` (dense arch, a
    low-rank DCNv2 cross network over ``[x, e_1..e_F]``, over arch) on one sum-pooled table per sparse feature, so a
    multi-hot feature's bag of ids is pooled by the ``EmbeddingBagCollection`` as TorchRec does.

    Args:
        embedding_dim: dimension D of every embedding (the dense arch ends at D).
        num_embeddings: rows per table, one per sparse feature (default: MLPerf's, :data:`MLPERF_NUM_EMBEDDINGS`).
        sparse_features: KJT keys, one table each (default: ``cat_0`` .. ``cat_25``).
        num_dense_features: width of ``batch.dense_features``.
        dense_arch: hidden sizes of the dense arch (a last layer of size D is added).
        over_arch: hidden sizes of the over arch (a last layer of size 1 is added).
        dcn_num_layers, dcn_low_rank_dim: the cross network's layers and their rank.
        embedding_device, embedding_init_scale, lr, optimizer, weight_decay, embedding_lr, embedding_optimizer: as
            :class:`DLRM`'s.
    """

    def __init__(
        self,
        embedding_dim: int = 128,
        num_embeddings: Optional[List[int]] = None,
        sparse_features: Optional[List[str]] = None,
        num_dense_features: int = CRITEO_NUM_DENSE,
        dense_arch: List[int] = [512, 256],
        over_arch: List[int] = [1024, 1024, 512, 256],
        dcn_num_layers: int = 3,
        dcn_low_rank_dim: int = 512,
        embedding_device: str = "cpu",
        embedding_init_scale: Optional[float] = None,
        lr: float = 1e-3,
        optimizer: str = "adam",
        weight_decay: float = 0.0,
        embedding_lr: float = 0.05,
        embedding_optimizer: str = "adagrad",
    ) -> None:
        from torchrec.models.dlrm import DLRM_DCN

        super().__init__(lr, optimizer, weight_decay, embedding_lr, embedding_optimizer)
        self.save_hyperparameters()
        features = list(sparse_features or CRITEO_SPARSE_FEATURES)
        rows = list(num_embeddings or MLPERF_NUM_EMBEDDINGS)
        self._set_tables(features, rows, embedding_device)
        ebc = embedding_bag_collection(features, rows, embedding_dim, embedding_device, init_scale=embedding_init_scale)
        self.dlrm = DLRM_DCN(ebc, num_dense_features, [*dense_arch, embedding_dim], [*over_arch, 1], dcn_num_layers, dcn_low_rank_dim)

    def forward(self, batch: CriteoBatch) -> Tensor:
        return self.dlrm(batch.dense_features, self.table_ids(batch.sparse_features)).squeeze(1)
