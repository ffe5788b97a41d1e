"""With one process the strategy leaves the user's data as they made it: order, samplers, and a stateful loader's
state at a mid-epoch checkpoint (several processes: tests/strategy/test_processes.py)."""
from __future__ import annotations

from typing import Any, Iterator

import lightning as L
import pytest
import torch

from lightning_persia import SGD, PersiaStrategy
from lightning_persia.strategy.lightning_internals import keep_the_users_samplers
from toy import INIT, ToyRecommender, make_batches

BATCHES = 8


def _batches() -> list[dict]:
    batches = make_batches(BATCHES)
    for index, batch in enumerate(batches):
        batch["index"] = torch.tensor([index])
    return batches


class _Recorder(ToyRecommender):
    """Keeps the index of every batch each stage ran, and the training losses."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: dict[str, list[int]] = {"fit": [], "validate": [], "test": [], "predict": []}
        self.losses: list[float] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen["fit"].append(int(batch["index"]))
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.seen["validate"].append(int(batch["index"]))

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.seen["test"].append(int(batch["index"]))

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen["predict"].append(int(batch["index"]))
        return batch["index"]


class _StatefulBatches:
    """A loader that resumes where its state says (the protocol of torchdata's ``StatefulDataLoader``)."""

    def __init__(self, batches: list[dict]) -> None:
        self.batches, self.position = batches, 0

    def __iter__(self) -> Iterator[dict]:
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]
        self.position = 0

    def __len__(self) -> int:
        return len(self.batches)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def _trainer(strategy: PersiaStrategy | None, steps: int = BATCHES, **kwargs: Any) -> L.Trainer:
    """A trainer as a user writes it: no sampler setting."""
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **({"strategy": strategy} if strategy else {}), **kwargs)


def _strategy(staleness: int) -> PersiaStrategy:
    return PersiaStrategy(staleness=staleness, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, wire_dtype="fp32")


def _pair() -> tuple[_Recorder, _Recorder]:
    torch.manual_seed(0)
    local = _Recorder()
    local.load_ps_initial_rows()
    remote = _Recorder(device="meta")
    remote.mlp.load_state_dict(local.mlp.state_dict())
    return local, remote


def test_one_process_trains_a_plain_loader_in_its_order_and_exactly_like_lightning():
    local, remote = _pair()
    _trainer(None, enable_checkpointing=False).fit(local, torch.utils.data.DataLoader(_batches(), batch_size=None))
    strategy = _strategy(staleness=0)
    try:
        _trainer(strategy, enable_checkpointing=False).fit(remote, torch.utils.data.DataLoader(_batches(), batch_size=None))
    finally:
        strategy.close()
    assert remote.seen["fit"] == local.seen["fit"] == list(range(BATCHES))
    torch.testing.assert_close(torch.tensor(remote.losses), torch.tensor(local.losses), rtol=0, atol=1e-6)


def test_one_process_keeps_a_shuffling_loader_s_own_order_and_every_evaluation_order():
    def shuffled() -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(_batches(), batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(3))

    def evaluation() -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(_batches(), batch_size=None)

    local, remote = _pair()
    trainer = _trainer(None, enable_checkpointing=False, inference_mode=False)
    trainer.fit(local, shuffled(), evaluation())
    trainer.test(local, evaluation(), verbose=False)
    trainer.predict(local, evaluation())
    strategy = _strategy(staleness=4)
    try:
        trainer = _trainer(strategy, enable_checkpointing=False, inference_mode=False)
        trainer.fit(remote, shuffled(), evaluation())
        trainer.test(remote, evaluation(), verbose=False)
        trainer.predict(remote, evaluation())
    finally:
        strategy.close()
    assert sorted(local.seen["fit"]) == list(range(BATCHES)) and local.seen["fit"] != list(range(BATCHES))
    assert remote.seen == local.seen


@pytest.mark.parametrize("staleness", [0, pytest.param(4, marks=pytest.mark.scenario)])  # the second: CI's scenario step
def test_a_stateful_loader_checkpointed_mid_epoch_resumes_at_the_first_batch_not_trained(tmp_path, staleness):
    strategy = _strategy(staleness)
    checkpoints = tmp_path / "ckpt"
    try:
        saving = L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=3, save_top_k=-1)
        _trainer(strategy, steps=3, callbacks=[saving]).fit(_Recorder(device="meta"), _StatefulBatches(_batches()))
    finally:
        strategy.close()
    (checkpoint,) = checkpoints.glob("*.ckpt")
    resumed = _Recorder(device="meta")
    strategy = _strategy(staleness)
    try:
        _trainer(strategy, steps=6, enable_checkpointing=False).fit(resumed, _StatefulBatches(_batches()), ckpt_path=str(checkpoint))
    finally:
        strategy.close()
    assert resumed.seen["fit"] == [3, 4, 5], "the batches read ahead of the checkpoint's step must not be skipped"


def test_lightning_still_decides_the_sampler_by_the_flag_the_strategy_turns_off():
    # The strategy writes Lightning's private trainer._accelerator_connector.use_distributed_sampler (no public way
    # exists for a strategy); this fails when Lightning stops keeping the flag there or deciding by it.
    trainer = _trainer(_strategy(staleness=0))
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True)
    assert trainer._data_connector._requires_distributed_sampler(loader)
    keep_the_users_samplers(trainer)
    assert not trainer._data_connector._requires_distributed_sampler(loader)
