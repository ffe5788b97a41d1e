"""What the example models share: the training/evaluation loop, table construction, optimizers, MLPs.

The models are ordinary LightningModules with ordinary ``torchrec.EmbeddingBagCollection`` s:

* with plain Lightning (no strategy) the tables live in the module, train with a sparse optimizer
  (``embedding_optimizer``/``embedding_lr``; sparse gradients, so a step costs the rows of the batch, not the
  table) stepped together with the dense one;
* with ``embedding_device="meta"`` the tables cost nothing: a strategy such as ``PersiaStrategy`` replaces the
  collections by remote twins (whose optimizer is the strategy's) before the optimizers are configured, so
  :meth:`RecommenderModule.configure_optimizers` then sees the dense parameters only.

Local tables (``embedding_device="cpu"``) see ids reduced modulo each table's ``num_embeddings``: the usual hashing
trick for hashed ids (``ids: hash``: arbitrary non-negative int64), the ids themselves for vocabulary ids below the
table's size (``ids: raw``). Remote tables (``"meta"``) are not bounded by ``num_embeddings`` and see the ids as
they are.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torchmetrics.classification import BinaryAUROC
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.data import CriteoBatch

DENSE_OPTIMIZERS = ("adam", "adagrad", "sgd")
EMBEDDING_OPTIMIZERS = ("adagrad", "adam", "sgd")


def mlp(in_features: int, sizes: Sequence[int], final_activation: bool = True) -> nn.Sequential:
    """``Linear -> ReLU`` layers of ``sizes`` (no ReLU after the last one unless ``final_activation``)."""
    layers: List[nn.Module] = []
    for i, size in enumerate(sizes):
        layers.append(nn.Linear(in_features, size))
        if final_activation or i < len(sizes) - 1:
            layers.append(nn.ReLU())
        in_features = size
    return nn.Sequential(*layers)


def embedding_bag_collection(
    feature_names: Sequence[str],
    num_embeddings: Sequence[int],
    embedding_dim: int,
    device: str = "cpu",
    zero_init: bool = False,
    init_scale: Optional[float] = None,
    table_prefix: str = "",
) -> EmbeddingBagCollection:
    """One sum-pooled table per feature, named ``table_prefix + feature``, built on ``device`` (``meta``: free).

    Give each collection of a model its own ``table_prefix`` so that table names are unique model-wide (a
    remote strategy may key its tables by name).

    ``zero_init`` starts every row at 0 (first-order weights); otherwise rows are drawn from
    ``U(-init_scale, init_scale)`` (default ``sqrt(1 / num_embeddings)``, TorchRec's default).
    """
    if len(feature_names) != len(num_embeddings):
        raise ValueError(f"{len(feature_names)} features but {len(num_embeddings)} table sizes")
    tables = []
    for name, rows in zip(feature_names, num_embeddings):
        bound: Dict[str, Any] = {}
        if zero_init:
            bound = {"weight_init_min": 0.0, "weight_init_max": 0.0, "init_fn": nn.init.zeros_}
        elif init_scale is not None:
            bound = {"weight_init_min": -init_scale, "weight_init_max": init_scale}
        tables.append(
            EmbeddingBagConfig(
                name=table_prefix + name,
                num_embeddings=int(rows),
                embedding_dim=embedding_dim,
                feature_names=[name],
                pooling=PoolingType.SUM,
                **bound,
            )
        )
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device(device))
    if device != "meta":
        for bag in ebc.embedding_bags.values():
            bag.sparse = True  # row-sparse gradients: a step costs the batch's rows, not the table
    return ebc


class _StepTogether(CombinedOptimizer):
    """Dense and local-embedding optimizers stepped as one; Lightning's closure (forward + backward) runs once."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for _, optimizer in self.optimizers:
            optimizer.step()
        return loss


class RecommenderModule(LightningModule):
    """Base of the example models: BCE-with-logits training, epoch-level ``val_auc``/``test_auc``, optimizers.

    Subclasses build their layers and implement :meth:`forward` (``CriteoBatch -> logits [B]``); they declare
    the sparse features and table sizes with :meth:`_set_tables` so that ids are reduced modulo the sizes.

    Args:
        lr: learning rate of the dense optimizer.
        optimizer: dense optimizer: ``adam``, ``adagrad`` or ``sgd``.
        weight_decay: weight decay of the dense optimizer.
        embedding_lr: learning rate of the local embedding optimizer (plain Lightning; a remote strategy uses
            its own embedding optimizer instead).
        embedding_optimizer: local embedding optimizer: ``adagrad``, ``adam`` (``SparseAdam``) or ``sgd``.
    """

    def __init__(
        self,
        lr: float = 1e-3,
        optimizer: str = "adam",
        weight_decay: float = 0.0,
        embedding_lr: float = 0.05,
        embedding_optimizer: str = "adagrad",
    ) -> None:
        super().__init__()
        if optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {DENSE_OPTIMIZERS}, got {optimizer!r}")
        if embedding_optimizer not in EMBEDDING_OPTIMIZERS:
            raise ValueError(f"embedding_optimizer must be one of {EMBEDDING_OPTIMIZERS}, got {embedding_optimizer!r}")
        self.lr, self.optimizer_name, self.weight_decay = lr, optimizer, weight_decay
        self.embedding_lr, self.embedding_optimizer_name = embedding_lr, embedding_optimizer
        self.val_auc = BinaryAUROC()
        self.test_auc = BinaryAUROC()
        self._key_index: Dict[tuple, Tensor] = {}

    # ------------------------------------------------------------------ tables
    def _set_tables(self, feature_names: Sequence[str], num_embeddings: Sequence[int], embedding_device: str = "cpu") -> None:
        if len(feature_names) != len(num_embeddings):
            raise ValueError(f"{len(feature_names)} sparse features but {len(num_embeddings)} num_embeddings")
        self.sparse_feature_names = list(feature_names)
        # Tables declared on "meta" are served remotely, where any int64 id has a row: ids go through as they
        # are, so the batch the strategy prefetched is the batch the tables see.
        self._reduce_ids = embedding_device != "meta"
        self.register_buffer("_table_rows", torch.tensor(list(num_embeddings), dtype=torch.int64), persistent=False)

    def table_ids(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` with every id reduced modulo its table's ``num_embeddings`` (the hashing trick).

        Unchanged when the tables are remote (declared on ``meta``): a remote table is unbounded.
        """
        if not self._reduce_ids:
            return features
        keys = tuple(features.keys())
        index = self._key_index.get(keys)
        if index is None:
            missing = set(keys) - set(self.sparse_feature_names)
            if missing:
                raise KeyError(f"batch has sparse features {sorted(missing)} that the model does not know")
            index = torch.tensor([self.sparse_feature_names.index(k) for k in keys], dtype=torch.int64)
            self._key_index[keys] = index
        rows = self._table_rows[index.to(self._table_rows.device)]
        lengths = features.length_per_key()
        modulus = torch.repeat_interleave(rows, torch.tensor(lengths, device=rows.device), output_size=sum(lengths))
        return KeyedJaggedTensor(
            keys=list(keys),
            values=torch.remainder(features.values(), modulus),
            lengths=features.lengths(),
            offsets=features.offsets(),
            stride=features.stride(),
            weights=features.weights_or_none(),
        )

    # ------------------------------------------------------------------ steps
    def forward(self, batch: CriteoBatch) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def training_step(self, batch: CriteoBatch, batch_idx: int) -> Tensor:
        logits = self(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch.batch_size)
        return loss

    def _eval_step(self, batch: CriteoBatch, metric: BinaryAUROC, prefix: str) -> None:
        logits = self(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        metric.update(torch.sigmoid(logits.detach()), batch.labels.long())
        self.log(f"{prefix}_loss", loss, batch_size=batch.batch_size, sync_dist=True)
        self.log(f"{prefix}_auc", metric, on_step=False, on_epoch=True, prog_bar=True)

    def validation_step(self, batch: CriteoBatch, batch_idx: int) -> None:
        self._eval_step(batch, self.val_auc, "val")

    def test_step(self, batch: CriteoBatch, batch_idx: int) -> None:
        self._eval_step(batch, self.test_auc, "test")

    def predict_step(self, batch: CriteoBatch, batch_idx: int) -> Tensor:
        return torch.sigmoid(self(batch))

    # ------------------------------------------------------------------ optimizers
    def _local_embedding_parameters(self) -> List[nn.Parameter]:
        """Weights of the embedding tables held by this module (none once a strategy made them remote)."""
        params = []
        for module in self.modules():
            if isinstance(module, (nn.EmbeddingBag, nn.Embedding)) and module.weight.device.type != "meta":
                params.append(module.weight)
        return params

    def configure_optimizers(self) -> torch.optim.Optimizer:
        embedding = self._local_embedding_parameters()
        embedding_ids = {id(p) for p in embedding}
        dense = [p for p in self.parameters() if p.requires_grad and id(p) not in embedding_ids]
        if any(p.device.type == "meta" for p in dense):
            raise RuntimeError(
                "parameters on the meta device: embedding_device='meta' needs a strategy (e.g. PersiaStrategy) "
                "that replaces the embedding tables"
            )
        dense_opt = _dense_optimizer(self.optimizer_name, dense, self.lr, self.weight_decay)
        if not embedding:
            return dense_opt
        names = {id(p): n for n, p in self.named_parameters()}
        sparse_opt = _embedding_optimizer(self.embedding_optimizer_name, embedding, self.embedding_lr)
        return _StepTogether(
            [
                ("dense", KeyedOptimizerWrapper({names[id(p)]: p for p in dense}, lambda _: dense_opt)),
                ("embedding", KeyedOptimizerWrapper({names[id(p)]: p for p in embedding}, lambda _: sparse_opt)),
            ]
        )


def _dense_optimizer(name: str, params: List[nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)


def _embedding_optimizer(name: str, params: List[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, foreach=False)
    if name == "adam":
        return torch.optim.SparseAdam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, foreach=False)


class PrintAUC(Callback):
    """Prints the model's ``val_auc``/``test_auc``, next to the data's ground-truth ceiling when it has one,
    after every validation and test, and the last ``val_auc`` again at the end of ``fit``.

    The ceiling comes from ``datamodule.ground_truth_auc(split)`` (``SyntheticCriteoDataModule``: the AUC of
    the true click probabilities on the very rows evaluated); it is also logged as ``val_auc_ceiling``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._ceilings: Dict[str, float] = {}

    def _ceiling(self, trainer: Trainer, split: str) -> Optional[float]:
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "ground_truth_auc"):
            return None
        if split not in self._ceilings:
            self._ceilings[split] = float(datamodule.ground_truth_auc(split))
        return self._ceilings[split]

    def _log(self, trainer: Trainer, module: LightningModule, split: str) -> None:
        ceiling = self._ceiling(trainer, split)
        if ceiling is not None:
            module.log(f"{split}_auc_ceiling", ceiling, sync_dist=True)  # the same value on every rank

    def _print(self, trainer: Trainer, split: str, prefix: str = "") -> None:
        ceiling = self._ceilings.get(split)
        metric = trainer.callback_metrics.get(f"{split}_auc")
        if metric is None:
            return
        against = f" vs ground-truth ceiling {ceiling:.4f}" if ceiling is not None else ""
        rank_zero_info(f"{prefix}{split}_auc {float(metric):.4f}{against} (step {trainer.global_step})")

    def on_validation_epoch_end(self, trainer: Trainer, module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._log(trainer, module, "val")

    def on_validation_end(self, trainer: Trainer, module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._print(trainer, "val")

    def on_fit_end(self, trainer: Trainer, module: LightningModule) -> None:
        # Lightning says why fit stopped after the last validation: the result goes last, where it is read.
        self._print(trainer, "val", prefix="end of fit: ")

    def on_test_epoch_end(self, trainer: Trainer, module: LightningModule) -> None:
        self._log(trainer, module, "test")

    def on_test_end(self, trainer: Trainer, module: LightningModule) -> None:
        self._print(trainer, "test")
