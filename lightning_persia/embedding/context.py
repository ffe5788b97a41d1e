"""The state of one training step in the embedding pipeline (TorchRec's ``TrainPipelineContext``), and the gradients
it pushes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lightning_persia.embedding.batch_rows import BatchRows
from lightning_persia.ops.keyed_ids import KeyedIds


@dataclass
class StepContext:
    """One step: its number, the rows prefetched for its modules, the rows its forwards read.

    Made by the prefetcher when it plans the step's batch (or by the trainer for a batch nobody planned),
    handed to the trainer with the batch, closed after the step's backward.
    """

    index: int
    generation: int  # the pipeline's generation when planned: rows of an older one are fetched again
    prefetched: Optional[BatchRows] = None  # one lookup for every module whose input the batch showed
    used: list[BatchRows] = field(default_factory=list)  # rows the step's forwards read: its update
    lag: int = 0  # earlier steps' updates unacknowledged when its lookup went out: the most its rows missed
    lag_at_answer: int = 0  # ... still unacknowledged when its lookup was answered
    batch: Any = None  # the batch the trainer runs (where a module's input is found)

    def use(self, rows: BatchRows) -> None:
        if not any(r is rows for r in self.used):
            self.used.append(rows)


@dataclass(frozen=True)
class SparseUpdate:
    """Gradients of ``keyed``'s ids: ``grads`` flat in its order, ``dims[t]`` values per row of table ``t``.

    ``sharded``: the ids' bucketing and encoding when the lookup made them already (None: the push makes them).
    """

    keyed: KeyedIds
    grads: torch.Tensor
    dims: tuple[int, ...]
    sharded: Any = None
