"""Automatic recovery of a PersiaStrategy run from a parameter-server shard that died (and came back).

What happens (the choice made for Lightning 2.6, kept simple):

1. **Noticing.** A call to a shard that is down or paused keeps retrying (UNAVAILABLE, DEADLINE_EXCEEDED) for
   ``wait_for_shards_s``, the time a restart (or a paused host) is given: a shard back within it costs a pause.
   A shard that restarted refuses every client that knew its previous *incarnation* (``ShardRestartedError``),
   so no lookup, update or save ever lands silently on a shard that lost rows. With recovery on, such a failure
   fails nothing at once; it is recorded where it happens:

   - a prefetched lookup or an update (between steps, in the staleness window): the next check sees it;
   - a lookup inside a training forward: the step runs on stand-in rows of zeros (every rank still takes part
     in its collectives) and the next check undoes it with the rest;
   - the shards' Save of a checkpoint: every rank hears of it; nothing of that save is kept (its folder is
     removed, no ``.ckpt`` is written) and the save starts again after the rollback, into a fresh folder;
   - a lookup inside an evaluation forward (validation, sanity check): the ranks agree after that batch.
2. **Agreeing.** At the start of every training batch (after the batch's prefetched lookups have answered),
   before validation, before and after the shards' Save of a checkpoint, after every evaluation batch and at
   the end of training, every rank reports whether it saw such a failure; the ranks agree with one all-reduce
   (nothing on one rank). So every rank rolls back at the same point, and none is left waiting in a collective.
3. **Rolling back in place** (inside the running ``fit``; no new process, no new process group):
   every rank drains its in-flight updates; rank 0 waits until every shard answers again (the embedded
   launcher restarts a dead shard on its port with ``--restore-from`` the latest checkpoint; in a cluster,
   whoever restarts it) and loads the last checkpoint's PS state into *all* shards; every rank accepts the
   shards' new incarnations, loads the same checkpoint's dense weights and optimizer state (``weights_only``)
   and drops the rows it had prefetched. Dense and sparse state are then those of one checkpoint. A shard that
   fails during the rollback is waited for like any other (its calls retry); one that restarts after the load
   comes back from the same checkpoint.
4. **Going on** with the current batch (the evaluation batch whose lookup failed runs again; a save writes
   the restored state). The batches trained between the checkpoint and the failure are not replayed (their
   effect is undone; the data loader and the step counter go on): the run loses at most one checkpoint
   interval of progress, never its consistency.

Without a checkpoint to return to, or after ``max_rollbacks`` rollbacks in one ``fit``, or when the shards do not
answer within ``wait_for_shards_s``, every rank raises :class:`PersiaRecoveryError` with the reason; the
strategy's ``on_exception`` then stops the embedded shards. Nothing waits forever.

Not recovered in place: a dead trainer rank (the job fails; resume with ``fit(ckpt_path=...)``); a failure in an
evaluation loop whose ranks do not run the same known number of batches (an iterable dataset of uneven
shards: agreeing batch by batch would pair one rank's batch with another's end of loop; that run fails with the
error). A validation run hit by a failure evaluates its batches after the rollback on the restored model.
Learning-rate schedulers and callbacks' states are not rolled back.
"""
from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch

from lightning_persia.embedding.pipeline import EmbeddingLookupError
from lightning_persia.remote_ps.client import PSClient, PSError, RetryPolicy, ShardRestartedError, ShardUnavailableError
from lightning_persia.remote_ps.remote_folder import is_remote
from lightning_persia.strategy import ps_checkpoint

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO

log = logging.getLogger(__name__)


class RecoveringStrategy(Protocol):
    """What recovery needs of its strategy (``PersiaStrategy``): Lightning's collectives and checkpoint loading, and
    the client of the shards. A protocol, so that the strategy imports recovery and not the other way round."""

    is_global_zero: bool
    world_size: int
    client: Optional[PSClient]
    lightning_module: "pl.LightningModule"
    checkpoint_io: "CheckpointIO"

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any: ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def load_model_state_dict(self, checkpoint: dict, strict: bool = True) -> None: ...

    def load_optimizer_state_dict(self, checkpoint: dict) -> None: ...


