"""The rows one module needs for one batch: unique ids per table, a flat leaf of their rows, its gradient.

A remote module's forward never touches the parameter server's full tables: it reads a *batch-local*
table holding only the unique ids of the batch. All tables of a module are packed into one flat leaf
tensor, so one fused kernel call pools every feature and one backward fills one gradient.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_persia.ops.dedup import segment_unique
from lightning_persia.ops.pooled_lookup import FlatLayout
from lightning_persia.remote_ps.table_config import TableConfig


@dataclass(frozen=True)
class RemoteTable:
    """A table as the trainer knows it: its name on the shards, width, configuration and KJT features."""

    name: str
    config: TableConfig
    features: tuple[str, ...] = ()

    @property
    def dim(self) -> int:
        return self.config.dim


class BatchRows:
    """Unique ids of a batch per table, their fetched rows, and (after backward) their gradients.

    ``inverse`` gives, for every id of the source in order, its row in its own table's unique ids.
    """

    def __init__(self, tables: list[RemoteTable], values: torch.Tensor, boundaries: list[int], source: tuple[torch.Tensor, ...]) -> None:
        self.tables = tables
        self.unique, self.inverse = segment_unique(values, boundaries)
        self.num_ids = values.numel()
        self.source = source
        self.weights: Optional[torch.Tensor] = None
        self._rows: Optional[Future] = None
        self._issued = threading.Event()
        self.issue_time = 0.0
        self.wait_ms = 0.0

    # ---- the lookup ----------------------------------------------------------------------------------

    def request(self) -> dict[str, torch.Tensor]:
        """Ids to fetch, per remote table name."""
        return {t.name: ids for t, ids in zip(self.tables, self.unique)}

    def attach(self, rows: Future) -> None:
        """Hands over the future of a lookup whose result holds (at least) this module's tables."""
        self._rows = rows
        self.issue_time = time.perf_counter()
        self._issued.set()

    def fail(self, error: BaseException) -> None:
        """Makes the forward waiting for these rows raise ``error`` (the lookup was never issued)."""
        future: Future = Future()
        future.set_exception(error)
        self.attach(future)

    def matches(self, source: tuple[torch.Tensor, ...]) -> bool:
        """Whether ``source`` (the tensors a forward received) holds the ids this lookup was planned from."""
        if len(source) != len(self.source):
            return False
        for mine, theirs in zip(self.source, source):
            if mine.numel() != theirs.numel():
                return False
            if mine.device == theirs.device and mine.data_ptr() == theirs.data_ptr():
                continue
            if not torch.equal(mine, theirs.to(mine.device)):
                return False
        return True

    def materialize(self, device: torch.device, requires_grad: bool, timeout_s: float) -> torch.Tensor:
        """The flat leaf of all rows on ``device`` (waits up to ``timeout_s`` for the lookup to be issued and answered)."""
        start = time.perf_counter()
        if not self._issued.wait(timeout_s):
            raise TimeoutError(f"the embedding lookup of tables {[t.name for t in self.tables]} was not issued within {timeout_s:.0f} s")
        assert self._rows is not None
        try:
            fetched = self._rows.result(max(1.0, timeout_s - (time.perf_counter() - start)))
        except FutureTimeout:
            raise TimeoutError(f"the embedding lookup of tables {[t.name for t in self.tables]} got no answer within {timeout_s:.0f} s") from None
        self.wait_ms = (time.perf_counter() - start) * 1e3
        flat = torch.cat([fetched[t.name].reshape(-1) for t in self.tables])
        self.weights = flat.to(device, non_blocking=True).requires_grad_(requires_grad)
        return self.weights

    # ---- views for the forward -----------------------------------------------------------------------

    def layout(self, feature_tables: tuple[int, ...]) -> FlatLayout:
        return FlatLayout(rows=tuple(u.numel() for u in self.unique), dims=tuple(t.dim for t in self.tables), feature_tables=feature_tables)

    def table_view(self, index: int) -> torch.Tensor:
        """Rows of table ``index`` as ``[n_unique, dim]`` (a view of the leaf, so gradients reach it)."""
        assert self.weights is not None
        offsets = self.layout(()).table_offsets
        return self.weights[offsets[index] : offsets[index + 1]].view(-1, self.tables[index].dim)

    # ---- the update ----------------------------------------------------------------------------------

    def gradients(self, scale: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{table: (unique ids, gradient rows)}`` on the CPU, multiplied by ``scale``; empty without a gradient."""
        if self.weights is None or self.weights.grad is None:
            return {}
        flat = self.weights.grad.detach().to("cpu", torch.float32)
        if scale != 1.0:
            flat = flat * scale
        offsets = self.layout(()).table_offsets
        return {
            t.name: (ids, flat[offsets[i] : offsets[i + 1]].view(-1, t.dim))
            for i, (t, ids) in enumerate(zip(self.tables, self.unique))
        }

    def wire_bytes(self, element_size: int) -> int:
        """Bytes of one lookup and one update of these rows on the wire (ids twice, rows twice)."""
        return sum(2 * u.numel() * (8 + t.dim * element_size) for t, u in zip(self.tables, self.unique))
