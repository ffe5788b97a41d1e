"""The example models train with plain Lightning, and build their tables for free on the meta device."""
from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Callback, Trainer, seed_everything
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from examples.adult_income.model import WideAndDeep
from examples.deepfm.model import DeepFM
from examples.dlrm.model import DLRM
from lightning_persia.data import AdultDataModule, CriteoBatch, SyntheticCriteoDataModule


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.fixture(scope="module")
def synthetic() -> SyntheticCriteoDataModule:
    return SyntheticCriteoDataModule(
        num_train_batches=8, num_val_batches=2, num_test_batches=2, batch_size=512, cardinality_scale=0.002, seed=1
    )


def _fit(model, dm, **trainer_kwargs):
    seed_everything(0)
    losses = _Losses()
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[losses],
        **trainer_kwargs,
    )
    trainer.fit(model, dm)
    return trainer, losses.losses


@pytest.mark.parametrize("model_class", [DLRM, DeepFM])
def test_criteo_models_train_and_loss_falls(synthetic, model_class):
    model = model_class(num_embeddings=synthetic.cardinalities, embedding_dim=8, lr=3e-3, embedding_lr=0.1)
    trainer, losses = _fit(model, synthetic, max_steps=24)
    assert len(losses) == 24
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05
    assert 0.5 < float(trainer.callback_metrics["val_auc"]) <= 1.0
    result = trainer.test(model, synthetic, verbose=False)[0]
    assert 0.5 < result["test_auc"] <= 1.0


def test_local_tables_are_updated(synthetic):
    model = DeepFM(num_embeddings=synthetic.cardinalities, embedding_dim=4)
    before = model.first_order.embedding_bags["first_order_cat_5"].weight.detach().clone()
    assert not before.any()  # first-order weights start at zero
    _fit(model, synthetic, max_steps=3)
    assert model.first_order.embedding_bags["first_order_cat_5"].weight.detach().any()


def test_wide_and_deep_trains_on_adult():
    dm = AdultDataModule(batch_size=512)
    trainer, losses = _fit(WideAndDeep(), dm, max_epochs=1, limit_train_batches=30, limit_val_batches=2)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05
    assert float(trainer.callback_metrics["val_auc"]) > 0.7


@pytest.mark.parametrize(
    "build",
    [
        lambda: DLRM(embedding_device="meta", num_embeddings=[10**12] * 26),
        lambda: DeepFM(embedding_device="meta", num_embeddings=[10**12] * 26),
        lambda: WideAndDeep(embedding_device="meta", num_embeddings=[10**12] * 8),
    ],
)
def test_meta_tables_cost_nothing(build):
    model = build()  # 10**12 rows per table: only possible because nothing is allocated
    ebcs = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
    assert ebcs
    for ebc in ebcs:
        assert all(p.device.type == "meta" for p in ebc.parameters())
        assert all(c.num_embeddings == 10**12 for c in ebc.embedding_bag_configs())
    table_params = {id(p) for ebc in ebcs for p in ebc.parameters()}
    assert all(p.device.type == "cpu" for p in model.parameters() if id(p) not in table_params)
    # without a strategy to replace the tables, training refuses clearly
    with pytest.raises(RuntimeError, match="meta"):
        model.configure_optimizers()


def test_tables_are_declared_one_per_feature_with_unique_names():
    model = DeepFM(embedding_device="meta")
    configs = model.ebc.embedding_bag_configs()
    assert [c.feature_names for c in configs] == [[f"cat_{i}"] for i in range(26)]
    first = model.first_order.embedding_bag_configs()
    assert {c.embedding_dim for c in first} == {1}
    assert len({c.name for c in configs} | {c.name for c in first}) == 52
    wd = WideAndDeep(embedding_device="meta")
    names = [c.name for ebc in (wd.wide_sparse, wd.deep_embeddings) for c in ebc.embedding_bag_configs()]
    assert len(set(names)) == 16


def test_ids_are_reduced_modulo_table_sizes_whatever_the_key_order():
    model = WideAndDeep(num_embeddings=[5, 7, 11, 13, 17, 19, 23, 29], embedding_device="cpu")
    keys = list(reversed(model.sparse_feature_names))
    values = torch.arange(1_000_000, 1_000_016, dtype=torch.int64)
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=torch.tensor([2] * 8, dtype=torch.int32), stride=1)
    out = model.table_ids(kjt).to_dict()
    sizes = dict(zip(model.sparse_feature_names, [5, 7, 11, 13, 17, 19, 23, 29]))
    for key in keys:
        assert torch.equal(out[key].values(), kjt.to_dict()[key].values() % sizes[key])


def test_remote_tables_see_the_ids_unchanged():
    model = WideAndDeep(num_embeddings=[5, 7, 11, 13, 17, 19, 23, 29], embedding_device="meta")
    kjt = KeyedJaggedTensor(keys=model.sparse_feature_names, values=torch.arange(1_000_000, 1_000_008), lengths=torch.ones(8, dtype=torch.int32), stride=1)
    assert model.table_ids(kjt) is kjt


def test_batch_moves_with_lightning(synthetic):
    batch = synthetic.generator.batch("val", 0, 16)
    moved = move_data_to_device(batch, torch.device("cpu"))
    assert isinstance(moved, CriteoBatch)
    assert isinstance(moved.sparse_features, KeyedJaggedTensor) and moved.labels.shape == (16,)
