"""The embedding worker inside each trainer rank: lookups ahead of the forward, updates after the backward.

Batches are numbered in the order the trainer consumes them (a *step*). For each step the worker holds
the rows every remote module fetched; after the backward it pushes their gradients to the shards in one
asynchronous update, and the acknowledgement of that update opens the staleness window for the lookup
``staleness + 1`` steps later.

The window bounds staleness; it is not a target. A lookup issued as early as the window allows misses the
updates of ``staleness`` earlier steps every time, even when the shards answer well within one step, and
on tables that every batch touches (small vocabularies are updated by every step, like dense weights)
those stale gradients cost accuracy. So the prefetch thread also waits until the trainer has begun step
``t - lookahead`` before it issues the lookup of step ``t``, where ``lookahead`` (1 .. ``staleness``) is
just enough to hide what the lookup waits for: the acknowledgement of the update of step
``t - lookahead - 1``, pushed as step ``t - lookahead`` begins, then the lookup itself. So
``lookahead = ceil(1.2 * (update latency + lookup latency) / step time)``. Fast shards then give a staleness
of 1 whatever the bound; far or slow ones use more of the window.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.embedding.batch_rows import BatchRows
from lightning_persia.embedding.rank_merge import RankMerge
from lightning_persia.embedding.staleness import StalenessTimeout, StalenessWindow

if TYPE_CHECKING:
    from lightning_persia.embedding.modules import RemoteModule
    from lightning_persia.remote_ps.client import PSClient

log = logging.getLogger(__name__)

WIRE_ELEMENT_SIZE = {"fp16": 2, "fp32": 4}
LOOKAHEAD_MARGIN = 1.2  # issue a lookup this many of its latencies ahead of its step (rounded up to whole steps)
_EMA = 0.2  # weight of the newest sample in the latency and step-time averages


class _Step:
    """What one training batch fetched and will push."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.prefetched: dict[str, BatchRows] = {}  # taken by the forwards that use them
        self.planned: tuple[BatchRows, ...] = ()  # the same rows, for the prefetch thread to issue
        self.used: list[BatchRows] = []
        self.lag = 0
        self.generation = 0  # EmbeddingWorker.generation when planned; rows of an older one are refetched


