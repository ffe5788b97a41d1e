"""Remote twins of TorchRec's and torch's embedding modules: same call signature, same output types.

A twin owns no parameters. Its forward asks the rank's :class:`EmbeddingWorker` for the batch-local rows
of the ids it receives and pools or gathers from them; the worker pushes the gradient of those rows to
the parameter server after the backward.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from lightning_persia.embedding.batch_rows import BatchRows, RemoteTable
from lightning_persia.embedding.worker import EmbeddingWorker
from lightning_persia.ops.pooled_lookup import pooled_lookup


class RemoteModule(nn.Module):
    """Base of the twins: a key unique in the model, the remote tables it reads, a bound worker."""

    def __init__(self, key: str, tables: list[RemoteTable]) -> None:
        super().__init__()
        self.key = key
        self.remote_tables = tables
        self._worker: Optional[EmbeddingWorker] = None

    def bind(self, worker: EmbeddingWorker) -> None:
        self._worker = worker

    def plan_prefetch(self, kjts: list[KeyedJaggedTensor]) -> Optional[BatchRows]:
        """The rows to fetch ahead of the forward for a batch holding ``kjts``; None when not knowable."""
        return None

    def _rows(self, source: tuple[torch.Tensor, ...], plan) -> BatchRows:
        if self._worker is None:
            raise RuntimeError(f"{type(self).__name__} {self.key!r} is not bound to an embedding worker; it only runs under PersiaStrategy")
        return self._worker.rows_for(self, source, plan)

    def extra_repr(self) -> str:
        return ", ".join(f"{t.name}: dim={t.dim}" for t in self.remote_tables)


class _KJTModule(RemoteModule):
    """Shared by the two collections: features grouped by table, in the module's output order."""

    def __init__(self, key: str, tables: list[RemoteTable]) -> None:
        super().__init__(key, tables)
        self.features = [f for t in tables for f in t.features]
        self.feature_tables = tuple(i for i, t in enumerate(tables) for _ in t.features)

    def plan_prefetch(self, kjts: list[KeyedJaggedTensor]) -> Optional[BatchRows]:
        for kjt in kjts:
            if set(self.features) <= set(kjt.keys()):
                return self._plan(kjt)
        return None

    def _select(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        keys = kjt.keys()
        if keys == self.features:
            return kjt
        missing = [f for f in self.features if f not in keys]
        if missing:
            raise KeyError(f"{type(self).__name__} {self.key!r}: features {missing} are missing from the input (it has {keys})")
        return kjt.permute([keys.index(f) for f in self.features])

    def _plan(self, kjt: KeyedJaggedTensor) -> BatchRows:
        mine = self._select(kjt)
        per_feature = mine.length_per_key()
        boundaries = [0]
        for table in self.feature_tables_grouped():
            boundaries.append(boundaries[-1] + sum(per_feature[f] for f in table))
        return BatchRows(self.remote_tables, mine.values(), boundaries, source=_source(kjt))

    def feature_tables_grouped(self) -> list[list[int]]:
        """Feature positions of each table."""
        groups: list[list[int]] = [[] for _ in self.remote_tables]
        for position, table in enumerate(self.feature_tables):
            groups[table].append(position)
        return groups

    def _forward_rows(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, BatchRows]:
        return self._select(features), self._rows(_source(features), lambda: self._plan(features))


class RemoteEmbeddingBagCollection(_KJTModule):
    """Twin of ``torchrec.EmbeddingBagCollection``: KeyedJaggedTensor in, KeyedTensor of pooled embeddings out."""

    def __init__(self, key: str, tables: list[RemoteTable], pooling: str = "sum", is_weighted: bool = False) -> None:
        super().__init__(key, tables)
        self.pooling = pooling
        self._is_weighted = is_weighted

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        mine, rows = self._forward_rows(features)
        device = rows.weights.device
        pooled = pooled_lookup(
            rows.weights,
            rows.layout(self.feature_tables),
            rows.inverse.to(device, non_blocking=True),
            mine.offsets().to(device),
            self.pooling,
            mine.weights().to(device) if self._is_weighted else None,
        )
        dims = [self.remote_tables[t].dim for t in self.feature_tables]
        return KeyedTensor(keys=self.features, length_per_key=dims, values=pooled)


class RemoteEmbeddingCollection(_KJTModule):
    """Twin of ``torchrec.EmbeddingCollection``: KeyedJaggedTensor in, ``dict[str, JaggedTensor]`` of per-id embeddings out."""

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        mine, rows = self._forward_rows(features)
        device = rows.weights.device
        inverse = rows.inverse.to(device, non_blocking=True)
        lengths = mine.lengths().to(device)
        per_feature = mine.length_per_key()
        batch = mine.stride()
        out, start = {}, 0
        for position, (feature, table) in enumerate(zip(self.features, self.feature_tables)):
            end = start + per_feature[position]
            out[feature] = JaggedTensor(
                values=rows.table_view(table).index_select(0, inverse[start:end]),
                lengths=lengths[position * batch : (position + 1) * batch],
            )
            start = end
        return out


class RemoteEmbeddingBag(RemoteModule):
    """Twin of ``torch.nn.EmbeddingBag`` (same ``forward(input, offsets, per_sample_weights)``)."""

    def __init__(self, key: str, table: RemoteTable, mode: str = "mean", include_last_offset: bool = False) -> None:
        super().__init__(key, [table])
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None, per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = self._rows((input,), lambda: BatchRows(self.remote_tables, input.cpu(), [0, input.numel()], source=(input,)))
        device = rows.weights.device
        return F.embedding_bag(
            rows.inverse.view(input.shape).to(device),
            rows.table_view(0),
            None if offsets is None else offsets.to(device),
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
        )


class RemoteEmbedding(RemoteModule):
    """Twin of ``torch.nn.Embedding`` (same ``forward(input)``)."""

    def __init__(self, key: str, table: RemoteTable) -> None:
        super().__init__(key, [table])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = self._rows((input,), lambda: BatchRows(self.remote_tables, input.cpu(), [0, input.numel()], source=(input,)))
        return F.embedding(rows.inverse.view(input.shape).to(rows.weights.device), rows.table_view(0))


def _source(kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, ...]:
    return (kjt.values(), kjt.lengths())
