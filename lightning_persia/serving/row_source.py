"""Serving's one point of contact with the remote twins (``lightning_persia.embedding``).

What serving relies on, all of it here:

* a twin (:class:`~lightning_persia.embedding.modules.RemoteModule`) has ``remote_tables`` (each with a
  ``name`` and a ``dim``) and a ``row_source``; the TorchRec twins list their KJT keys in ``output_features``;
* a twin's forward calls ``row_source.rows(planner, features)``
  (:class:`~lightning_persia.embedding.row_source.RowSource`) and expects the rows back materialised, as the
  trainer's pipeline gives them.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from lightning_persia.embedding.batch_rows import BatchRows, ModuleRows
from lightning_persia.embedding.modules import RemoteEmbeddingBagCollection, RemoteEmbeddingCollection, RemoteModule
from lightning_persia.embedding.row_source import Planner
from lightning_persia.remote_ps.client import PSClient


class ReadOnlyRowSource:
    """Rows for the twins' forwards from evaluation lookups (``train=False``: the shards insert nothing).

    Stateless: any number of threads may run forwards through it at once.

    Example::

        source = ReadOnlyRowSource(PSClient(addresses), wire_dtype="fp32", device=torch.device("cpu"))
        source.bind(twins)
    """

    def __init__(self, client: PSClient, wire_dtype: str, device: torch.device, timeout_s: float = 30.0) -> None:
        self._client = client
        self._wire_dtype = wire_dtype
        self._device = device
        self._timeout_s = timeout_s

    def bind(self, twins: Sequence[RemoteModule]) -> None:
        """Makes every twin of ``twins`` read its rows from this source."""
        for twin in twins:
            twin.row_source = self

    def rows(self, planner: Planner, features: Any) -> ModuleRows:
        """The rows of ``features`` for the forward of ``planner``'s module (the ``RowSource`` protocol)."""
        rows = BatchRows([planner.plan(features)])
        sharded = self._client.shard(rows.keyed)
        rows.attach(sharded, self._client.lookup_sharded_async(sharded, train=False, wire_dtype=self._wire_dtype))
        rows.materialize(self._device, requires_grad=False, timeout_s=self._timeout_s)
        return rows.take(planner.key)


def remote_table_dims(twins: Sequence[RemoteModule]) -> dict[str, int]:
    """``{name on the shards: dim}`` of every remote table of ``twins``."""
    return {table.name: table.dim for twin in twins for table in twin.remote_tables}


def kjt_features(model: nn.Module) -> list[str]:
    """The KeyedJaggedTensor keys the TorchRec twins inside ``model`` read, in module order, each once."""
    features: list[str] = []
    for module in model.modules():
        if isinstance(module, (RemoteEmbeddingBagCollection, RemoteEmbeddingCollection)):
            features += [f for f in module.output_features if f not in features]
    return features
