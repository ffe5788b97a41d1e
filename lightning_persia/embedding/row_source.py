"""What a remote twin needs from whatever runs it: the rows of the ids its forward received.

A twin (``embedding/modules.py``) knows how to turn its forward's input into a :class:`RowPlan` (its unique ids
per table and how its forward reads them); a :class:`RowSource` turns a plan into rows on the device. Under
``PersiaStrategy`` the source is the rank's :class:`~lightning_persia.embedding.pipeline.EmbeddingPipeline`,
which planned and fetched the rows of the running step ahead of the forward; anything else that can fetch
rows (an in-process store in tests, a read-only client for serving) can stand in for it.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch

from lightning_persia.embedding.batch_rows import ModuleRows, RowPlan


@runtime_checkable
class PlannedModule(Protocol):
    """The twin's side: a key unique in the model, and its forward input turned into a plan."""

    key: str

    def plan(self, features: Any) -> RowPlan:
        """The deduplicated ids of ``features`` (the forward's input) and how the forward reads their rows."""

    def sources(self, features: Any) -> tuple[torch.Tensor, ...]:
        """The tensors of ``features`` its ids come from (to check that a prefetched plan is the one of ``features``)."""

    def prefetch_input(self, batch: Any) -> Optional[Any]:
        """The module's forward input found in a training batch, when the module can tell where it is (else None)."""


@runtime_checkable
class RowSource(Protocol):
    """Gives a twin's forward its rows."""

    def rows(self, module: PlannedModule, features: Any) -> ModuleRows:
        """The rows ``module``'s forward reads for ``features``, materialised on the device (a leaf that requires
        grad while a training step is open and gradients are enabled)."""
