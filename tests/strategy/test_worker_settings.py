"""The strategy's embedding workers: started with the rank (one by default), stopped with the strategy; a worker that
dies mid-run is started again and the run ends with the very weights of a run without the death, or, with no
restart allowed, the run stops with an error naming it instead of hanging."""
from __future__ import annotations

import os
import signal
from typing import Optional

import lightning as L
import pytest
import torch

from lightning_persia import SGD, PersiaStrategy
from lightning_persia.strategy.worker_settings import EmbeddingWorkerSettings
from toy import INIT, NUM_IDS, ToyRecommender, loader, make_batches


def _trainer(strategy: PersiaStrategy, steps: int, callbacks=()) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, strategy=strategy, callbacks=list(callbacks))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a child that exited but was not reaped yet is no longer running
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_rank_trains_through_its_worker_which_stops_with_the_strategy():
    strategy = PersiaStrategy(staleness=2, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT)
    try:
        _trainer(strategy, steps=6).fit(ToyRecommender(device="meta"), loader(make_batches(6)))
        pids = strategy.embedding_worker_pids
        assert len(pids) == 1 and pids[0] != os.getpid() and _alive(pids[0])
        assert strategy.pipeline is not None and strategy.pipeline.staleness == 2
    finally:
        strategy.close()
    assert strategy.embedding_worker_pids == [] and not _alive(pids[0])


def test_count_zero_keeps_the_work_in_the_trainers_process():
    strategy = PersiaStrategy(staleness=1, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT,
                              embedding_workers=EmbeddingWorkerSettings(count=0))
    try:
        _trainer(strategy, steps=3).fit(ToyRecommender(device="meta"), loader(make_batches(3)))
        assert strategy.embedding_worker_pids == []
    finally:
        strategy.close()


class _KillWorker(L.Callback):
    def __init__(self, strategy: PersiaStrategy, at: int) -> None:
        self.strategy, self.at, self.killed = strategy, at, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.at:
            self.killed = self.strategy.embedding_worker_pids[0]
            os.kill(self.killed, signal.SIGKILL)


def _trained(kill_at: Optional[int]) -> tuple[dict[str, torch.Tensor], int]:
    """The remote rows and dense weights after 12 steps at staleness 0, the worker killed after step ``kill_at``;
    and how many times a worker was started again."""
    torch.manual_seed(0)
    model = ToyRecommender(device="meta")
    strategy = PersiaStrategy(staleness=0, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, wire_dtype="fp32",
                              embedding_workers=EmbeddingWorkerSettings(restarts=1))
    callbacks = [_KillWorker(strategy, at=kill_at)] if kill_at is not None else []
    try:
        _trainer(strategy, steps=12, callbacks=callbacks).fit(model, loader(make_batches(12)))
        weights = {f"ebc.{t}": strategy.client.lookup({f"ebc.{t}": torch.arange(NUM_IDS)}, train=False, wire_dtype="fp32")[f"ebc.{t}"]
                   for t in ("t0", "t1")}
        weights.update({f"mlp.{k}": v.clone() for k, v in model.mlp.state_dict().items()})
        return weights, strategy.embedding_workers_restarted
    finally:
        strategy.close()


@pytest.mark.scenario  # half a minute of processes or more: CI's scenario step (`make scenarios`), not `make test`
@pytest.mark.timeout(300)
def test_a_worker_killed_mid_run_is_started_again_and_nothing_is_lost():
    expected, restarted = _trained(kill_at=None)
    assert restarted == 0
    for kill_at in (2, 7):  # right after a step's push, its update in flight: sent again, applied once
        got, restarted = _trained(kill_at=kill_at)
        assert restarted == 1
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"{name} differs after the worker was killed after step {kill_at}"


@pytest.mark.timeout(300)
def test_a_worker_killed_with_several_steps_in_flight_is_started_again_and_the_run_ends():
    """At staleness 3 the dead worker had lookups and updates of several steps unanswered: all are sent again."""
    strategy = PersiaStrategy(staleness=3, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT,
                              embedding_workers=EmbeddingWorkerSettings(restarts=1))
    kill = _KillWorker(strategy, at=4)
    try:
        _trainer(strategy, steps=14, callbacks=[kill]).fit(ToyRecommender(device="meta"), loader(make_batches(14)))
        assert strategy.embedding_workers_restarted == 1
        assert strategy.embedding_worker_pids[0] != kill.killed and _alive(strategy.embedding_worker_pids[0])
        strategy.pipeline.pusher.wait_for_pushed(30)  # every step's update acknowledged: none was lost in the death
    finally:
        strategy.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("staleness", [0, 3])
def test_a_worker_that_dies_without_restarts_stops_the_run_with_an_error_naming_it(staleness):
    strategy = PersiaStrategy(staleness=staleness, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT,
                              embedding_workers=EmbeddingWorkerSettings(restarts=0))
    kill = _KillWorker(strategy, at=3)
    try:
        with pytest.raises(RuntimeError, match=r"embedding worker 0 of rank 0 \(pid \d+\) exited with code -9") as raised:
            _trainer(strategy, steps=40, callbacks=[kill]).fit(ToyRecommender(device="meta"), loader(make_batches(40)))
        assert f"pid {kill.killed})" in str(raised.value)
    finally:
        strategy.close()


def test_bad_worker_settings_are_refused_with_their_name():
    with pytest.raises(ValueError, match="EmbeddingWorkerSettings: count must be >= 0, got -1"):
        EmbeddingWorkerSettings(count=-1)
    with pytest.raises(ValueError, match="start_timeout_s must be > 0"):
        EmbeddingWorkerSettings(start_timeout_s=0)
    with pytest.raises(ValueError, match="EmbeddingWorkerSettings: restarts must be >= 0, got -2"):
        EmbeddingWorkerSettings(restarts=-2)
    with pytest.raises(TypeError, match="embedding_workers must be a EmbeddingWorkerSettings or None, got int"):
        PersiaStrategy(embedding_workers=2)
