"""The correctness oracle: at staleness 0 the strategy trains exactly like the same model without it."""
from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_persia import SGD, PersiaStrategy
from toy import INIT, NUM_IDS, ToyRecommender, loader, make_batches

STEPS = 25


def _trainer(strategy=None, steps: int = STEPS, **kwargs) -> L.Trainer:
    extra = dict(strategy=strategy) if strategy is not None else {}
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **extra, **kwargs,
    )


def _pair(t1_rows: int = NUM_IDS) -> tuple[ToyRecommender, ToyRecommender]:
    torch.manual_seed(0)
    local = ToyRecommender(t1_rows=t1_rows)
    local.load_ps_initial_rows()
    remote = ToyRecommender(device="meta", t1_rows=t1_rows)
    remote.mlp.load_state_dict(local.mlp.state_dict())
    return local, remote


def _remote_rows(strategy: PersiaStrategy, table: str) -> torch.Tensor:
    return strategy.client.lookup({f"ebc.{table}": torch.arange(NUM_IDS)}, train=False, wire_dtype="fp32")[f"ebc.{table}"]


def test_staleness_zero_equals_training_without_the_strategy():
    batches = make_batches(STEPS)
    local, remote = _pair()
    _trainer().fit(local, loader(batches))
    strategy = PersiaStrategy(staleness=0, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, wire_dtype="fp32")
    try:
        _trainer(strategy).fit(remote, loader(batches))
        for table in ("t0", "t1"):
            torch.testing.assert_close(_remote_rows(strategy, table), local.ebc.embedding_bags[table].weight.detach(), rtol=0, atol=1e-5)
        for name, value in local.mlp.state_dict().items():
            torch.testing.assert_close(remote.mlp.state_dict()[name], value, rtol=0, atol=1e-5)
        assert not any(p.is_meta for p in remote.parameters()), "meta tables must not stay in the model"
    finally:
        strategy.close()


@pytest.mark.parametrize("staleness,t1_rows", [(0, 2 * NUM_IDS), (4, NUM_IDS)])
def test_data_parallel_tables_train_like_local_ones_at_any_staleness(staleness, t1_rows):
    """t0 (NUM_IDS rows) stays on the trainer; t1 is remote when larger. Kept tables are never stale."""
    batches = make_batches(STEPS)
    local, remote = _pair(t1_rows)
    _trainer().fit(local, loader(batches))
    strategy = PersiaStrategy(staleness=staleness, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, wire_dtype="fp32",
                              data_parallel_max_rows=NUM_IDS)
    try:
        trainer = _trainer(strategy)
        trainer.fit(remote, loader(batches))
        kept = remote.ebc.data_parallel
        assert [c.name for c in kept.configs] == (["ebc.t0"] if t1_rows > NUM_IDS else ["ebc.t0", "ebc.t1"])
        assert [t.name for t in remote.ebc.remote_tables] == (["ebc.t1"] if t1_rows > NUM_IDS else [])
        for position, config in enumerate(kept.configs):
            table = config.name.split(".")[1]
            torch.testing.assert_close(kept.table_view(position).detach(), local.ebc.embedding_bags[table].weight.detach(), rtol=0, atol=1e-5)
        if t1_rows > NUM_IDS:
            torch.testing.assert_close(_remote_rows(strategy, "t1"), local.ebc.embedding_bags["t1"].weight.detach()[:NUM_IDS], rtol=0, atol=1e-5)
        for name, value in local.mlp.state_dict().items():
            torch.testing.assert_close(remote.mlp.state_dict()[name], value, rtol=0, atol=1e-5)
        assert kept.weight.grad is None, "the user's optimizer must not step the kept tables a second time"
    finally:
        strategy.close()


def test_tables_leave_the_model_and_its_optimizer():
    _, remote = _pair()
    strategy = PersiaStrategy(staleness=2, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT)
    try:
        trainer = _trainer(strategy, steps=3)
        trainer.fit(remote, loader(make_batches(3)))
        names = [n for n, _ in remote.named_parameters()]
        assert names and all(n.startswith("mlp.") for n in names)
        optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        assert optimized == {id(p) for p in remote.parameters()}
        assert type(remote.ebc).__name__ == "RemoteEmbeddingBagCollection"
    finally:
        strategy.close()


@pytest.mark.parametrize("staleness", [4])
def test_hybrid_training_lowers_the_loss_and_logs_embedding_metrics(staleness):
    batches = make_batches(8, seed=1) * 10  # the same batches again and again: the loss must fall
    _, remote = _pair()
    strategy = PersiaStrategy(staleness=staleness, embedding_optimizer=SGD(lr=0.5), embedding_init=INIT)
    try:
        trainer = _trainer(strategy, steps=len(batches), log_every_n_steps=1)
        losses = []

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                losses.append(float(outputs["loss"]))

        trainer.callbacks.append(Record())
        trainer.fit(remote, loader(batches))
        assert sum(losses[-8:]) < sum(losses[:8]) * 0.9
        metrics = trainer.logged_metrics
        for key in ("persia/lookup_wait_ms", "persia/rows_fetched", "persia/unique_ratio", "persia/wire_bytes", "persia/staleness"):
            assert key in metrics, key
        assert 0 <= float(metrics["persia/staleness"]) <= staleness
        assert 0 < float(metrics["persia/unique_ratio"]) <= 1
    finally:
        strategy.close()


def test_evaluation_never_inserts_or_updates():
    _, remote = _pair()
    strategy = PersiaStrategy(staleness=0, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT)
    try:
        _trainer(strategy).validate(remote, loader(make_batches(3)))
        stats = strategy.client.stats()
        rows = sum(t["rows"] for s in stats for t in s["tables"].values())
        updates = sum(t["updates"] for s in stats for t in s["tables"].values())
        assert rows == 0 and updates == 0
    finally:
        strategy.close()


def test_mixed_precision_and_accumulation_push_unscaled_gradients():
    batches = make_batches(4)
    local, remote = _pair()
    _trainer(steps=2, accumulate_grad_batches=2).fit(local, loader(batches))
    strategy = PersiaStrategy(staleness=0, embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, wire_dtype="fp32")
    try:
        _trainer(strategy, steps=2, accumulate_grad_batches=2, precision="bf16-mixed").fit(remote, loader(batches))
        assert strategy.pipeline.dropped_nonfinite_rows == 0
        for table in ("t0", "t1"):
            torch.testing.assert_close(_remote_rows(strategy, table), local.ebc.embedding_bags[table].weight.detach(), rtol=0, atol=2e-3)
    finally:
        strategy.close()


def test_fp16_loss_scale_is_taken_out_of_embedding_gradients():
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = PersiaStrategy(average_embedding_gradients=True)
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    strategy.cluster_environment = LightningEnvironment()
    strategy.cluster_environment.set_world_size(2)  # gradients are averaged over the ranks too
    assert strategy._embedding_gradient_scale() == pytest.approx(1 / (2 * 1024.0))


@pytest.mark.parametrize(
    "kwargs,message",
    [({"staleness": -1}, "staleness must be >= 0"), ({"wire_dtype": "int8"}, "wire_dtype"),
     ({"data_parallel_max_rows": -1}, "data_parallel_max_rows must be >= 0")],
)
def test_bad_arguments_are_refused_with_their_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PersiaStrategy(**kwargs)
