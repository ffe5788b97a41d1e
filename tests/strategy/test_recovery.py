"""PersiaStrategy and faults of its parameter server (in-process Trainers, embedded shards):

- a shard SIGKILLed in the middle of training is restarted by the embedded launcher from the last checkpoint,
  and the trainer rolls dense and sparse state back to that checkpoint and goes on: the final model equals
  training, without the strategy, on exactly the batches that survived;
- the same without any checkpoint fails with a clear message, and stops the shards;
- a slow shard: the staleness bound holds, nothing deadlocks, and a timeout is reported with its cause;
- a checkpoint that would unpickle code is refused.
"""
from __future__ import annotations

import os
import pickle
import signal
import time

import lightning as L
import pytest
import torch

from lightning_persia import SGD, PersiaStrategy
from lightning_persia.strategy.recovery import PersiaRecoveryError, RecoveryConfig
from toy import INIT, NUM_IDS, ToyRecommender, loader, make_batches

FAST = RecoveryConfig(wait_for_shards_s=60, client_max_retries=2, client_backoff_s=0.05, client_max_backoff_s=0.2)


def _trainer(strategy, steps: int, callbacks=(), checkpoint_dir=None, every: int = 5, **kwargs) -> L.Trainer:
    callbacks = list(callbacks)
    if checkpoint_dir is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=checkpoint_dir, every_n_train_steps=every, save_top_k=1, monitor="step", mode="max"))
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=checkpoint_dir is not None, callbacks=callbacks,
        strategy=strategy, use_distributed_sampler=False, **kwargs,
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


def _pair() -> tuple[ToyRecommender, ToyRecommender]:
    torch.manual_seed(0)
    local = ToyRecommender()
    local.load_ps_initial_rows()
    remote = ToyRecommender(device="meta")
    remote.mlp.load_state_dict(local.mlp.state_dict())
    return local, remote


def test_killed_shard_rolls_back_dense_and_sparse_together_and_training_goes_on(tmp_path):
    steps = 24
    batches = make_batches(steps)
    local, remote = _pair()
    strategy = PersiaStrategy(staleness=0, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, wire_dtype="fp32",
                              ps_timeout_s=20, recovery=FAST)
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
        survivors = batches[:10] + batches[rollback.step:]
        L.Trainer(accelerator="cpu", devices=1, max_steps=len(survivors), logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False).fit(local, loader(survivors))
        ids = torch.arange(NUM_IDS)
        tables = strategy.client.lookup({"ebc.t0": ids, "ebc.t1": ids}, train=False, wire_dtype="fp32")
        for name in ("t0", "t1"):
            torch.testing.assert_close(tables[f"ebc.{name}"], local.ebc.embedding_bags[name].weight.detach(), rtol=0, atol=1e-5)
        for name, value in local.mlp.state_dict().items():
            torch.testing.assert_close(remote.mlp.state_dict()[name], value, rtol=0, atol=1e-5)
    finally:
        strategy.close()


def test_killed_shard_without_a_checkpoint_fails_clearly_and_stops_the_shards():
    _, remote = _pair()
    strategy = PersiaStrategy(num_local_shards=1, staleness=1, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT,
                              ps_timeout_s=20, recovery=FAST)
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


def test_slow_shard_keeps_the_staleness_bound_and_a_timeout_names_its_cause(tmp_path):
    slow = tmp_path / "slow.yaml"
    slow.write_text("fault_delay_s: 0.05\n")
    lags: list[float] = []

    class Lag(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            lags.append(float(trainer.callback_metrics["persia/staleness"]))

    _, remote = _pair()
    strategy = PersiaStrategy(num_local_shards=1, staleness=2, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT,
                              ps_config=str(slow), ps_timeout_s=20)
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
    strategy = PersiaStrategy(num_local_shards=1, staleness=1, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT,
                              ps_config=str(stuck), ps_timeout_s=0.5,
                              recovery=RecoveryConfig(client_max_retries=1, client_backoff_s=0.05))
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
    strategy = PersiaStrategy(num_local_shards=1, embedding_init=INIT)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        _trainer(strategy, 2).fit(remote, loader(make_batches(2)), ckpt_path=str(evil))
    assert not marker.exists()
