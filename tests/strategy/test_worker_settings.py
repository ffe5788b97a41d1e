"""The strategy's embedding workers: started with the rank (one by default), stopped with the strategy, and a worker
that dies mid-run stops the run with an error naming it instead of hanging."""
from __future__ import annotations

import os
import signal

import lightning as L
import pytest

from lightning_persia import SGD, PersiaStrategy
from lightning_persia.strategy.worker_settings import EmbeddingWorkerSettings
from toy import INIT, ToyRecommender, loader, make_batches


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


@pytest.mark.parametrize("staleness", [0, 3])
def test_a_worker_that_dies_stops_the_run_with_an_error_naming_it(staleness):
    strategy = PersiaStrategy(staleness=staleness, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT)
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
    with pytest.raises(TypeError, match="embedding_workers must be a EmbeddingWorkerSettings or None, got int"):
        PersiaStrategy(embedding_workers=2)
