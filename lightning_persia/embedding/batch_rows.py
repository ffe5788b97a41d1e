"""The rows a batch's remote modules read: their deduplicated ids, one lookup, one flat leaf, one gradient.

A remote module's forward never touches the parameter server's full tables: it reads a *batch-local* table
holding only the unique ids of the batch. A :class:`RowPlan` is one module's share of a batch (its unique ids
per table and, for every id of its input, the row it reads); a :class:`BatchRows` fetches the plans of every
module of a step in one lookup into one flat leaf tensor, so one backward fills one gradient that is pushed
as one update.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Optional, Sequence

import torch

from lightning_persia.ops.keyed_ids import KeyedIds, RowLayout
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


@dataclass(frozen=True)
class RowPlan:
    """One module's ids of one batch, deduplicated: what its lookup fetches and how its forward reads the rows.

    ``unique`` holds the unique ids of each of the module's tables; ``inverse[i]`` is the row, among its own
    table's unique ids, of the ``i``-th id of the module's input; ``source`` are the input tensors the ids came
    from (a forward that receives others cannot use these rows).
    """

    key: str
    unique: KeyedIds
    dims: tuple[int, ...]
    inverse: torch.Tensor
    source: tuple[torch.Tensor, ...]

    @property
    def num_ids(self) -> int:
        return self.inverse.numel()

    def matches(self, source: tuple[torch.Tensor, ...]) -> bool:
        """Whether ``source`` (the tensors a forward received) holds the ids this plan was made from."""
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


@dataclass(frozen=True)
class ModuleRows:
    """What one module's forward reads: the flat leaf of its lookup, where its tables are in it, its plan."""

    plan: RowPlan
    weights: torch.Tensor
    base: int  # offset of the module's first table in ``weights``

    @property
    def inverse(self) -> torch.Tensor:
        return self.plan.inverse

    def layout(self, feature_tables: tuple[int, ...]) -> FlatLayout:
        """The layout of the module's tables in :attr:`weights`, for a fused lookup of its features."""
        return FlatLayout(rows=self.plan.unique.counts, dims=self.plan.dims, feature_tables=feature_tables, base=self.base)

    def table_view(self, index: int) -> torch.Tensor:
        """Rows of the module's table ``index`` as ``[n_unique, dim]`` (a view of the leaf, so gradients reach it)."""
        offsets = self.layout(()).table_offsets
        return self.weights[offsets[index] : offsets[index + 1]].view(-1, self.plan.dims[index])


