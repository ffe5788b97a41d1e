"""PersiaStrategy and faults of its parameter server (in-process Trainers, embedded shards):

- a shard SIGKILLed in the middle of training replays its write-ahead log when the launcher restarts it, and
  training goes on with no rollback: the final model equals uninterrupted training; with staleness, every row
  counts every update once;

The other tests run the shards with ``durability: none`` (what a shard whose log is lost falls back to):
- a shard SIGKILLed in the middle of training is restarted by the embedded launcher from the last checkpoint,
  and the trainer rolls dense and sparse state back to that checkpoint and goes on: the final model equals
  training, without the strategy, on exactly the batches that survived;
- the same without any checkpoint fails with a clear message, and stops the shards;
- a slow shard: the staleness bound holds, nothing deadlocks, and a timeout is reported with its cause;
- a checkpoint that would unpickle code is refused.
"""
from __future__ import annotations

import glob
import os
import pickle
import signal
import threading
import time

import lightning as L
import pytest
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia import SGD, Constant, PersiaStrategy, PSSettings
from lightning_persia.embedding.pipeline import EmbeddingLookupError
from lightning_persia.remote_ps.protocol import COMMIT_MARKER
from lightning_persia.strategy import local_cluster
from lightning_persia.strategy.recovery import PersiaRecoveryError, RecoveryConfig
from toy import INIT, NUM_IDS, ToyRecommender, loader, make_batches

FAST = RecoveryConfig(wait_for_shards_s=60, client_max_retries=2, client_backoff_s=0.05, client_max_backoff_s=0.2)


@pytest.fixture(autouse=True)
def shards_without_a_log(monkeypatch):
    """The rollback path: embedded shards with ``durability: none`` unless a test sets another level."""
    monkeypatch.setattr(local_cluster, "EMBEDDED_DURABILITY", "none")


def _trainer(strategy, steps: int, callbacks=(), checkpoint_dir=None, every: int = 5, **kwargs) -> L.Trainer:
    callbacks = list(callbacks)
    if checkpoint_dir is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=checkpoint_dir, every_n_train_steps=every, save_top_k=1, monitor="step", mode="max"))
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=checkpoint_dir is not None, callbacks=callbacks,
        strategy=strategy, **kwargs,
    )


class _KillShard(L.Callback):
    """SIGKILLs shard ``shard`` of the embedded cluster after training step ``after``."""

    def __init__(self, after: int, shard: int = 1) -> None:
        self.after, self.shard, self.pid = after, shard, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.after and self.pid is None:
            process = trainer.strategy._cluster.shards.processes[self.shard]
            self.pid = process.pid
            os.kill(process.pid, signal.SIGKILL)


def _exact_strategy() -> PersiaStrategy:
    """Synchronous, plain SGD, fp32 on the wire: a run that compares row for row with plain training."""
    return PersiaStrategy(staleness=0, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, wire_dtype="fp32",
                          ps=PSSettings(timeout_s=20), recovery=FAST)


def _pair() -> tuple[ToyRecommender, ToyRecommender]:
    torch.manual_seed(0)
    local = ToyRecommender()
    local.load_ps_initial_rows()
    remote = ToyRecommender(device="meta")
    remote.mlp.load_state_dict(local.mlp.state_dict())
    return local, remote


def test_a_killed_shard_replays_its_log_and_training_goes_on_with_no_rollback_and_no_lost_step(tmp_path, monkeypatch):
    monkeypatch.setattr(local_cluster, "EMBEDDED_DURABILITY", "log")
    steps = 24
    batches = make_batches(steps)
    local, remote = _pair()
    strategy = _exact_strategy()
    kill = _KillShard(after=12)
    try:
        _trainer(strategy, steps, [kill], checkpoint_dir=tmp_path / "ckpt").fit(remote, loader(batches))
        assert strategy._recovery.events == []
        kinds = [(e.shard, e.kind) for e in strategy._cluster.events]
        assert kinds == [(1, "exited"), (1, "restarted")], strategy._cluster.events
        replay = strategy.client.stats()[1]["server"]["wal"]["replay"]
        assert replay["replayed"] and replay["records"] > 0 and "step=10.ckpt.ps/" in replay["checkpoint"]
        _assert_equals_plain_training(strategy, remote, local, batches)  # every batch, none lost or applied twice
    finally:
        strategy.close()


