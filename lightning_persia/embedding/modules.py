"""Remote twins of TorchRec's and torch's embedding modules: same call signature, same output types.

A twin owns no parameters. Its forward asks the rank's :class:`EmbeddingWorker` for the batch-local rows
of the ids it receives and pools or gathers from them; the worker pushes the gradient of those rows to
the parameter server after the backward.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from lightning_persia.embedding.batch_rows import BatchRows, RemoteTable
from lightning_persia.embedding.data_parallel import DataParallelTables
from lightning_persia.embedding.worker import EmbeddingWorker
from lightning_persia.ops.pooled_lookup import pooled_lookup


class RemoteModule(nn.Module):
    """Base of the twins: a key unique in the model, the remote tables it reads, a bound worker."""

    def __init__(self, key: str, tables: list[RemoteTable]) -> None:
        super().__init__()
        self.key = key
        self.remote_tables = tables
        self.data_parallel: Optional[DataParallelTables] = None  # tables a collection keeps on the trainer
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
        return ", ".join(f"{t.name}: dim={t.dim} (remote)" for t in self.remote_tables)


class _KJTModule(RemoteModule):
    """Shared by the two collections: features grouped by table, remote ones and (optionally) kept-local ones.

    ``features`` are the remote tables' features; ``output_features`` all of them in the original
    module's output order, which the forward restores when some tables are kept on the trainer.
    """

    def __init__(
        self, key: str, tables: list[RemoteTable], data_parallel: Optional[DataParallelTables] = None,
        output_features: Optional[list[str]] = None,
    ) -> None:
        super().__init__(key, tables)
        self.features = [f for t in tables for f in t.features]
        self.feature_tables = tuple(i for i, t in enumerate(tables) for _ in t.features)
        self.data_parallel = data_parallel
        self.output_features = list(output_features) if output_features is not None else self._computed_features()
        if sorted(self.output_features) != sorted(self._computed_features()):
            raise ValueError(f"{key}: output features {self.output_features} are not those of its tables {self._computed_features()}")

    def _computed_features(self) -> list[str]:
        """Features in the order the forward computes them: remote ones, then kept-local ones."""
        return self.features + (self.data_parallel.features if self.data_parallel is not None else [])

    def plan_prefetch(self, kjts: list[KeyedJaggedTensor]) -> Optional[BatchRows]:
        for kjt in kjts:
            if set(self.features) <= set(kjt.keys()):
                return self._plan(kjt)
        return None

    def _select(self, kjt: KeyedJaggedTensor, features: Optional[list[str]] = None) -> KeyedJaggedTensor:
        features = self.features if features is None else features
        keys = kjt.keys()
        if keys == features:
            return kjt
        missing = [f for f in features if f not in keys]
        if missing:
            raise KeyError(f"{type(self).__name__} {self.key!r}: features {missing} are missing from the input (it has {keys})")
        return kjt.permute([keys.index(f) for f in features])

    def _select_local(self, kjt: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, torch.Tensor]:
        """The kept-local features of ``kjt`` and the rows their ids read (on the kept tables' device)."""
        assert self.data_parallel is not None
        mine = self._select(kjt, self.data_parallel.features)
        return mine, self.data_parallel.rows_of(mine.values(), mine.length_per_key())

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

    def __init__(
        self, key: str, tables: list[RemoteTable], pooling: str = "sum", is_weighted: bool = False,
        data_parallel: Optional[DataParallelTables] = None, output_features: Optional[list[str]] = None,
    ) -> None:
        super().__init__(key, tables, data_parallel, output_features)
        self.pooling = pooling
        self._is_weighted = is_weighted
        dims = {f: self.remote_tables[t].dim for f, t in zip(self.features, self.feature_tables)}
        if data_parallel is not None:
            dims.update(zip(data_parallel.features, data_parallel.layout.feature_dims))
        computed = self._computed_features()
        starts = dict(zip(computed, accumulate((dims[f] for f in computed), initial=0)))
        self._output_dims = [dims[f] for f in self.output_features]
        columns = [c for f in self.output_features for c in range(starts[f], starts[f] + dims[f])]
        self.register_buffer("_column_order", torch.tensor(columns, dtype=torch.int64), persistent=False)
        self._reordered = computed != self.output_features

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        parts = []
        if self.remote_tables:
            mine, rows = self._forward_rows(features)
            device = rows.weights.device
            parts.append(pooled_lookup(
                rows.weights,
                rows.layout(self.feature_tables),
                rows.inverse.to(device, non_blocking=True),
                mine.offsets().to(device),
                self.pooling,
                mine.weights().to(device) if self._is_weighted else None,
            ))
        if self.data_parallel is not None:
            local, rows_local = self._select_local(features)
            device = rows_local.device
            parts.append(self.data_parallel.pooled(
                rows_local, local.offsets().to(device), self.pooling,
                local.weights().to(device) if self._is_weighted else None,
            ))
        pooled = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if self._reordered:
            pooled = pooled.index_select(1, self._column_order)
        return KeyedTensor(keys=self.output_features, length_per_key=self._output_dims, values=pooled)


class RemoteEmbeddingCollection(_KJTModule):
    """Twin of ``torchrec.EmbeddingCollection``: KeyedJaggedTensor in, ``dict[str, JaggedTensor]`` of per-id embeddings out."""

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        out: dict[str, JaggedTensor] = {}
        if self.remote_tables:
            mine, rows = self._forward_rows(features)
            device = rows.weights.device
            out.update(_per_id(mine, self.features, self.feature_tables, rows.table_view, rows.inverse.to(device, non_blocking=True)))
        if self.data_parallel is not None:
            local, rows_local = self._select_local(features)
            out.update(_per_id(local, self.data_parallel.features, self.data_parallel.feature_tables, self.data_parallel.table_view, rows_local))
        return {feature: out[feature] for feature in self.output_features}


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


def _per_id(
    kjt: KeyedJaggedTensor, features: list[str], feature_tables: tuple[int, ...], table_view: Callable[[int], torch.Tensor],
    rows: torch.Tensor,
) -> dict[str, JaggedTensor]:
    """``{feature: JaggedTensor of the embeddings of its ids}``; ``rows[i]`` is id i's row in its table's view."""
    lengths = kjt.lengths().to(rows.device)
    per_feature = kjt.length_per_key()
    batch = kjt.stride()
    out, start = {}, 0
    for position, (feature, table) in enumerate(zip(features, feature_tables)):
        end = start + per_feature[position]
        out[feature] = JaggedTensor(
            values=table_view(table).index_select(0, rows[start:end]),
            lengths=lengths[position * batch : (position + 1) * batch],
        )
        start = end
    return out


def _source(kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, ...]:
    return (kjt.values(), kjt.lengths())