class EmbeddingWorker:
    """Per-rank client-side engine of the remote embedding modules.

    Args:
        client: connection to every parameter-server shard.
        staleness: how many earlier batches' updates a lookup may miss (0 = synchronous).
        wire_dtype: ``"fp16"`` or ``"fp32"`` for rows and gradients on the wire.
        device: where batch-local tables are placed for the forward.
        timeout_s: longest wait for the staleness window before failing with a clear error.
    """

    def __init__(self, client: "PSClient", staleness: int, wire_dtype: str, device: torch.device, timeout_s: float = 300.0) -> None:
        if wire_dtype not in WIRE_ELEMENT_SIZE:
            raise ValueError(f"wire_dtype must be one of {sorted(WIRE_ELEMENT_SIZE)}, got {wire_dtype!r}")
        self.client = client
        self.window = StalenessWindow(staleness)
        self.wire_dtype = wire_dtype
        self.device = device
        self.timeout_s = timeout_s
        self.modules: dict[str, "RemoteModule"] = {}
        self.dropped_nonfinite_rows = 0
        self._lock = threading.Lock()
        self._allocated = 0
        self._finished_through = 0  # steps 0 .. _finished_through - 1 are pushed or abandoned
        self._ready: deque[_Step] = deque()
        self._current: Optional[_Step] = None
        self._progress = threading.Condition()  # guards the figures below, notified when a step begins
        self._begun = -1  # index of the last step the trainer opened
        self._last_begin: Optional[float] = None
        self.step_seconds: Optional[float] = None  # moving average of the time between two steps' starts
        self.lookup_seconds: Optional[float] = None  # moving average of a lookup's latency (issue -> rows)
        self.update_seconds: Optional[float] = None  # moving average of an update's latency (push -> acknowledged)
        self.prefetch_misses = 0  # forwards whose ids differed from the ones their lookup was planned from
        self._reported_misses: set[str] = set()
        # Set by the strategy's recovery: a failed update is reported to it (True: handled, the window goes on)
        # instead of failing the staleness window.
        self.on_update_error: Optional[Callable[[int, BaseException], bool]] = None
        # Set by the strategy with more than one rank: the ranks push one summed update per step.
        self.rank_merge: Optional[RankMerge] = None
        self.generation = 0

    # ---- modules -------------------------------------------------------------------------------------

    def register(self, module: "RemoteModule") -> None:
        self.modules[module.key] = module
        module.bind(self)

    @property
    def training(self) -> bool:
        """Whether a training step is open (its forward fetches trainable rows)."""
        return self._current is not None

    # ---- prefetch side (called from the prefetch thread) --------------------------------------------

    def plan(self, batch: Any) -> _Step:
        """Numbers ``batch`` as the next step and dedups the ids of every module that can be prefetched."""
        with self._lock:
            step = _Step(self._allocated)
            step.generation = self.generation
            self._allocated += 1
        kjts = list(_find_kjts(batch))
        for key, module in self.modules.items():
            rows = module.plan_prefetch(kjts)
            if rows is not None:
                step.prefetched[key] = rows
        step.planned = tuple(step.prefetched.values())
        return step

    def lookahead(self) -> int:
        """How many steps before its own a step's lookup is issued: 1 .. staleness (0 when synchronous)."""
        staleness = self.window.staleness
        with self._progress:
            lookup, update, step = self.lookup_seconds, self.update_seconds or 0.0, self.step_seconds
        if staleness <= 1 or lookup is None or not step:
            return min(staleness, 1)
        return max(1, min(staleness, math.ceil(LOOKAHEAD_MARGIN * (update + lookup) / step)))

    def issue(self, step: _Step, stop: threading.Event) -> None:
        """Starts the step's lookups once the trainer is :meth:`lookahead` steps away and the window allows.

        If ``stop`` is set first, or the window fails, the forward waiting for these rows raises instead.
        """
        try:
            lookahead = 0  # staleness 0: the window alone orders lookups after updates
            while self.window.staleness > 0:
                if stop.is_set():
                    raise RuntimeError(f"the prefetch of step {step.index} was stopped before its lookup")
                lookahead = self.lookahead()
                with self._progress:
                    if step.index - lookahead <= self._begun:
                        break
                    self._progress.wait(0.1)
            while True:
                if stop.is_set():
                    raise RuntimeError(f"the prefetch of step {step.index} was stopped before its lookup")
                try:
                    # Every update older than the lookahead has been pushed by now: waiting for its
                    # acknowledgement costs a fraction of a step and makes the lookup miss only `lookahead`
                    # updates (the ones not computed yet), not up to `staleness`.
                    self.window.wait_until(step.index - lookahead, timeout_s=0.1)
                    break
                except StalenessTimeout:
                    continue
            step.lag = self.window.lag(step.index)
            if step.planned:
                request: dict[str, torch.Tensor] = {}
                for rows in step.planned:
                    request.update(rows.request())
                issued = time.perf_counter()
                future = self.client.lookup_async(request, train=True, wire_dtype=self.wire_dtype)
                future.add_done_callback(lambda f: self._observe("lookup_seconds", time.perf_counter() - issued))
                for rows in step.planned:
                    rows.attach(future)
        except BaseException as error:
            for rows in step.planned:
                rows.fail(error)
            raise

    def enqueue(self, step: _Step) -> None:
        """Makes ``step`` the next one :meth:`begin_step` opens (the trainer consumes batches in order)."""
        self._ready.append(step)

    def abandon(self, steps: list[_Step]) -> None:
        """Steps planned but never trained (an epoch cut short): their window slots are released."""
        for step in steps:
            self.window.acknowledge(step.index)
            with self._lock:
                self._finished_through = max(self._finished_through, step.index + 1)

    def abandon_ready(self) -> None:
        steps = list(self._ready)
        self._ready.clear()
        self.abandon(steps)

    # ---- training side (main thread) ----------------------------------------------------------------

    def begin_step(self) -> None:
        """Opens the next training step: the batch the trainer is about to run."""
        self.finish_step(scale=1.0)
        if self._ready:
            self._current = self._ready.popleft()
            if self._current.generation != self.generation:
                self._current.prefetched.clear()  # fetched before a rollback: the forward fetches them again
        else:
            with self._lock:
                self._current = _Step(self._allocated)
                self._allocated += 1
            self.window.wait_for_lookup(self._current.index, self.timeout_s)
            self._current.lag = self.window.lag(self._current.index)
        self._observe_begin(self._current.index)

    def _observe_begin(self, index: int) -> None:
        now = time.perf_counter()
        with self._progress:
            if self._last_begin is not None:
                interval = now - self._last_begin
                if self.step_seconds is None:
                    self.step_seconds = interval
                elif interval < 10 * self.step_seconds:  # not a pause (validation, a checkpoint)
                    self.step_seconds += _EMA * (interval - self.step_seconds)
            self._last_begin = now
            self._begun = max(self._begun, index)
            self._progress.notify_all()

    def _observe(self, latency: str, seconds: float) -> None:
        """Folds one measured latency into the moving average ``self.<latency>``."""
        with self._progress:
            average = getattr(self, latency)
            setattr(self, latency, seconds if average is None else average + _EMA * (seconds - average))

    def rows_for(self, module: "RemoteModule", source: tuple[torch.Tensor, ...], plan: Callable[[], BatchRows]) -> BatchRows:
        """The batch-local rows for one forward call of ``module``, materialised on the device."""
        step = self._current
        if step is None:
            rows = plan()
            rows.attach(self.client.lookup_async(rows.request(), train=False, wire_dtype=self.wire_dtype))
            rows.materialize(self.device, requires_grad=False, timeout_s=self.timeout_s)
            return rows
        rows = step.prefetched.pop(module.key, None)
        if rows is not None and not rows.matches(source):
            self._prefetch_missed(module)
            rows = None
        if rows is None:
            rows = plan()
            self.window.wait_for_lookup(step.index, self.timeout_s)
            rows.attach(self.client.lookup_async(rows.request(), train=True, wire_dtype=self.wire_dtype))
        rows.materialize(self.device, requires_grad=torch.is_grad_enabled(), timeout_s=self.timeout_s)
        step.used.append(rows)
        return rows

    def _prefetch_missed(self, module: "RemoteModule") -> None:
        self.prefetch_misses += 1
        if module.key in self._reported_misses:
            return
        self._reported_misses.add(module.key)
        log.warning(
            "%s %r received other ids than the batch its rows were prefetched from (does the model change the ids "
            "before this module, e.g. hashing them modulo a table size? Do that in the data pipeline instead). Its "
            "rows are fetched again inside the forward, which waits for them every step, and the prefetched lookup "
            "admitted rows for nothing.", type(module).__name__, module.key,
        )

    def step_metrics(self) -> dict[str, float]:
        """Figures of the open step so far: lookup wait, rows fetched, unique ratio, wire bytes, staleness."""
        step = self._current
        if step is None or not step.used:
            return {}
        unique = sum(sum(u.numel() for u in rows.unique) for rows in step.used)
        total = sum(rows.num_ids for rows in step.used)
        return {
            "lookup_wait_ms": sum(rows.wait_ms for rows in step.used),
            "rows_fetched": float(unique),
            "unique_ratio": unique / max(total, 1),
            "wire_bytes": float(sum(rows.wire_bytes(WIRE_ELEMENT_SIZE[self.wire_dtype]) for rows in step.used)),
            "staleness": float(step.lag),
        }

    def finish_step(self, scale: float) -> None:
        """Pushes the open step's gradients (times ``scale``) asynchronously and closes the step.

        With :attr:`rank_merge` set, the ranks' gradients are summed first, in the background, and pushed as
        one update. Every step the trainer opens is closed once, by whichever call comes first (after its
        backward, or when the next step opens or the worker drains), so each rank submits once per step, with
        or without a gradient, and the ranks' merges stay paired step by step.
        """
        step, self._current = self._current, None
        if step is None:
            return
        updates: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for rows in step.used:
            for table, (ids, grads) in rows.gradients(scale).items():
                if not bool(torch.isfinite(grads).all()):
                    self.dropped_nonfinite_rows += ids.numel()
                    continue
                if table in updates:  # the module ran twice in this step; the shard sums duplicate ids
                    ids = torch.cat([updates[table][0], ids])
                    grads = torch.cat([updates[table][1], grads])
                updates[table] = (ids, grads)
        with self._lock:
            self._finished_through = step.index + 1
        pushed = time.perf_counter()
        if self.rank_merge is not None:
            sender = self.rank_merge.sender
            future = self.rank_merge.submit(updates, lambda merged: self.client.update_async(merged, wire_dtype=self.wire_dtype, sender=sender))
        elif updates:
            future = self.client.update_async(updates, wire_dtype=self.wire_dtype)
        else:
            self.window.acknowledge(step.index)
            return
        future.add_done_callback(lambda f, index=step.index: self._on_update_done(index, f, time.perf_counter() - pushed))

    def drain(self) -> None:
        """Waits until every pushed update is applied (before a checkpoint, evaluation or the end)."""
        self.finish_step(scale=1.0)
        self.wait_for_pushed()

    def wait_for_pushed(self) -> None:
        """Waits until every update pushed so far is answered; the open step stays open."""
        with self._lock:
            through = self._finished_through
        self.window.wait_until(through, self.timeout_s)

    def invalidate_prefetched(self) -> None:
        """Rows fetched so far (for the open step and every planned one) are stale: fetch them again."""
        with self._lock:
            self.generation += 1
        if self._current is not None:
            self._current.prefetched.clear()

    def _on_update_done(self, index: int, future: Future, seconds: float) -> None:
        if future.cancelled():
            # PSClient.close() (or the rank merge's) cancelled it: the run is stopping, whatever stopped it.
            # future.exception() would raise CancelledError here, which the future prints as a traceback of
            # its own callback, ahead of and unrelated to the error that stopped the run.
            self.window.fail(RuntimeError(f"embedding update of step {index} was cancelled: the connection to the parameter server was closed"))
            return
        error = future.exception()
        if error is None:
            self._observe("update_seconds", seconds)
        if error is not None and self.on_update_error is not None and self.on_update_error(index, error):
            self.window.acknowledge(index)
            return
        if error is not None:
            self.window.fail(RuntimeError(f"embedding update of step {index} failed: {error}"))
        else:
            self.window.acknowledge(index)


def _find_kjts(batch: Any, depth: int = 0) -> Iterator[KeyedJaggedTensor]:
    """Every KeyedJaggedTensor inside a batch of dicts, lists, tuples and dataclasses."""
    if depth > 4:
        return
    if isinstance(batch, KeyedJaggedTensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _find_kjts(value, depth + 1)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _find_kjts(value, depth + 1)
    elif is_dataclass(batch) and not isinstance(batch, type):
        for field in fields(batch):
            yield from _find_kjts(getattr(batch, field.name), depth + 1)
