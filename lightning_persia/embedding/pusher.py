"""After each step's backward: its embedding gradients, checked, merged across ranks, pushed and acknowledged.

The gradient of a step's rows is one flat tensor in the order of the ids the step looked up, so in the usual
case (every prefetched module read its rows once) the update reuses the lookup's bucketing and encoded ids:
one finiteness check, one conversion and one message per shard. Each update's acknowledgement opens the
staleness window for a later lookup.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch.profiler import record_function

from lightning_persia.embedding.batch_rows import BatchRows
from lightning_persia.embedding.phases import GRADIENT_PUSH
from lightning_persia.embedding.scheduler import LookupScheduler
from lightning_persia.ops.keyed_ids import KeyedIds

if TYPE_CHECKING:
    from lightning_persia.embedding.rank_merge import RankMerge
    from lightning_persia.embedding.shard_client import ShardClient


@dataclass(frozen=True)
class SparseUpdate:
    """Gradients of ``keyed``'s ids: ``grads`` flat in its order, ``dims[t]`` values per row of table ``t``.

    ``sharded``: the ids' bucketing and encoding when the lookup made them already (None: the push makes them).
    """

    keyed: KeyedIds
    grads: torch.Tensor
    dims: tuple[int, ...]
    sharded: Any = None


class GradientPusher:
    """Pushes each step's embedding gradients as one update and acknowledges it in the scheduler's window.

    Args:
        client: connection to the shards.
        scheduler: whose staleness window each acknowledgement advances.
        wire_dtype: ``"fp16"`` or ``"fp32"`` for gradients on the wire.
    """

    def __init__(self, client: "ShardClient", scheduler: LookupScheduler, wire_dtype: str) -> None:
        self.client = client
        self.scheduler = scheduler
        self.wire_dtype = wire_dtype
        self.dropped_nonfinite_rows = 0
        # With more than one rank: the ranks' gradients of a step are summed and pushed as one update.
        self.rank_merge: Optional["RankMerge"] = None
        # Called with (step, error) when an update fails; True: handled (recovery rolls back at its next
        # check), the window goes on. Otherwise the window fails and every later lookup raises the error.
        self.on_update_error: Optional[Callable[[int, BaseException], bool]] = None
        self._lock = threading.Lock()
        self._pushed_through = 0  # steps 0 .. _pushed_through - 1 are pushed or skipped

    def push(self, step: int, rows: Sequence[BatchRows], scale: float) -> None:
        """Pushes the gradients of ``rows`` (times ``scale``) as ``step``'s update, without waiting for it."""
        with record_function(GRADIENT_PUSH):
            update = self._update(rows, scale)
            with self._lock:
                self._pushed_through = max(self._pushed_through, step + 1)
            pushed = time.perf_counter()
            if self.rank_merge is not None:
                sender = self.rank_merge.sender
                future = self.rank_merge.submit(update, lambda merged: self._send(merged, sender))
            elif update is not None:
                future = self._send(update, None)
            else:
                self.scheduler.window.acknowledge(step)
                return
        future.add_done_callback(lambda f: self._done(step, f, time.perf_counter() - pushed))

    def skip(self, step: int) -> None:
        """``step`` was planned but never trained (an epoch cut short): its window slot is released."""
        self.scheduler.window.acknowledge(step)
        with self._lock:
            self._pushed_through = max(self._pushed_through, step + 1)

    def wait_for_pushed(self, timeout_s: float) -> None:
        """Waits until every update pushed so far is answered."""
        with self._lock:
            through = self._pushed_through
        self.scheduler.window.wait_until(through, timeout_s)

    def _send(self, update: SparseUpdate, sender: Optional[str]) -> "Future[None]":
        sharded = update.sharded or self.client.shard(update.keyed)
        return self.client.update_sharded_async(sharded, update.grads, update.dims, wire_dtype=self.wire_dtype, sender=sender)

    def _update(self, rows: Sequence[BatchRows], scale: float) -> Optional[SparseUpdate]:
        """The step's update: every lookup's gradient rows, without the non-finite ones (counted)."""
        with_grads = [(r, g) for r in rows if (g := r.gradient(scale)) is not None]
        if not with_grads:
            return None
        if len(with_grads) == 1 and with_grads[0][0].all_taken:  # the usual case: one lookup, read by all
            batch, grads = with_grads[0]
            if bool(torch.isfinite(grads.sum())):  # a sum is finite only if every term is (or overflowed: checked below)
                return SparseUpdate(batch.keyed, grads, batch.dims, batch.sharded)
        # Several lookups (a module that fetched its rows in its forward) or modules that did not read theirs:
        # the update is made table by table; the same table's rows are concatenated (the shard sums duplicates).
        per_table: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for batch, grads in with_grads:
            for name, ids, table_grads in zip(*batch.taken_part(grads)):
                entry = per_table.setdefault(name, ([], []))
                entry[0].append(ids)
                entry[1].append(table_grads)
        tables, counts, ids, values, dims = [], [], [], [], []
        for name, (table_ids, table_grads) in per_table.items():
            stacked = torch.cat(table_grads)
            finite = torch.isfinite(stacked).all(dim=1)
            kept = int(finite.sum())
            if kept != finite.numel():
                self.dropped_nonfinite_rows += finite.numel() - kept
            tables.append(name)
            counts.append(kept)
            ids.append(torch.cat(table_ids)[finite])
            values.append(stacked[finite].reshape(-1))
            dims.append(stacked.shape[1])
        keyed = KeyedIds(tuple(tables), tuple(counts), torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64))
        return SparseUpdate(keyed, torch.cat(values) if values else torch.empty(0), tuple(dims))

    def _done(self, step: int, future: Future, seconds: float) -> None:
        try:
            error = future.exception()
        except CancelledError as cancelled:  # the client closed with the update in flight
            error = cancelled
        if error is None:
            self.scheduler.observe("update", seconds)
            self.scheduler.window.acknowledge(step)
        elif self.on_update_error is not None and self.on_update_error(step, error):
            self.scheduler.window.acknowledge(step)
        elif isinstance(error, CancelledError):
            self.scheduler.window.fail(RuntimeError(
                f"embedding update of step {step} was cancelled: the connection to the parameter server was closed"))
        else:
            self.scheduler.window.fail(RuntimeError(f"embedding update of step {step} failed: {error}"))