class PersiaRecoveryError(RuntimeError):
    """A parameter-server failure that could not be recovered from; the message says why and what to do."""


class RecoverableEmbeddings(Protocol):
    """What recovery needs of the rank's embedding pipeline (``embedding/pipeline.py``)."""

    @property
    def current_step(self) -> Optional[int]:
        """The open training step, if any."""

    def set_update_error_handler(self, handler: Callable[[int, BaseException], bool]) -> None:
        """``handler(step, error)`` hears of every failed update; True: handled, the staleness window goes on."""

    def set_lookup_error_handler(self, handler: Callable[[int, BaseException], bool]) -> None:
        """``handler(step, error)`` hears of a training forward's failed lookup; True: handled, the forward goes
        on with stand-in rows (the step is undone by the rollback that follows)."""

    def lookup_failure(self, timeout_s: float) -> Optional[BaseException]:
        """Waits up to ``timeout_s`` for the open step's prefetched lookup; its error, if it failed."""

    def wait_for_pushed(self) -> None:
        """Waits until every update pushed so far is answered; the open step stays open."""

    def invalidate_prefetched(self) -> None:
        """Rows fetched so far are stale: they are fetched again."""


class RestartableShards(Protocol):
    """What recovery needs of the embedded cluster (``strategy/local_cluster.py``)."""

    restore_from: Optional[str]

    @property
    def events(self) -> list:
        """What the launcher saw and did (shards that exited, restarts, give-ups)."""


@dataclass
class RecoveryConfig:
    """How PersiaStrategy reacts to a parameter-server shard that dies or restarts (see the module docstring).

    Example (YAML: ``trainer.strategy.init_args.recovery: {max_rollbacks: 5}``)::

        PersiaStrategy(recovery=RecoveryConfig(max_rollbacks=5, wait_for_shards_s=300))
    """

    enabled: bool = True
    """Roll back to the last checkpoint on a shard failure; ``False``: the first failure fails the run."""
    max_rollbacks: int = 3
    """Rollbacks allowed in one ``fit``; one more failure fails the run."""
    wait_for_shards_s: float = 120.0
    """How long a shard may take to come back (a restart from a checkpoint, a paused host): every call to the
    shards keeps retrying UNAVAILABLE / DEADLINE_EXCEEDED that long, and a rollback waits that long for every
    shard to answer again. Set it above the time the launcher (or whoever restarts shards) needs."""
    restart_local_shards: bool = True
    """Embedded mode: the launcher restarts a dead shard on its port, from the latest checkpoint."""
    max_local_restarts: int = 3
    """Embedded mode: restarts per shard before the launcher gives up on it."""
    client_max_retries: int = RetryPolicy.max_retries
    """Retries of a PS call that failed with UNAVAILABLE or DEADLINE_EXCEEDED (each with ``PSSettings.timeout_s``), at
    least; more until the call has lasted ``wait_for_shards_s``."""
    client_backoff_s: float = RetryPolicy.backoff_s
    """First back-off between retries (doubles each time, with jitter)."""
    client_max_backoff_s: float = RetryPolicy.max_backoff_s
    """Longest back-off between retries."""

    def __post_init__(self) -> None:
        if self.max_rollbacks < 0 or self.max_local_restarts < 0 or self.client_max_retries < 0:
            raise ValueError("RecoveryConfig: max_rollbacks, max_local_restarts and client_max_retries must be >= 0")
        if self.wait_for_shards_s <= 0 or self.client_backoff_s < 0 or self.client_max_backoff_s < 0:
            raise ValueError("RecoveryConfig: wait_for_shards_s must be > 0 and the back-offs >= 0")

    def retry_policy(self, timeout_s: float) -> RetryPolicy:
        """The retries of every parameter-server call, each attempt with the deadline ``timeout_s``."""
        return RetryPolicy(timeout_s=timeout_s, max_retries=self.client_max_retries, retry_for_s=self.wait_for_shards_s,
                           backoff_s=self.client_backoff_s, max_backoff_s=self.client_max_backoff_s)


