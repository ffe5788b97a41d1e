"""After each step's backward: its embedding gradients, checked, merged across ranks, pushed and acknowledged.

The gradient of a step's rows is one flat tensor in the order of the ids the step looked up, so in the usual
case (every prefetched module read its rows once) the update reuses the lookup's bucketing and encoded ids:
one finiteness check, one conversion and one message per shard. Each update's acknowledgement opens the
staleness window for a later lookup.

The trainer's thread only starts each gradient's way to the host (on a GPU: a copy on a side stream once the
backward's kernels are done, ``embedding/transfer.py``) and queues the step; the pusher's own thread waits for
that copy, checks, encodes and sends, step after step in order, so the dense optimizer step never waits for a
push.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch
from torch.profiler import record_function

from lightning_persia.embedding.batch_rows import BatchRows
from lightning_persia.embedding.context import SparseUpdate
from lightning_persia.embedding.phases import GRADIENT_ENCODE, GRADIENT_PUSH
from lightning_persia.embedding.scheduler import LookupScheduler
from lightning_persia.embedding.transfer import DeviceTransfer, Download
from lightning_persia.ops.keyed_ids import KeyedIds

if TYPE_CHECKING:
    from lightning_persia.embedding.rank_merge import RankMerge
    from lightning_persia.embedding.shard_client import ShardClient


class GradientPusher:
    """Pushes each step's embedding gradients as one update and acknowledges it in the scheduler's window.

    Args:
        client: connection to the shards.
        scheduler: whose staleness window each acknowledgement advances.
        wire_dtype: ``"fp16"`` or ``"fp32"`` for gradients on the wire.
        transfer: how gradients come back from the trainer's device.
    """

    def __init__(self, client: "ShardClient", scheduler: LookupScheduler, wire_dtype: str,
                 transfer: Optional[DeviceTransfer] = None) -> None:
        self.client = client
        self.scheduler = scheduler
        self.wire_dtype = wire_dtype
        self.transfer = transfer if transfer is not None else DeviceTransfer(torch.device("cpu"))
        self.dropped_nonfinite_rows = 0
        # With more than one rank: the ranks' gradients of a step are summed and pushed as one update.
        self.rank_merge: Optional["RankMerge"] = None
        # Called with (step, error) when an update fails; True: handled (recovery rolls back at its next
        # check), the window goes on. Otherwise the window fails and every later lookup raises the error.
        self.on_update_error: Optional[Callable[[int, BaseException], bool]] = None
        self._lock = threading.Lock()
        self._pushed_through = 0  # steps 0 .. _pushed_through - 1 are pushed or skipped
        self._queue: "queue.SimpleQueue[Optional[tuple[int, list[tuple[BatchRows, Download]], float]]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def push(self, step: int, rows: Sequence[BatchRows], scale: Union[float, torch.Tensor]) -> None:
        """Queues the gradients of ``rows`` (times ``scale``: a tensor on the device multiplies them there) as
        ``step``'s update and returns at once: the pusher's thread sends it."""
        with record_function(GRADIENT_PUSH):
            on_device = scale if isinstance(scale, torch.Tensor) else None
            downloads = [(r, d) for r in rows if (d := r.download_gradient(self.transfer, on_device)) is not None]
            scale = 1.0 if on_device is not None else scale
            with self._lock:
                self._pushed_through = max(self._pushed_through, step + 1)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="persia-push", daemon=True)
                    self._thread.start()
            self._queue.put((step, downloads, scale))

    def close(self) -> None:
        """Ends the pusher's thread after the steps queued so far."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            step, downloads, scale = item
            try:
                self._send_step(step, downloads, scale)
            except BaseException as error:  # noqa: BLE001 - every later lookup hears of it through the window
                self._failed(step, error)

    def _send_step(self, step: int, downloads: list[tuple[BatchRows, Download]], scale: float) -> None:
        with record_function(GRADIENT_ENCODE):
            grads = [(rows, download.get()) for rows, download in downloads]
            update = self._update([(rows, grad * scale if scale != 1.0 else grad) for rows, grad in grads])
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

    def _update(self, with_grads: list[tuple[BatchRows, torch.Tensor]]) -> Optional[SparseUpdate]:
        """The step's update from every lookup's (scaled, float32, host) gradient, without the non-finite rows (counted)."""
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
        else:
            self._failed(step, error)

    def _failed(self, step: int, error: BaseException) -> None:
        if self.on_update_error is not None and self.on_update_error(step, error):
            self.scheduler.window.acknowledge(step)
        elif isinstance(error, CancelledError):
            self.scheduler.window.fail(RuntimeError(
                f"embedding update of step {step} was cancelled: the connection to the parameter server was closed"))
        else:
            self.scheduler.window.fail(RuntimeError(f"embedding update of step {step} failed: {error}"))