class BatchRows:
    """The rows of one lookup: the plans of one or more modules, fetched together into one flat leaf tensor.

    The leaf holds the plans' tables one after another (table after table, ``[n_unique, dim]`` each), in the
    order of :attr:`keyed`; its gradient, after the backward, is the update of the same ids.
    """

    def __init__(self, plans: Sequence[RowPlan]) -> None:
        self.plans = {plan.key: plan for plan in plans}
        self.keyed = KeyedIds.concat([plan.unique for plan in plans])
        self.dims = tuple(d for plan in plans for d in plan.dims)
        self.layout = RowLayout(self.keyed.counts, self.dims)
        sizes = [RowLayout(plan.unique.counts, plan.dims).numel for plan in plans]
        self._bases = dict(zip(self.plans, accumulate(sizes, initial=0)))
        self.sharded: Any = None  # the ids bucketed by shard, ready to send (ShardClient.shard)
        self.weights: Optional[torch.Tensor] = None
        self.wait_ms = 0.0
        self._rows: Optional[Future] = None
        self._issued = threading.Event()
        self._taken: set[str] = set()

    # ---- the lookup ----------------------------------------------------------------------------------

    def attach(self, sharded: Any, rows: "Future[torch.Tensor]") -> None:
        """Hands over the lookup of these rows (flat, in :attr:`keyed` order) and the ids' sharding."""
        self.sharded = sharded
        self._rows = rows
        self._issued.set()

    def fail(self, error: BaseException) -> None:
        """Makes the forward waiting for these rows raise ``error`` (the lookup was never issued)."""
        future: Future = Future()
        future.set_exception(error)
        self._rows = future
        self._issued.set()

    def lookup_error(self, timeout_s: float) -> Optional[BaseException]:
        """Waits up to ``timeout_s`` for the lookup to be issued and answered; its error, if it failed.

        A lookup not issued, or not answered, in time gives a :class:`TimeoutError` saying which.
        """
        start = time.monotonic()
        if not self._issued.wait(timeout_s):
            return TimeoutError(f"the embedding lookup of tables {list(self.keyed.tables)} was not issued within {timeout_s:.1f} s")
        assert self._rows is not None
        try:
            return self._rows.exception(max(0.0, timeout_s - (time.monotonic() - start)))
        except FutureTimeout:
            return TimeoutError(f"the embedding lookup of tables {list(self.keyed.tables)} got no answer within {timeout_s:.1f} s")
        except CancelledError as error:
            return error

    def materialize(self, device: torch.device, requires_grad: bool, timeout_s: float) -> torch.Tensor:
        """The flat leaf of all rows on ``device`` (waits up to ``timeout_s`` for the lookup to be issued and
        answered); the same leaf on every call."""
        if self.weights is not None:
            return self.weights
        start = time.perf_counter()
        if not self._issued.wait(timeout_s):
            raise TimeoutError(f"the embedding lookup of tables {list(self.keyed.tables)} was not issued within {timeout_s:.0f} s")
        assert self._rows is not None
        try:
            fetched = self._rows.result(max(1.0, timeout_s - (time.perf_counter() - start)))
        except FutureTimeout:
            raise TimeoutError(f"the embedding lookup of tables {list(self.keyed.tables)} got no answer within {timeout_s:.0f} s") from None
        self.wait_ms = (time.perf_counter() - start) * 1e3
        self.weights = fetched.to(device, non_blocking=True).requires_grad_(requires_grad)
        return self.weights

    def stand_in(self, device: torch.device, requires_grad: bool) -> torch.Tensor:
        """Zeros in place of rows whose lookup failed, for a step that will be undone (see ``EmbeddingPipeline.rows``)."""
        self.weights = torch.zeros(self.layout.numel, device=device).requires_grad_(requires_grad)
        return self.weights

    def take(self, key: str) -> ModuleRows:
        """Module ``key``'s rows (after :meth:`materialize`); its gradient is part of this lookup's update."""
        assert self.weights is not None
        self._taken.add(key)
        return ModuleRows(self.plans[key], self.weights, self._bases[key])

    # ---- the update ----------------------------------------------------------------------------------

    @property
    def all_taken(self) -> bool:
        """Whether every planned module read its rows (else only the ones that did are updated)."""
        return len(self._taken) == len(self.plans)

    def gradient(self, scale: float) -> Optional[torch.Tensor]:
        """The leaf's gradient on the CPU as float32, times ``scale``; None without one."""
        if self.weights is None or self.weights.grad is None:
            return None
        flat = self.weights.grad.detach().to("cpu", torch.float32)
        return flat * scale if scale != 1.0 else flat

    def taken_part(self, gradient: torch.Tensor) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """``(tables, ids, gradient rows)`` of the modules that read their rows, one entry per table."""
        tables, ids, grads = [], [], []
        table_ids = torch.split(self.keyed.ids, list(self.keyed.counts))
        offsets = self.layout.table_offsets()
        position = 0
        for key, plan in self.plans.items():
            for name, dim in zip(plan.unique.tables, plan.dims):
                if key in self._taken:
                    tables.append(name)
                    ids.append(table_ids[position])
                    grads.append(gradient[offsets[position] : offsets[position + 1]].view(-1, dim))
                position += 1
        return tables, ids, grads

    # ---- metrics -------------------------------------------------------------------------------------

    @property
    def num_ids(self) -> int:
        return sum(plan.num_ids for plan in self.plans.values())

    def wire_bytes(self, element_size: int) -> int:
        """Bytes of one lookup and one update of these rows on the wire (ids twice, rows twice)."""
        return 2 * (8 * self.layout.rows + element_size * self.layout.numel)
