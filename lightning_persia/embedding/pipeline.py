"""The embedding pipeline of one trainer rank: each step's rows planned and fetched ahead, gradients pushed after.

Modelled on TorchRec's train pipeline, with PERSIA's bounded staleness between lookups and updates:

- **plan** (prefetch thread, or the train DataLoader's workers): the step's batch is numbered, every remote
  module's input found in it and deduplicated, and all of the step's ids bucketed by shard and encoded once
  (:meth:`EmbeddingPipeline.plan`, ``embedding/planning.py``);
- **issue** (prefetch thread): the :class:`~lightning_persia.embedding.scheduler.LookupScheduler` says when the
  step's one lookup may go out (:meth:`EmbeddingPipeline.issue`);
- **forward** (trainer): each twin asks for its rows (:meth:`EmbeddingPipeline.rows`, the
  :class:`~lightning_persia.embedding.row_source.RowSource` protocol) and gets the prefetched ones, or, when its
  input differs from the batch's, fetches its own;
- **push** (trainer, after the backward): the :class:`~lightning_persia.embedding.pusher.GradientPusher` sends
  the step's gradient as one update, whose acknowledgement advances the staleness window.

Each step's state lives in a :class:`~lightning_persia.embedding.context.StepContext`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch.profiler import record_function

from lightning_persia.embedding.batch_rows import BatchRows, ModuleRows
from lightning_persia.embedding.batch_search import Path, at_path, find_path
from lightning_persia.embedding.context import StepContext
from lightning_persia.embedding.phases import LOOKUP_WAIT, PLAN
from lightning_persia.embedding.planning import BatchPlanner, Deduplicate, PlannedBatch
from lightning_persia.embedding.pusher import GradientPusher
from lightning_persia.embedding.row_source import Planner
from lightning_persia.embedding.scheduler import LookupScheduler
from lightning_persia.embedding.transfer import DeviceTransfer
from lightning_persia.ops import wire
from lightning_persia.ops.pooled_lookup import fbgemm_available
from lightning_persia.ops.dedup import keyed_unique
from lightning_persia.ops.keyed_ids import KeyedIds

if TYPE_CHECKING:
    from lightning_persia.embedding.rank_merge import RankMerge
    from lightning_persia.embedding.shard_client import ShardClient

log = logging.getLogger(__name__)


class EmbeddingLookupError(RuntimeError):
    """An evaluation forward could not get its rows (``cause``: the lookup's error); nothing was written."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the embedding lookup of an evaluation forward failed: {type(cause).__name__}: {cause}")
        self.cause = cause


class EmbeddingPipeline:
    """Per-rank engine of the remote twins (their :class:`RowSource`).

    Args:
        client: connection to every parameter-server shard.
        staleness: how many earlier steps' updates a lookup may miss (0 = synchronous).
        wire_dtype: ``"fp16"`` or ``"fp32"`` for rows and gradients on the wire.
        device: where batch-local rows are placed for the forward.
        timeout_s: longest wait for rows or for the staleness window before failing with a clear error (at
            least as long as one call to the shards may last with its retries).
        rank_merge: with several ranks, sums their gradients of a step into one update.
        dedup: how the prefetch deduplicates each module's ids of a step (default: here, ``ops.dedup.keyed_unique``;
            ``EmbeddingWorkers.deduplicate``: in an embedding worker).
    """

    def __init__(
        self, client: "ShardClient", staleness: int, wire_dtype: str, device: torch.device, timeout_s: float = 300.0,
        rank_merge: Optional["RankMerge"] = None, dedup: Deduplicate = keyed_unique,
    ) -> None:
        wire.wire_dtype(wire_dtype)
        self.client = client
        self.wire_dtype = wire_dtype
        self.device = device
        self.timeout_s = timeout_s
        self._dedup = dedup
        self.scheduler = LookupScheduler(staleness)
        self.transfer = DeviceTransfer(device)
        self._fused_lookup = fbgemm_available(self.transfer.device.type)
        self.pusher = GradientPusher(client, self.scheduler, wire_dtype, self.transfer)
        self.pusher.rank_merge = rank_merge
        self.prefetch_misses = 0  # forwards whose input differed from the one their lookup was planned from
        self._planners: dict[str, Planner] = {}
        self._paths: dict[str, Path] = {}  # where in a batch each module's input was found
        self._located: set[str] = set()  # modules whose input was looked for in a training batch
        self._lock = threading.Lock()
        self._allocated = 0
        self._generation = 0
        self._ready: deque[StepContext] = deque()
        self._current: Optional[StepContext] = None
        self._reported_misses: set[str] = set()
        self._on_lookup_error: Optional[Callable[[int, BaseException], bool]] = None
        # Whether the trainer runs each planned batch as the loader gave it, moved to its device as a whole and
        # changed by nothing else (no user hook between the loader and the forward): then a module's input is
        # recognised by where it sits in the batch (see _is_planned_input). Whoever runs the pipeline says so.
        self.batches_arrive_unchanged = False

    # ---- set-up --------------------------------------------------------------------------------------

    def register(self, planner: Planner) -> None:
        """Serves the rows of ``planner``'s module from now on (the strategy sets the module's ``row_source`` to
        this pipeline)."""
        self._planners[planner.key] = planner

    def batch_planner(self) -> BatchPlanner:
        """How a batch's lookup is planned, as plain data: what a DataLoader worker runs (see ``planning.py``)."""
        with self._lock:
            paths = tuple(self._paths.items())
        return BatchPlanner(tuple(self._planners.values()), paths, self.client.sharder())

    def set_update_error_handler(self, handler: Callable[[int, BaseException], bool]) -> None:
        """``handler(step, error)`` is told of every failed update; True: handled (the window goes on)."""
        self.pusher.on_update_error = handler

    def set_lookup_error_handler(self, handler: Callable[[int, BaseException], bool]) -> None:
        """``handler(step, error)`` is told of a training forward's failed lookup; True: handled (the forward goes
        on with rows of zeros, whose step the handler undoes), else the forward raises ``error``."""
        self._on_lookup_error = handler

    @property
    def staleness(self) -> int:
        return self.scheduler.staleness

    @property
    def current_step(self) -> Optional[int]:
        """The open training step (its forwards fetch trainable rows), if any."""
        return self._current.index if self._current is not None else None

    @property
    def dropped_nonfinite_rows(self) -> int:
        return self.pusher.dropped_nonfinite_rows

    # ---- prefetch side (the prefetch thread) ---------------------------------------------------------

    def plan(self, batch: Any) -> StepContext:
        """Numbers ``batch`` as the next step and plans the one lookup of every module whose input it shows."""
        with record_function(PLAN):
            return self.adopt(replace(self.batch_planner(), dedup=self._dedup).plan(batch))

    def adopt(self, planned: PlannedBatch) -> StepContext:
        """Numbers a batch planned elsewhere (a DataLoader worker) as the next step.

        Modules the planner could not place (their input's path in the batch was learnt after the worker started)
        are planned here, and the step's ids sharded again with theirs.
        """
        plans, sharded = list(planned.plans), planned.sharded
        with self._lock:
            paths = dict(self._paths)
        missing = [p for key, p in self._planners.items() if key in paths and all(plan.key != key for plan in plans)]
        if missing:
            with record_function(PLAN):
                for planner in missing:
                    features = at_path(planned.batch, paths[planner.key])
                    if features is not None and planner.accepts(features):
                        plans.append(planner.plan(features, self._dedup))
                if len(plans) > len(planned.plans):
                    sharded = self.client.shard(KeyedIds.concat([p.unique for p in plans]))
        with self._lock:
            step = StepContext(self._allocated, self._generation)
            self._allocated += 1
        if plans:
            step.prefetched = BatchRows(plans)
            step.prefetched.sharded = sharded
        return step

    def issue(self, step: StepContext, stopped: Callable[[], bool]) -> None:
        """Starts the step's lookup when the scheduler says so; if ``stopped()`` first (then call
        :meth:`wake`), or the window fails, the forward waiting for these rows raises instead."""
        rows = step.prefetched
        try:
            step.lag = self.scheduler.wait_for_turn(step.index, stopped)
            if rows is not None:
                self._fetch(rows, train=True, observe=True, step=step)
        except BaseException as error:
            if rows is not None:
                rows.fail(error)
            raise

    def wake(self) -> None:
        """Wakes the lookups waiting in :meth:`issue` to check their ``stopped``."""
        self.scheduler.wake()

    def enqueue(self, step: StepContext) -> None:
        """Makes ``step`` the next one :meth:`begin_step` opens (the trainer consumes batches in order)."""
        self._ready.append(step)

    def abandon(self, steps: list[StepContext]) -> None:
        """Steps planned but never trained (an epoch cut short): their window slots are released."""
        for step in steps:
            self.pusher.skip(step.index)

    def abandon_ready(self) -> None:
        steps = list(self._ready)
        self._ready.clear()
        self.abandon(steps)

    # ---- training side (the trainer's thread) --------------------------------------------------------

    def begin_step(self, batch: Any = None) -> None:
        """Opens the next training step: ``batch``, the one the trainer is about to run."""
        self.finish_step(scale=1.0)
        if self._ready:
            step = self._ready.popleft()
            if step.generation != self._generation:
                step.prefetched = None  # fetched before a rollback: the forward fetches its rows again
        else:
            with self._lock:
                step = StepContext(self._allocated, self._generation)
                self._allocated += 1
            self.scheduler.window.wait_for_lookup(step.index, self.timeout_s)
            step.lag = self.scheduler.window.lag(step.index)
        step.batch = batch
        self._current = step
        self.scheduler.step_begun(step.index)

    def rows(self, planner: Planner, features: Any) -> ModuleRows:
        """The rows of ``features`` for the forward of ``planner``'s module (the :class:`RowSource` protocol)."""
        key = planner.key
        step = self._current
        if step is None:  # evaluation: nothing is admitted, nothing is pushed
            rows = BatchRows([planner.plan(features, self._dedup)])
            try:
                self._fetch(rows, train=False)
                with record_function(LOOKUP_WAIT):
                    rows.materialize(self.device, requires_grad=False, timeout_s=self.timeout_s)
            except Exception as error:  # the caller tells a shard's failure from a defect (``cause``)
                raise EmbeddingLookupError(error) from error
            return rows.take(key)
        if key not in self._located and step.batch is not None:
            # Where the input sits in the batch, unless the planner finds it itself: later batches are planned from there.
            path = None if planner.find(step.batch) is not None else find_path(step.batch, features)
            if path is not None:
                with self._lock:
                    self._paths[key] = path
            self._located.add(key)
        rows = step.prefetched
        if rows is not None and key in rows.plans:
            if not (self._is_planned_input(planner, step.batch, features) or rows.plans[key].matches(planner.sources(features))):
                self._prefetch_missed(key)
                rows = None
        else:
            rows = None
        requires_grad = torch.is_grad_enabled()
        try:
            if rows is None:
                rows = BatchRows([planner.plan(features, self._dedup)])
                self.scheduler.window.wait_for_lookup(step.index, self.timeout_s)
                step.lag = self.scheduler.window.lag(step.index)
                self._fetch(rows, train=True, step=step)
            with record_function(LOOKUP_WAIT):
                rows.materialize(self.device, requires_grad=requires_grad, timeout_s=self.timeout_s)
        except Exception as error:  # the handler tells a shard's failure from a defect
            if self._on_lookup_error is None or not self._on_lookup_error(step.index, error):
                raise
            # The step is lost (recovery undoes it): its forward and backward run on zeros, so that every rank
            # still takes part in the step's collectives and nothing waits.
            rows.stand_in(self.device, requires_grad=requires_grad)
        step.use(rows)
        return rows.take(key)

    def step_metrics(self) -> dict[str, float]:
        """Figures of the open step so far: lookup wait, rows fetched, unique ratio, wire bytes, staleness (earlier
        steps' updates unacknowledged when its lookup went out) and staleness_at_answer (... when it was answered)."""
        step = self._current
        if step is None or not step.used:
            return {}
        unique = sum(rows.layout.rows for rows in step.used)
        return {
            "lookup_wait_ms": sum(rows.wait_ms for rows in step.used),
            "rows_fetched": float(unique),
            "unique_ratio": unique / max(sum(rows.num_ids for rows in step.used), 1),
            "wire_bytes": float(sum(rows.wire_bytes(wire.WIRE_DTYPES[self.wire_dtype].itemsize) for rows in step.used)),
            "staleness": float(step.lag),
            "staleness_at_answer": float(step.lag_at_answer),
        }

    def finish_step(self, scale: Union[float, torch.Tensor]) -> None:
        """Pushes the open step's gradients (times ``scale``) without waiting, and closes the step.

        Every step the trainer opens is closed once, by whichever call comes first (after its backward, or
        when the next step opens or the pipeline drains), so each rank pushes (or merges) once per step, with
        or without a gradient, and the ranks' merges stay paired step by step.
        """
        step, self._current = self._current, None
        if step is not None:
            self.pusher.push(step.index, step.used, scale)

    def drain(self) -> None:
        """Closes the open step and waits until every pushed update is applied (before a checkpoint, evaluation or the end)."""
        self.finish_step(scale=1.0)
        self.wait_for_pushed()

    def wait_for_pushed(self) -> None:
        """Waits until every update pushed so far is answered; the open step stays open."""
        self.pusher.wait_for_pushed(self.timeout_s)

    def invalidate_prefetched(self) -> None:
        """Rows fetched so far (for the open step and every planned one) are stale: fetch them again."""
        with self._lock:
            self._generation += 1
        if self._current is not None:
            self._current.prefetched = None

    def lookup_failure(self, timeout_s: float) -> Optional[BaseException]:
        """Waits up to ``timeout_s`` for the open step's prefetched lookup; its error, if it failed (else None)."""
        step = self._current
        if step is None or step.prefetched is None:
            return None
        with record_function(LOOKUP_WAIT):
            return step.prefetched.lookup_error(timeout_s)

    def close(self) -> None:
        """Ends the pusher's and the rank merge's threads (after the steps submitted so far)."""
        self.pusher.close()
        if self.pusher.rank_merge is not None:
            self.pusher.rank_merge.close()

    # ---- internals -----------------------------------------------------------------------------------

    def _fetch(self, rows: BatchRows, train: bool, observe: bool = False, step: Optional[StepContext] = None) -> None:
        """Issues the lookup of ``rows`` (sharding their ids unless the plan did) and, on a GPU, starts what the
        forward reads on its way to the device; ``observe``: its latency feeds the scheduler's lookahead
        (prefetched lookups only: a forward's own lookup is not ahead of anything); ``step``: the training step
        whose lag at the answer is noted."""
        sharded = rows.sharded or self.client.shard(rows.keyed)
        rows.prepare(self.transfer, self._fused_lookup)
        issued = time.perf_counter()
        future = self.client.lookup_sharded_async(sharded, train=train, wire_dtype=self.wire_dtype)
        if observe:
            future.add_done_callback(lambda f: self.scheduler.observe("lookup", time.perf_counter() - issued))
        if step is not None:
            future = self.scheduler.window.lag_when_done(future, step.index, lambda lag: setattr(step, "lag_at_answer", lag))
        rows.attach(sharded, future, self.transfer)

    def _is_planned_input(self, planner: Planner, batch: Any, features: Any) -> bool:
        """Whether ``features`` is the very object at the place of ``batch`` that the step's plan was made from.

        The trainer runs the batch the prefetcher planned, moved to its device as a whole: the module's input is
        then the device copy of the planned one, and recognising it by identity costs no comparison of ids (on
        a GPU, a comparison would wait for the device).
        """
        if batch is None or not self.batches_arrive_unchanged:
            return False
        with self._lock:
            path = self._paths.get(planner.key)
        found = at_path(batch, path) if path is not None else planner.find(batch)
        return found is features

    def _prefetch_missed(self, key: str) -> None:
        self.prefetch_misses += 1
        if key in self._reported_misses:
            return
        self._reported_misses.add(key)
        log.warning(
            "The embedding module %r received other ids than the batch its rows were prefetched from (does the model "
            "change the ids before this module, e.g. hashing them modulo a table size? Do that in the data pipeline "
            "instead). Its rows are fetched again inside the forward, which waits for them every step, and the "
            "prefetched lookup admitted rows for nothing.", key,
        )