@dataclass
class RollbackEvent:
    """One rollback: when, why, to which checkpoint, and how long it took."""

    step: int
    where: str
    reason: str
    checkpoint: str
    seconds: float
    at: float = field(default_factory=time.time)


class Recovery:
    """The recovery logic of one PersiaStrategy (hooks: ``attach``, ``check``, ``saved``, ``loaded``).

    It works through the strategy's public API (collectives, checkpoint IO, state loading) and the two narrow
    interfaces it is attached to: :class:`RecoverableEmbeddings` and, in embedded mode, :class:`RestartableShards`.
    """

    def __init__(self, strategy: RecoveringStrategy, config: RecoveryConfig) -> None:
        self.strategy = strategy
        self.config = config
        self.events: list[RollbackEvent] = []
        self.last_checkpoint: Optional[str] = None
        self._failure: Optional[str] = None
        self._client: Any = None
        self._embeddings: Optional[RecoverableEmbeddings] = None
        self._shards: Optional[RestartableShards] = None
        self._evaluation_agrees = True  # whether evaluation batches are paired across ranks (see begin_evaluation)

    # ---- hooks called by the strategy ----------------------------------------------------------------

    def attach(self, client: Any, embeddings: Optional[RecoverableEmbeddings], shards: Optional[RestartableShards]) -> None:
        """Makes failed updates wait for the next check (``client`` retries under :meth:`RecoveryConfig.retry_policy`)."""
        self._client, self._embeddings, self._shards = client, embeddings, shards
        if embeddings is not None and self.config.enabled:
            embeddings.set_update_error_handler(self._on_update_error)
            embeddings.set_lookup_error_handler(self._on_lookup_error)

    def saved(self, filepath: Any, ps_dir: Optional[str], commit: bool = True) -> None:
        """A checkpoint (dense file + PS folder) is complete: the target of the next rollback.

        Rank 0 marks the PS folder committed (a shard started with ``--restore-from`` on a folder of checkpoints
        then prefers it to a PS folder whose ``.ckpt`` was never written)."""
        self.last_checkpoint = str(filepath)
        if commit and ps_dir is not None and self.strategy.is_global_zero:
            ps_checkpoint.mark_committed(ps_dir, Path(str(filepath)).name)
        if self._shards is not None and ps_dir is not None and not is_remote(ps_dir):  # a shard restores from a path
            self._shards.restore_from = ps_dir

    def loaded(self, filepath: Any, ps_dir: Optional[str]) -> None:
        """The run resumed from a checkpoint: it is the rollback target until a newer one is saved."""
        self.saved(filepath, ps_dir, commit=False)

    def failed(self, reason: str) -> None:
        """Records a shard failure seen outside the embedding pipeline (a checkpoint's Save): the next
        :meth:`check` rolls back."""
        if self._failure is None:
            self._failure = reason

    def begin_evaluation(self, batches: Optional[int]) -> None:
        """Collective, before an evaluation loop: ``batches``, this rank's count (None: unknown). Evaluation
        failures are recovered in place only when every rank runs the same known number of batches (Lightning's
        DistributedSampler pads to it): the ranks then agree after every batch. Otherwise a failure fails the run."""
        if self.strategy.world_size == 1:
            self._evaluation_agrees = True
            return
        count = -1.0 if batches is None else float(batches)
        spread = self.strategy.reduce(torch.tensor([count, -count]), reduce_op="max")
        self._evaluation_agrees = count >= 0 and float(spread[0]) == -float(spread[1])

    def evaluate(self, forward: Callable[[], Any], where: str = "validation") -> Any:
        """Runs an evaluation step's ``forward``; if a lookup of any rank failed on a shard, every rank rolls back
        and the ranks whose lookup failed run their forward again (on the restored state).

        The forward raised before it returned anything, so a step's metrics are counted once. Collective when
        ``world_size > 1`` (one all-reduce per evaluation batch, see :meth:`begin_evaluation`), like the check of
        every training batch.
        """
        recover = self.config.enabled and self._evaluation_agrees
        while True:
            failure = None
            try:
                output = forward()
            except EmbeddingLookupError as error:
                if not recover or not is_shard_failure(error.cause):
                    raise
                failure = f"an evaluation lookup failed: {error.cause}"
            if not recover or not self._any_rank(failure is not None):
                return output
            self._rollback(failure or "another rank saw a parameter-server failure", where, None)
            if failure is None:
                return output

    def check(self, where: str, checkpoint: Optional[dict] = None) -> bool:
        """Collective: rolls every rank back if any saw a shard failure. Returns whether it rolled back.

        ``where``: ``"train"`` (start of a batch: also waits for its prefetched lookups), ``"validation"`` or
        ``"checkpoint"`` (then ``checkpoint``, the dict about to be written, is refilled after a rollback).
        """
        if not self.config.enabled or self._embeddings is None or self.strategy.client is None:
            return False
        local = self._failure or (self._lookup_failure(self._embeddings) if where == "train" else None)
        if not self._any_rank(local is not None):
            return False
        self._rollback(local or "another rank saw a parameter-server failure", where, checkpoint)
        return True

    # ---- internals -----------------------------------------------------------------------------------

    def _on_update_error(self, index: int, error: BaseException) -> bool:
        if isinstance(error, (PSError, CancelledError)):
            self.failed(f"the embedding update of step {index} failed: {error}")
            return True  # acknowledged; the next check rolls back
        return False

    def _on_lookup_error(self, index: int, error: BaseException) -> bool:
        if is_shard_failure(error):
            self.failed(f"the embedding lookup in the forward of step {index} failed: {error}")
            return True  # the step runs on stand-in rows; the next check rolls back and undoes it
        return False

    def _lookup_failure(self, embeddings: RecoverableEmbeddings) -> Optional[str]:
        step = embeddings.current_step
        # long enough for the client's own retries to end, so that their error (naming the shard) is the reason
        error = embeddings.lookup_failure(self._client.call_budget_s + 1.0)
        if isinstance(error, TimeoutError):
            return f"the embedding lookup of step {step}: {error}"
        if isinstance(error, CancelledError):
            return f"the embedding lookup of step {step} was cancelled"
        if isinstance(error, PSError):
            return f"the embedding lookup of step {step} failed: {error}"
        return None

    def _any_rank(self, flag: bool) -> bool:
        """Whether any rank says ``flag`` (one rank has nothing to agree on: no collective on every step)."""
        return flag if self.strategy.world_size == 1 else self.strategy.reduce_boolean_decision(flag, all=False)

    def _all_ok(self, error: Optional[str], stage: str) -> None:
        """Raises the same PersiaRecoveryError on every rank if any rank failed ``stage``."""
        if self._any_rank(error is not None):
            raise PersiaRecoveryError(
                f"PersiaStrategy could not roll back to the last checkpoint ({stage}): "
                f"{error or 'another rank failed this stage; see its log'}"
            )

    def _rollback(self, reason: str, where: str, checkpoint: Optional[dict]) -> None:
        # Evaluation runs under inference mode: the restored optimizer state must not become inference tensors,
        # which the next training step could not update.
        with torch.inference_mode(False):
            self._restore(reason, where, checkpoint)

    def _restore(self, reason: str, where: str, checkpoint: Optional[dict]) -> None:
        strategy = self.strategy
        trainer = strategy.lightning_module.trainer
        step = trainer.global_step
        started = time.monotonic()
        if len(self.events) >= self.config.max_rollbacks:
            raise PersiaRecoveryError(
                f"a parameter-server shard failed again at step {step} ({reason}) after {len(self.events)} rollbacks "
                f"(RecoveryConfig.max_rollbacks={self.config.max_rollbacks}); giving up"
            )
        target = self.last_checkpoint
        if target is None:
            raise PersiaRecoveryError(
                f"a parameter-server shard failed at step {step} ({reason}) and no checkpoint of this run exists to "
                "roll back to: the embedding rows written since the start may be lost. Save checkpoints during "
                "training (e.g. ModelCheckpoint(every_n_train_steps=...)) so that PersiaStrategy can recover, or "
                "restart the run"
            )
        log.warning("PersiaStrategy: %s at step %d (%s); rolling back to %s", reason, step, where, target)
        embeddings = self._embeddings
        client = strategy.client
        assert embeddings is not None and client is not None

        # 1. every update this rank pushed is answered (applied or failed), so none lands after the load
        error = None
        try:
            embeddings.wait_for_pushed()  # not drain(): the open step (this batch) must stay open
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            error = f"in-flight embedding updates did not finish: {err}"
        self._all_ok(error, "draining updates")

        # 2. rank 0: every shard answers again; all of them get the checkpoint's rows
        entry = None
        try:
            dense = strategy.checkpoint_io.load_checkpoint(target, weights_only=True)
            entry = dense.get("persia")
        except Exception as err:  # noqa: BLE001
            dense, error = None, f"cannot read {target}: {type(err).__name__}: {err}"
        self._all_ok(error, "reading the checkpoint")
        ps_dir = ps_checkpoint.folder_named_by(target, entry["ps_dir"]) if entry else None
        status = "ok"
        if strategy.is_global_zero:
            try:
                client.wait_healthy(self.config.wait_for_shards_s)
                if ps_dir is not None:
                    client.load(ps_dir)
            except Exception as err:  # noqa: BLE001
                status = (f"the shards did not come back within {self.config.wait_for_shards_s:.0f} s or refused the "
                          f"checkpoint {ps_dir}: {type(err).__name__}: {err}{self._cluster_events()}")
        status = strategy.broadcast(status)
        self._all_ok(None if status == "ok" else status, "restoring the shards")

        # 3. every rank: the shards' new incarnations, the dense state of the same checkpoint, no stale rows.
        # A shard that restarts after the load comes back from the same checkpoint (the launcher's restore_from).
        error = None
        try:
            client.refresh_incarnations()
            strategy.load_model_state_dict(dense, strict=True)
            strategy.load_optimizer_state_dict(dense)
            embeddings.invalidate_prefetched()
        except Exception as err:  # noqa: BLE001
            error = f"{type(err).__name__}: {err}"
        self._all_ok(error, "restoring the dense state")
        self._failure = None

        if checkpoint is not None:  # the dict about to be written was dumped before the rollback
            fresh = trainer._checkpoint_connector.dump_checkpoint(weights_only="optimizer_states" not in checkpoint)
            checkpoint.clear()
            checkpoint.update(fresh)
        event = RollbackEvent(step=step, where=where, reason=reason, checkpoint=target, seconds=time.monotonic() - started)
        self.events.append(event)
        log.warning("PersiaStrategy: rolled back to %s in %.1f s (rollback %d of at most %d); training goes on",
                    target, event.seconds, len(self.events), self.config.max_rollbacks)

    def _cluster_events(self) -> str:
        events = self._shards.events if self._shards is not None else None
        if not events:
            return ""
        return "; embedded launcher: " + "; ".join(f"shard {e.shard} {e.kind}: {e.detail.splitlines()[0]}" for e in events[-4:])


def is_shard_failure(error: BaseException) -> bool:
    """Whether ``error`` is how a call fails when a shard is down, restarted or paused (the client's retries
    running out, a new incarnation, a wait that ran out, a call cancelled), as opposed to a refused request (a
    defect, a full disk: retrying after a rollback would not help)."""
    return isinstance(error, (ShardUnavailableError, ShardRestartedError, TimeoutError, CancelledError))


def new_save_id() -> str:
    """A fresh id for one checkpoint's PS folder (``<ckpt>.ps/<save_id>``)."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
