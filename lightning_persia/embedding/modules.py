"""Remote twins of TorchRec's and torch's embedding modules: same call signature, same output types.

A twin owns no parameters. Its forward asks its :class:`~lightning_persia.embedding.row_source.RowSource` for the
rows of its input (a batch-local table, prefetched under ``PersiaStrategy``), which its planner
(``embedding/planning.py``) turns into unique ids per table, and pools or gathers from them; whoever gave the
rows pushes their gradient. The TorchRec twins implement TorchRec's ``EmbeddingBagCollectionInterface`` and
``EmbeddingCollectionInterface``, so code that asks a collection for its configs keeps working after the swap.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollectionInterface,
    EmbeddingCollectionInterface,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from lightning_persia.embedding.batch_rows import ModuleRows, RemoteTable
from lightning_persia.embedding.data_parallel import DataParallelTables
from lightning_persia.embedding.phases import POOLED_LOOKUP
from lightning_persia.embedding.planning import CollectionPlanner, TensorPlanner
from lightning_persia.embedding.row_source import Planner, RowSource
from lightning_persia.embedding.transfer import small_tensor
from lightning_persia.ops.pooled_lookup import pooled_lookup
from lightning_persia.ops.row_gather import gather_rows


class RemoteModule(nn.Module):
    """Base of the twins: a key unique in the model, the remote tables it reads, its planner, where its rows come from.

    ``row_source`` is set by whatever runs the model (``PersiaStrategy`` sets its rank's pipeline).
    """

    planner: Planner

    def __init__(self, key: str, tables: list[RemoteTable]) -> None:
        super().__init__()
        self.key = key
        self.remote_tables = tables
        self.data_parallel: Optional[DataParallelTables] = None  # tables a collection keeps on the trainer
        self.row_source: Optional[RowSource] = None

    def _rows(self, features: Any) -> ModuleRows:
        if self.row_source is None:
            raise RuntimeError(f"{type(self).__name__} {self.key!r} has no row source; it runs under PersiaStrategy (or a serving Predictor)")
        return self.row_source.rows(self.planner, features)

    def extra_repr(self) -> str:
        return ", ".join(f"{t.name}: dim={t.dim} (remote)" for t in self.remote_tables)


class _KJTModule(RemoteModule):
    """Shared by the two collections: features grouped by table, remote ones and (optionally) kept-local ones.

    ``features`` are the remote tables' features; ``output_features`` all of them in the original
    module's output order, which the forward restores when some tables are kept on the trainer.
    """

    _pooled = True

    def __init__(
        self, key: str, tables: list[RemoteTable], data_parallel: Optional[DataParallelTables] = None,
        output_features: Optional[list[str]] = None,
    ) -> None:
        super().__init__(key, tables)
        self.features = [f for t in tables for f in t.features]
        self.feature_tables = tuple(i for i, t in enumerate(tables) for _ in t.features)
        self.planner = CollectionPlanner(key, tuple(t.name for t in tables), tuple(t.dim for t in tables), tuple(self.features),
                                         self.feature_tables, self._pooled)
        self.data_parallel = data_parallel
        self.output_features = list(output_features) if output_features is not None else self._computed_features()
        if sorted(self.output_features) != sorted(self._computed_features()):
            raise ValueError(f"{key}: output features {self.output_features} are not those of its tables {self._computed_features()}")

    def _computed_features(self) -> list[str]:
        """Features in the order the forward computes them: remote ones, then kept-local ones."""
        return self.features + (self.data_parallel.features if self.data_parallel is not None else [])

    def _select(self, kjt: KeyedJaggedTensor, features: Optional[list[str]] = None) -> KeyedJaggedTensor:
        try:
            return self.planner.select(kjt, features)
        except KeyError as error:
            raise KeyError(f"{type(self).__name__} {error.args[0]}") from None

    def _select_local(self, kjt: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, torch.Tensor]:
        """The kept-local features of ``kjt`` and the rows their ids read (on the kept tables' device)."""
        assert self.data_parallel is not None
        mine = self._select(kjt, self.data_parallel.features)
        return mine, self.data_parallel.rows_of(mine.values(), mine.length_per_key())


class RemoteEmbeddingBagCollection(_KJTModule, EmbeddingBagCollectionInterface):
    """Twin of ``torchrec.EmbeddingBagCollection``: KeyedJaggedTensor in, KeyedTensor of pooled embeddings out."""

    def __init__(
        self, key: str, tables: list[RemoteTable], pooling: str = "sum", is_weighted: bool = False,
        data_parallel: Optional[DataParallelTables] = None, output_features: Optional[list[str]] = None,
        configs: Optional[list[EmbeddingBagConfig]] = None,
    ) -> None:
        super().__init__(key, tables, data_parallel, output_features)
        self.pooling = pooling
        self._is_weighted = is_weighted
        self._configs = list(configs or [])
        dims = {f: self.remote_tables[t].dim for f, t in zip(self.features, self.feature_tables)}
        if data_parallel is not None:
            dims.update(zip(data_parallel.features, data_parallel.layout.feature_dims))
        computed = self._computed_features()
        starts = dict(zip(computed, accumulate((dims[f] for f in computed), initial=0)))
        self._output_dims = [dims[f] for f in self.output_features]
        columns = [c for f in self.output_features for c in range(starts[f], starts[f] + dims[f])]
        self.register_buffer("_column_order", torch.tensor(columns, dtype=torch.int64), persistent=False)
        self._reordered = computed != self.output_features

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The configs of the collection this twin replaced (remote and kept tables)."""
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        parts = []
        if self.remote_tables:
            rows = self._rows(features)
            mine = self._select(features)
            device = rows.weights.device
            with record_function(POOLED_LOOKUP):
                parts.append(pooled_lookup(
                    rows.weights,
                    rows.layout(self.feature_tables),
                    rows.inverse.to(device),
                    mine.offsets().to(device),
                    self.pooling,
                    mine.weights().to(device) if self._is_weighted else None,
                    rows.fused,
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


class RemoteEmbeddingCollection(_KJTModule, EmbeddingCollectionInterface):
    """Twin of ``torchrec.EmbeddingCollection``: KeyedJaggedTensor in, ``dict[str, JaggedTensor]`` of per-id embeddings out."""

    _pooled = False

    def __init__(
        self, key: str, tables: list[RemoteTable], data_parallel: Optional[DataParallelTables] = None,
        output_features: Optional[list[str]] = None, configs: Optional[list[EmbeddingConfig]] = None, need_indices: bool = False,
    ) -> None:
        super().__init__(key, tables, data_parallel, output_features)
        self._configs = list(configs or [])
        self._need_indices = need_indices

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The configs of the collection this twin replaced (remote and kept tables)."""
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._configs[0].embedding_dim if self._configs else self.remote_tables[0].dim

    def embedding_names_by_table(self) -> list[list[str]]:
        return get_embedding_names_by_table(self._configs)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        out: dict[str, JaggedTensor] = {}
        if self.remote_tables:
            rows = self._rows(features)
            mine = self._select(features)
            with record_function(POOLED_LOOKUP):
                out.update(self._per_id(mine, self.features, self._gathered(rows)))
        if self.data_parallel is not None:
            local, rows_local = self._select_local(features)
            kept = self.data_parallel
            table_rows = [0, *accumulate(kept.num_embeddings)]
            starts = small_tensor([table_rows[t] for t in kept.feature_tables], rows_local.device)
            rows_all = rows_local + torch.repeat_interleave(starts, small_tensor(local.length_per_key(), rows_local.device),
                                                            output_size=rows_local.numel())
            out.update(self._per_id(local, kept.features, gather_rows(kept.weight.view(-1, self.embedding_dim()), rows_all)))
        return {feature: out[feature] for feature in self.output_features}

    def _gathered(self, rows: ModuleRows) -> torch.Tensor:
        """The embedding of every id of the module's input, in order (one gather over the module's tables)."""
        offsets = rows.layout(()).table_offsets
        block = rows.weights[rows.base : offsets[-1]].view(-1, self.embedding_dim())
        return gather_rows(block, rows.block_rows)

    def _per_id(self, kjt: KeyedJaggedTensor, features: list[str], embeddings: torch.Tensor) -> dict[str, JaggedTensor]:
        """``{feature: JaggedTensor of the embeddings of its ids}`` from every id's embedding, feature after feature."""
        lengths = kjt.lengths().to(embeddings.device).view(len(features), -1)
        values = torch.split(embeddings, kjt.length_per_key())
        ids = torch.split(kjt.values(), kjt.length_per_key()) if self._need_indices else [None] * len(features)
        return {f: JaggedTensor(values=v, lengths=l, weights=i) for f, v, l, i in zip(features, values, lengths, ids)}


class _PlainModule(RemoteModule):
    """Shared by the twins of ``nn.EmbeddingBag`` and ``nn.Embedding``: one table, the ids tensor as input."""

    def __init__(self, key: str, table: RemoteTable) -> None:
        super().__init__(key, [table])
        self.planner = TensorPlanner(key, table.name, table.dim)


class RemoteEmbeddingBag(_PlainModule):
    """Twin of ``torch.nn.EmbeddingBag`` (same ``forward(input, offsets, per_sample_weights)``)."""

    def __init__(self, key: str, table: RemoteTable, mode: str = "mean", include_last_offset: bool = False) -> None:
        super().__init__(key, table)
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None, per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = self._rows(input)
        device = rows.weights.device
        with record_function(POOLED_LOOKUP):
            return F.embedding_bag(
                rows.inverse.view(input.shape).to(device),
                rows.table_view(0),
                None if offsets is None else offsets.to(device),
                mode=self.mode,
                per_sample_weights=per_sample_weights,
                include_last_offset=self.include_last_offset,
            )


class RemoteEmbedding(_PlainModule):
    """Twin of ``torch.nn.Embedding`` (same ``forward(input)``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = self._rows(input)
        with record_function(POOLED_LOOKUP):
            return F.embedding(rows.inverse.view(input.shape).to(rows.weights.device), rows.table_view(0))