class _CountingRecommender(ToyRecommender):
    """Its loss is the sum of the pooled rows: each step's gradient of a row is how often the batch holds its id,
    whatever the row's value. With SGD(lr=1) from rows of zeros, every row ends at minus its id's count over the
    batches trained, however stale each lookup was: a lost or doubled update shows as a wrong count."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.ebc(batch["sparse"]).values().sum()


def _id_counts(batches: list[dict]) -> dict[str, torch.Tensor]:
    counts = {name: torch.zeros(NUM_IDS) for name in ("ebc.t0", "ebc.t1")}
    for batch in batches:
        for feature, ids in batch["sparse"].to_dict().items():
            counts["ebc.t0" if feature == "f0" else "ebc.t1"] += torch.bincount(ids.values(), minlength=NUM_IDS).float()
    return counts


@pytest.mark.scenario  # half a minute of processes or more: CI's scenario step (`make scenarios`), not `make test`
def test_with_staleness_a_killed_shard_replays_its_log_and_no_update_in_flight_is_lost_or_applied_twice(tmp_path, monkeypatch):
    """τ = 4: up to four updates are in flight when a shard dies, and lookups of later steps wait for it too; each
    update is applied once (the rows count every id of every batch), with no rollback."""
    monkeypatch.setattr(local_cluster, "EMBEDDED_DURABILITY", "log")
    steps = 24
    batches = make_batches(steps)
    remote = _CountingRecommender(device="meta")
    strategy = PersiaStrategy(staleness=4, embedding_optimizer=SGD(lr=1.0), embedding_init=Constant(0.0), wire_dtype="fp32",
                              ps=PSSettings(timeout_s=20), recovery=FAST)
    kills = [_KillShard(after=7, shard=0), _KillShard(after=15, shard=1)]
    try:
        _trainer(strategy, steps, kills, checkpoint_dir=tmp_path / "ckpt").fit(remote, loader(batches))
        assert strategy._recovery.events == []
        kinds = sorted((e.shard, e.kind) for e in strategy._cluster.events)
        assert kinds == [(0, "exited"), (0, "restarted"), (1, "exited"), (1, "restarted")], strategy._cluster.events
        ids = torch.arange(NUM_IDS)
        tables = strategy.client.lookup({"ebc.t0": ids, "ebc.t1": ids}, train=False, wire_dtype="fp32")
        for name, counts in _id_counts(batches).items():
            assert counts.sum() > 0
            torch.testing.assert_close(tables[name], -counts[:, None].expand(-1, 4), rtol=0, atol=0)
    finally:
        strategy.close()


@pytest.mark.scenario  # half a minute of processes or more: CI's scenario step (`make scenarios`), not `make test`
def test_killed_shard_rolls_back_dense_and_sparse_together_and_training_goes_on(tmp_path):
    steps = 24
    batches = make_batches(steps)
    local, remote = _pair()
    strategy = _exact_strategy()
    kill = _KillShard(after=12)
    try:
        _trainer(strategy, steps, [kill], checkpoint_dir=tmp_path / "ckpt").fit(remote, loader(batches))
        (rollback,) = strategy._recovery.events
        assert rollback.checkpoint.endswith("step=10.ckpt") and rollback.where == "train"
        assert 12 <= rollback.step <= 13, rollback  # noticed at the next batch or the one after (its update failed)
        assert "shard 1" in rollback.reason
        kinds = [(e.shard, e.kind) for e in strategy._cluster.events]
        assert kinds == [(1, "exited"), (1, "restarted")], strategy._cluster.events
        assert f"pid {kill.pid} exited with status -9" in strategy._cluster.events[0].detail
        assert "step=10.ckpt.ps/" in strategy._cluster.events[1].detail  # restarted from the last checkpoint

        # The model equals plain training on the batches that survived: 0..9 (in the checkpoint), then the rest.
        _assert_equals_plain_training(strategy, remote, local, batches[:10] + batches[rollback.step:])
    finally:
        strategy.close()


def test_killed_shard_without_a_checkpoint_fails_clearly_and_stops_the_shards():
    _, remote = _pair()
    strategy = PersiaStrategy(ps=PSSettings(num_local_shards=1, timeout_s=20), staleness=1, embedding_optimizer=SGD(lr=0.1),
                              embedding_init=INIT, recovery=FAST)
    started = time.monotonic()
    shards = None

    class Grab(L.Callback):
        def on_train_start(self, trainer, module):
            nonlocal shards
            shards = trainer.strategy._cluster.shards

    with pytest.raises(PersiaRecoveryError, match=r"shard 0 .*no checkpoint of this run exists to roll back to.*ModelCheckpoint"):
        _trainer(strategy, 20, [Grab(), _KillShard(after=3, shard=0)]).fit(remote, loader(make_batches(20)))
    assert time.monotonic() - started < 60
    assert shards is not None and shards.alive() == [False]  # the embedded shards (the restarted one too) are stopped
    assert strategy.client is None and strategy._cluster is None


@pytest.mark.scenario  # half a minute of processes or more: CI's scenario step (`make scenarios`), not `make test`
def test_slow_shard_keeps_the_staleness_bound_and_a_timeout_names_its_cause(tmp_path):
    slow = tmp_path / "slow.yaml"
    slow.write_text("fault_delay_s: 0.05\n")
    lags: list[float] = []

    class Lag(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            lags.append(float(trainer.callback_metrics["persia/staleness"]))

    _, remote = _pair()
    strategy = PersiaStrategy(ps=PSSettings(num_local_shards=1, config=str(slow), timeout_s=20), staleness=2,
                              embedding_optimizer=SGD(lr=0.1), embedding_init=INIT)
    started = time.monotonic()
    try:
        _trainer(strategy, 12, [Lag()], log_every_n_steps=1).fit(remote, loader(make_batches(12)))
    finally:
        strategy.close()
    assert len(lags) == 12 and time.monotonic() - started < 60  # finished: no deadlock
    assert 1.0 <= max(lags) <= 2.0, lags  # lookups ran ahead of the slow shard's updates, never beyond the bound

    stuck = tmp_path / "stuck.yaml"
    stuck.write_text("fault_delay_s: 3.0\n")
    _, remote = _pair()
    strategy = PersiaStrategy(ps=PSSettings(num_local_shards=1, config=str(stuck), timeout_s=0.5), staleness=1,
                              embedding_optimizer=SGD(lr=0.1), embedding_init=INIT,
                              recovery=RecoveryConfig(client_max_retries=1, client_backoff_s=0.05, wait_for_shards_s=0.5))
    started = time.monotonic()
    with pytest.raises(PersiaRecoveryError, match=r"shard 0 at 127\.0\.0\.1:\d+ did not answer after 2 tries.*DEADLINE_EXCEEDED") as info:
        _trainer(strategy, 5).fit(remote, loader(make_batches(5)))
    assert time.monotonic() - started < 30, info.value
    assert strategy._cluster is None  # stopped on the way out


def test_checkpoint_that_would_unpickle_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = tmp_path / "evil.ckpt"
    with open(evil, "wb") as f:
        torch.save({"state_dict": {}, "payload": Payload()}, f)
    _, remote = _pair()
    strategy = PersiaStrategy(ps=PSSettings(num_local_shards=1), embedding_init=INIT)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        _trainer(strategy, 2).fit(remote, loader(make_batches(2)), ckpt_path=str(evil))
    assert not marker.exists()


def _kill(strategy, shard: int) -> int:
    process = strategy._cluster.shards.processes[shard]
    os.kill(process.pid, signal.SIGKILL)
    return process.pid


def _assert_equals_plain_training(strategy, remote, local, survivors) -> None:
    """The remote model equals plain training (no strategy) of ``local`` on ``survivors``."""
    L.Trainer(accelerator="cpu", devices=1, max_steps=len(survivors), logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(local, loader(survivors))
    ids = torch.arange(NUM_IDS)
    tables = strategy.client.lookup({"ebc.t0": ids, "ebc.t1": ids}, train=False, wire_dtype="fp32")
    for name in ("t0", "t1"):
        torch.testing.assert_close(tables[f"ebc.{name}"], local.ebc.embedding_bags[name].weight.detach(), rtol=0, atol=1e-5)
    for name, value in local.mlp.state_dict().items():
        torch.testing.assert_close(remote.mlp.state_dict()[name], value, rtol=0, atol=1e-5)


@pytest.mark.parametrize("when", [pytest.param("before the save", marks=pytest.mark.scenario), "while the shards write"])  # the first: CI's scenario step
def test_a_shard_killed_in_a_checkpoint_save_rolls_back_and_the_save_completes(tmp_path, when):
    """The Save RPC fails (the shard is down, then a new incarnation): every rank rolls back, the save starts
    again into a fresh folder, and the .ckpt names a complete, committed PS folder; ModelCheckpoint saw one save."""
    steps, every = 20, 5
    batches = make_batches(steps)
    local, remote = _pair()
    slow_saves = tmp_path / "ps.yaml"
    slow_saves.write_text("fault_save_delay_s: 0.2\n")
    strategy = PersiaStrategy(ps=PSSettings(num_local_shards=2, timeout_s=20, config=str(slow_saves)), staleness=0,
                              embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, wire_dtype="fp32", recovery=FAST)
    ckpt = tmp_path / "ckpt"

    class KillInSave(L.Callback):
        saves = 0

        def on_save_checkpoint(self, trainer, module, checkpoint):
            self.saves += 1
            if self.saves != 2:
                return
            if when == "before the save":
                # the last step's update answered first: the Save RPC, not that update, meets the dead shard
                trainer.strategy.pipeline.wait_for_pushed()
                _kill(trainer.strategy, 0)
                return
            writing = str(ckpt / "*.ps" / "*" / ".shard-*.tmp-*" / "*.npy")

            def kill_when_writing() -> None:
                deadline = time.monotonic() + 30
                while not glob.glob(writing) and time.monotonic() < deadline:
                    time.sleep(0.005)
                _kill(trainer.strategy, 0)

            threading.Thread(target=kill_when_writing, daemon=True).start()

    try:
        trainer = _trainer(strategy, steps, [KillInSave()], checkpoint_dir=ckpt, every=every)
        trainer.fit(remote, loader(batches))
        assert trainer.global_step == steps
        (rollback,) = strategy._recovery.events
        assert rollback.where == "checkpoint" and rollback.step == 10 and rollback.checkpoint.endswith("step=5.ckpt"), rollback
        assert "save of checkpoint epoch=0-step=10.ckpt failed" in rollback.reason and "shard 0" in rollback.reason, rollback
        # every .ckpt names one complete, committed folder: no trace of the failed save is left
        assert sorted(p.name for p in ckpt.glob("*.ckpt")) == ["epoch=0-step=20.ckpt"]
        folders = list((ckpt / "epoch=0-step=20.ckpt.ps").iterdir())
        entry = torch.load(ckpt / "epoch=0-step=20.ckpt", weights_only=True)["persia"]
        assert [ckpt / entry["ps_dir"]] == folders and (folders[0] / COMMIT_MARKER).is_file()
        assert sorted(p.name for p in folders[0].iterdir() if p.is_dir()) == ["shard-00000-of-00002", "shard-00001-of-00002"]
        # the checkpoint of step 10 holds the restored state of step 5: the batches in between are lost
        _assert_equals_plain_training(strategy, remote, local, batches[:5] + batches[10:])
    finally:
        strategy.close()


@pytest.mark.scenario  # half a minute of processes or more: CI's scenario step (`make scenarios`), not `make test`
def test_a_shard_killed_in_the_middle_of_a_forward_rolls_back_at_the_next_batch(tmp_path):
    """The forward's own lookup fails (the step's ids differ from its prefetched ones): the step runs on stand-in
    rows, and the next batch's check rolls every rank back, undoing it."""
    steps, kill_at = 16, 7
    batches = make_batches(steps)
    local, _ = _pair()

    class KilledInForward(ToyRecommender):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == kill_at:
                _kill(self.trainer.strategy, 1)
                sparse = batch["sparse"]  # other ids than those prefetched: the forward fetches its own rows
                batch = {**batch, "sparse": KeyedJaggedTensor.from_lengths_sync(
                    keys=sparse.keys(), values=NUM_IDS - 1 - sparse.values(), lengths=sparse.lengths())}
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    remote = KilledInForward(device="meta")
    remote.mlp.load_state_dict(local.mlp.state_dict())
    strategy = _exact_strategy()
    try:
        trainer = _trainer(strategy, steps, checkpoint_dir=tmp_path / "ckpt", every=5)
        trainer.fit(remote, loader(batches))
        assert trainer.global_step == steps
        (rollback,) = strategy._recovery.events
        assert rollback.where == "train" and rollback.step == kill_at + 1 and rollback.checkpoint.endswith("step=5.ckpt")
        assert f"lookup in the forward of step {kill_at} failed" in rollback.reason and "shard 1" in rollback.reason, rollback
        _assert_equals_plain_training(strategy, remote, local, batches[:5] + batches[kill_at + 1:])
    finally:
        strategy.close()


