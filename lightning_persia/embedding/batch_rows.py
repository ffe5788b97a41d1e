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

from lightning_persia.embedding.transfer import DeviceTransfer, Download, Upload
from lightning_persia.ops.keyed_ids import KeyedIds, RowLayout
from lightning_persia.ops.pooled_lookup import FlatLayout, FusedArguments
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
    feature_tables: Optional[tuple[int, ...]] = None  # a pooled collection's table of each feature (its fused lookup)
    id_counts: tuple[int, ...] = ()  # ids of the input per table (they come table after table)

    def block_rows(self) -> torch.Tensor:
        """For every id of the input, its row among all the module's unique ids (its tables' rows one after another)."""
        if len(self.dims) == 1:
            return self.inverse
        starts = torch.tensor([0, *accumulate(self.unique.counts)][:-1], dtype=torch.int64)
        return self.inverse + torch.repeat_interleave(starts, torch.tensor(self.id_counts, dtype=torch.int64), output_size=self.inverse.numel())

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
    """What one module's forward reads: the flat leaf of its lookup, where its tables are in it, its plan.

    ``device_inverse``, ``device_block_rows`` and ``fused``: the plan's inverse indices, its ids' rows in the
    module's block (:meth:`RowPlan.block_rows`) and its fused lookup's arguments, already on the leaf's device
    when the pipeline moved them there ahead of the forward.
    """

    plan: RowPlan
    weights: torch.Tensor
    base: int  # offset of the module's first table in ``weights``
    device_inverse: Optional[torch.Tensor] = None
    fused: Optional[FusedArguments] = None
    device_block_rows: Optional[torch.Tensor] = None

    @property
    def block_rows(self) -> torch.Tensor:
        """Every id's row among the module's unique ids (``RowPlan.block_rows``), on the leaf's device."""
        if self.device_block_rows is not None:
            return self.device_block_rows
        return self.plan.block_rows().to(self.weights.device)

    @property
    def inverse(self) -> torch.Tensor:
        return self.device_inverse if self.device_inverse is not None else self.plan.inverse

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
        sizes = [RowLayout(plan.unique.counts, plan.dims).numel for plan in plans] if len(plans) > 1 else [self.layout.numel]
        self._bases = dict(zip(self.plans, accumulate(sizes, initial=0)))
        self.sharded: Any = None  # the ids bucketed by shard, ready to send (ShardClient.shard)
        self.weights: Optional[torch.Tensor] = None
        self.wait_ms = 0.0
        self._rows: Optional[Future] = None  # the flat rows on the host, or (on a GPU) their Upload
        self._issued = threading.Event()
        self._taken: set[str] = set()
        self._inverses: dict[str, Upload] = {}
        self._block_rows: dict[str, Upload] = {}
        self._fused: dict[str, tuple[FusedArguments, Upload]] = {}

    # ---- the lookup ----------------------------------------------------------------------------------

    def prepare(self, transfer: DeviceTransfer, fused_lookup: bool) -> None:
        """Starts moving what the forwards read besides the rows to the device (on a GPU; nothing on the CPU): every
        plan's inverse indices, each sequence collection's rows in its block and, with ``fused_lookup``, each pooled
        plan's fused-lookup arguments."""
        if not transfer.on_gpu:
            return
        for key, plan in self.plans.items():
            self._inverses[key] = transfer.upload(plan.inverse)
            if plan.feature_tables is None and len(plan.dims) > 1:
                self._block_rows[key] = transfer.upload(plan.block_rows())
            if fused_lookup and plan.feature_tables is not None:
                layout = FlatLayout(rows=plan.unique.counts, dims=plan.dims, feature_tables=plan.feature_tables, base=self._bases[key])
                arguments = FusedArguments.of(layout)
                self._fused[key] = (arguments, transfer.upload(arguments.packed))

    def attach(self, sharded: Any, rows: "Future[torch.Tensor]", transfer: Optional[DeviceTransfer] = None) -> None:
        """Hands over the lookup of these rows (flat, in :attr:`keyed` order) and the ids' sharding; with a GPU
        ``transfer``, the rows start their way to the device as soon as they arrive."""
        self.sharded = sharded
        if transfer is not None and transfer.on_gpu:
            rows = _then(rows, transfer.upload)
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
        on_device = fetched.get() if isinstance(fetched, Upload) else fetched.to(device)
        self.weights = on_device.requires_grad_(requires_grad)
        return self.weights

    def stand_in(self, device: torch.device, requires_grad: bool) -> torch.Tensor:
        """Zeros in place of rows whose lookup failed, for a step that will be undone (see ``EmbeddingPipeline.rows``)."""
        self.weights = torch.zeros(self.layout.numel, device=device).requires_grad_(requires_grad)
        return self.weights

    def take(self, key: str) -> ModuleRows:
        """Module ``key``'s rows (after :meth:`materialize`); its gradient is part of this lookup's update."""
        assert self.weights is not None
        self._taken.add(key)
        inverse = self._inverses[key].get() if key in self._inverses else None
        block_rows = self._block_rows[key].get() if key in self._block_rows else None
        fused = None
        if key in self._fused:
            arguments, packed = self._fused[key]
            fused = arguments.with_packed(packed.get())
        return ModuleRows(self.plans[key], self.weights, self._bases[key], inverse, fused, block_rows)

    # ---- the update ----------------------------------------------------------------------------------

    @property
    def all_taken(self) -> bool:
        """Whether every planned module read its rows (else only the ones that did are updated)."""
        return len(self._taken) == len(self.plans)

    def download_gradient(self, transfer: DeviceTransfer, scale: Optional[torch.Tensor] = None) -> Optional[Download]:
        """Starts the leaf's gradient (times ``scale``, on its device) on its way to the host as float32 (returns at
        once); None without one."""
        if self.weights is None or self.weights.grad is None:
            return None
        grad = self.weights.grad if scale is None else self.weights.grad.float() * scale
        return transfer.download(grad, torch.float32)

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


def _then(future: Future, function: Any) -> Future:
    """A future of ``function(result)``, run by whichever thread completes ``future`` (its error passes through)."""
    chained: Future = Future()

    def done(source: Future) -> None:
        try:
            chained.set_result(function(source.result()))
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the chained future
            chained.set_exception(error)

    future.add_done_callback(done)
    return chained
