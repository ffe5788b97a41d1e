"""What a remote twin needs from whatever runs it: the rows of the ids its forward received.

A twin (``embedding/modules.py``) has a :class:`Planner` that turns its forward's input into a
:class:`~lightning_persia.embedding.batch_rows.RowPlan` (its unique ids per table and how its forward reads them);
a :class:`RowSource` turns a plan into rows on the device. Under ``PersiaStrategy`` the source is the rank's
:class:`~lightning_persia.embedding.pipeline.EmbeddingPipeline`, which planned and fetched the rows of the running
step ahead of the forward; anything else that can fetch rows (a read-only client for serving) can stand in for it.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch

from lightning_persia.embedding.batch_rows import ModuleRows, RowPlan
from lightning_persia.embedding.planning import Deduplicate
from lightning_persia.ops.dedup import keyed_unique


@runtime_checkable
class Planner(Protocol):
    """A twin's planning, as plain data (``embedding/planning.py``): it runs wherever the batch is."""

    key: str  # the module's, unique in the model

    def find(self, batch: Any) -> Optional[Any]:
        """The module's forward input found in a training batch, when the planner can tell where it is (else None)."""

    def accepts(self, features: Any) -> bool:
        """Whether ``features`` (found in a batch) can be the module's input."""

    def sources(self, features: Any) -> tuple[torch.Tensor, ...]:
        """The tensors of ``features`` its ids come from (to check that a prefetched plan is the one of ``features``)."""

    def plan(self, features: Any, dedup: Deduplicate = keyed_unique) -> RowPlan:
        """The deduplicated ids of ``features`` (the forward's input) and how the forward reads their rows; ``dedup``
        (``planning.Deduplicate``, default ``ops.dedup.keyed_unique``) deduplicates them."""


@runtime_checkable
class RowSource(Protocol):
    """Gives a twin's forward its rows."""

    def rows(self, planner: Planner, features: Any) -> ModuleRows:
        """The rows the module of ``planner`` reads for ``features``, materialised on the device (a leaf that
        requires grad while a training step is open and gradients are enabled)."""