class _KilledInValidation(ToyRecommender):
    """Kills shard 0 before the forward of validation batch 1 of validation run ``kill_in_run`` (0: the sanity
    check); records which batches' forwards returned."""

    def __init__(self, kill_in_run: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kill_in_run, self.runs, self.forwards, self.killed = kill_in_run, -1, [], False

    def on_validation_start(self) -> None:
        self.runs += 1

    def validation_step(self, batch, batch_idx):
        if self.runs == self.kill_in_run and batch_idx == 1 and not self.killed:
            self.killed = True
            _kill(self.trainer.strategy, 0)
        loss = nn.functional.binary_cross_entropy_with_logits(self(batch), batch["labels"])
        self.forwards.append((self.runs, batch_idx))
        self.log("val_loss", loss, batch_size=batch["labels"].numel())


def test_a_shard_killed_during_validation_rolls_back_and_each_batch_is_evaluated_once(tmp_path):
    steps = 18
    batches = make_batches(steps)
    local, _ = _pair()
    torch.manual_seed(0)
    remote = _KilledInValidation(kill_in_run=2, device="meta")  # run 0: the sanity check; run 2: after step 12
    remote.mlp.load_state_dict(local.mlp.state_dict())
    strategy = _exact_strategy()
    try:
        trainer = _trainer(strategy, steps, checkpoint_dir=tmp_path / "ckpt", every=5, val_check_interval=6,
                           num_sanity_val_steps=1)
        trainer.fit(remote, loader(batches), loader(make_batches(3, seed=1)))
        assert trainer.global_step == steps
        (rollback,) = strategy._recovery.events
        assert rollback.where == "validation" and rollback.step == 12 and rollback.checkpoint.endswith("step=10.ckpt")
        assert "evaluation lookup failed" in rollback.reason and "shard 0" in rollback.reason, rollback
        assert remote.forwards == [(0, 0)] + [(run, b) for run in (1, 2, 3) for b in range(3)]  # each batch once
        _assert_equals_plain_training(strategy, remote, local, batches[:10] + batches[12:])
    finally:
        strategy.close()


@pytest.mark.scenario  # half a minute of processes or more: CI's scenario step (`make scenarios`), not `make test`
def test_a_shard_killed_in_the_sanity_check_before_any_checkpoint_fails_clearly():
    _, _ = _pair()
    torch.manual_seed(0)
    remote = _KilledInValidation(kill_in_run=0, device="meta")
    strategy = PersiaStrategy(staleness=0, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, recovery=FAST)
    with pytest.raises(PersiaRecoveryError, match=r"evaluation lookup failed.*shard 0.*no checkpoint of this run exists"):
        _trainer(strategy, 4, num_sanity_val_steps=2).fit(remote, loader(make_batches(4)), loader(make_batches(2, seed=1)))
    assert strategy._cluster is None  # stopped on the way out


def test_a_save_the_shards_refuse_fails_every_rank_naming_it_and_writes_no_checkpoint(tmp_path):
    """Not a shard's failure (a refused request: here a folder outside the shards' checkpoint_root): no rollback
    and no retry, the run stops naming it, and no .ckpt names a PS folder that was never written."""
    confined = tmp_path / "ps.yaml"
    confined.write_text(f"checkpoint_root: {tmp_path / 'elsewhere'}\n")
    _, remote = _pair()
    strategy = PersiaStrategy(ps=PSSettings(num_local_shards=1, config=str(confined)), staleness=0, embedding_optimizer=SGD(lr=0.1),
                              embedding_init=INIT, recovery=FAST)
    with pytest.raises(PersiaRecoveryError, match=r"could not save the checkpoint .*step=5\.ckpt: PSRequestError: .*PERMISSION_DENIED"):
        _trainer(strategy, 10, checkpoint_dir=tmp_path / "ckpt", every=5).fit(remote, loader(make_batches(10)))
    assert list((tmp_path / "ckpt").glob("*.ckpt")) == [] and strategy.rollbacks == []


class _Testable(ToyRecommender):
    def test_step(self, batch, batch_idx):
        self.log("test_loss", nn.functional.binary_cross_entropy_with_logits(self(batch), batch["labels"]), batch_size=1)


@pytest.mark.scenario  # half a minute of processes or more: CI's scenario step (`make scenarios`), not `make test`
def test_after_fit_test_from_the_checkpoint_accepts_a_restarted_shard_and_test_without_it_refuses_it(tmp_path):
    """Outside fit nothing rolls back: the restarted shard's rows are the checkpoint's, not the trained ones, so
    test refuses them; testing from the checkpoint loads it into every shard and accepts their incarnations."""
    torch.manual_seed(0)
    remote = _Testable(device="meta")
    strategy = PersiaStrategy(staleness=0, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, recovery=FAST)
    try:
        trainer = _trainer(strategy, 10, checkpoint_dir=tmp_path / "ckpt", every=5)
        trainer.fit(remote, loader(make_batches(10)))
        _kill(strategy, 0)
        (result,) = trainer.test(remote, loader(make_batches(2, seed=1)), ckpt_path="best", verbose=False)
        assert result["test_loss"] > 0
        _kill(strategy, 1)
        with pytest.raises(EmbeddingLookupError, match="ShardRestartedError: shard 1 .*ABORTED"):
            trainer.test(remote, loader(make_batches(2, seed=1)), verbose=False)
    finally:
        strategy.close()
