"""Tables kept on the trainer: same outputs as TorchRec's modules, the shards' rule, clear errors."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.embedding.data_parallel import DataParallelTables
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.table_config import SGD, Adagrad, Adam, TableConfig, Uniform
from lightning_persia.strategy.interception import TableDefaults, intercept

N = 30
INIT = Uniform(-0.5, 0.5)


def _collections() -> nn.Module:
    model = nn.Module()
    model.ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=N, feature_names=["x"]),
        EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=N, feature_names=["y", "z"]),
    ])
    model.ec = EmbeddingCollection(tables=[EmbeddingConfig(name="c", embedding_dim=4, num_embeddings=N, feature_names=["x"])])
    return model


def _kjt(seed: int = 0, high: int = N) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * 5,), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(keys=["z", "x", "y"], values=torch.randint(0, high, (int(lengths.sum()),), generator=gen), lengths=lengths)


def test_kept_tables_give_what_torchrec_gives_in_its_key_order():
    local, twin_model = _collections(), _collections()
    twins = intercept(twin_model, ["EmbeddingBagCollection", "EmbeddingCollection"], [], TableDefaults(init=INIT, data_parallel_max_rows=N), seed=3)
    assert all(not twin.remote_tables and twin.data_parallel is not None for twin in twins)
    with torch.no_grad():
        for name, table in (("a", 0), ("b", 1)):
            local.ebc.embedding_bags[name].weight.copy_(twin_model.ebc.data_parallel.table_view(table))
        local.ec.embeddings["c"].weight.copy_(twin_model.ec.data_parallel.table_view(0))
    kjt = _kjt()
    expected, got = local.ebc(kjt), twin_model.ebc(kjt)
    assert got.keys() == expected.keys() == ["x", "y", "z"]
    torch.testing.assert_close(got.values(), expected.values())
    expected_ec, got_ec = local.ec(kjt), twin_model.ec(kjt)
    assert list(got_ec) == list(expected_ec)
    torch.testing.assert_close(got_ec["x"].values(), expected_ec["x"].values())
    assert {"ebc.data_parallel.weight", "ebc.data_parallel.optimizer_state"} <= set(twin_model.state_dict())


def test_apply_gradients_runs_the_shards_rule_on_the_touched_rows():
    configs = [
        TableConfig("m.a", dim=4, init=INIT, optimizer=Adagrad(lr=0.1, rowwise=True)),
        TableConfig("m.b", dim=4, init=INIT, optimizer=Adagrad(lr=0.1, rowwise=True)),  # same block as m.a
        TableConfig("m.c", dim=8, init=INIT, optimizer=SGD(lr=0.5), weight_bound=0.3),
    ]
    kept = DataParallelTables(configs, [N, N, N], [("x",), ("y",), ("z",)], seed=7)
    store = ShardStore(0, 1, seed=7)
    for config in configs:
        store.configure(config)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        grad = torch.zeros_like(kept.weight)
        for table, config in enumerate(configs):
            touched = torch.randperm(N, generator=gen)[:7]
            grads = torch.randn(7, config.dim, generator=gen)
            start = kept.layout.table_offsets[table]
            grad[start : start + N * config.dim].view(N, config.dim)[touched] = grads
            store.lookup(config.name, touched, train=True)
            store.update(config.name, touched, grads * 2.0)
        kept.weight.grad = grad
        kept.apply_gradients(scale=2.0)
        assert kept.weight.grad is None
    for table, config in enumerate(configs):
        torch.testing.assert_close(kept.table_view(table).detach(), store.lookup(config.name, torch.arange(N), train=False))


def test_ids_outside_a_kept_table_are_folded_into_its_rows():
    local, twin_model = _collections(), _collections()
    intercept(twin_model, ["EmbeddingBagCollection"], [], TableDefaults(init=INIT, data_parallel_max_rows=N))
    with torch.no_grad():
        for name, table in (("a", 0), ("b", 1)):
            local.ebc.embedding_bags[name].weight.copy_(twin_model.ebc.data_parallel.table_view(table))
    wide = KeyedJaggedTensor.from_lengths_sync(keys=["x", "y", "z"], values=torch.tensor([1 + 7 * N, -1, (1 << 40) + 3]), lengths=torch.tensor([1, 1, 1]))
    folded = KeyedJaggedTensor.from_lengths_sync(keys=["x", "y", "z"], values=torch.tensor([1, N - 1, ((1 << 40) + 3) % N]), lengths=torch.tensor([1, 1, 1]))
    torch.testing.assert_close(twin_model.ebc(wide).values(), local.ebc(folded).values())


def test_non_finite_rows_are_dropped_and_the_state_stays_float32_in_a_bf16_model():
    configs = [TableConfig("m.a", dim=4, init=INIT, optimizer=Adagrad(lr=0.1, rowwise=True, initial_accumulator_value=0.1))]
    kept = DataParallelTables(configs, [N], [("x",)], seed=7).to(torch.bfloat16)
    assert kept.weight.dtype == torch.bfloat16 and kept.optimizer_state.dtype == torch.float32
    assert torch.equal(kept.optimizer_state, torch.full((N,), 0.1))
    before = kept.table_view(0).detach().clone()
    grad = torch.zeros(N, 4, dtype=torch.bfloat16)
    grad[3], grad[5, 1] = 1.0, float("inf")
    kept.weight.grad = grad.flatten()
    kept.apply_gradients(scale=1.0)
    after = kept.table_view(0).detach().clone()
    assert kept.dropped_nonfinite_rows == 1
    assert torch.equal(after[5], before[5]) and torch.isfinite(kept.optimizer_state).all()
    assert not torch.equal(after[3], before[3]) and kept.optimizer_state[3] == pytest.approx(1.1)
    finite = torch.zeros(N, 4, dtype=torch.bfloat16)
    finite[7] = 2.0
    kept.weight.grad = finite.flatten()
    kept.apply_gradients(scale=0.5)  # all finite: the whole block at once, through a float32 copy
    again = kept.table_view(0).detach()
    assert kept.optimizer_state[7] == pytest.approx(1.1) and not torch.equal(again[7], after[7])
    unchanged = torch.arange(N) != 7
    assert torch.equal(again[unchanged], after[unchanged]) and kept.optimizer_state[3] == pytest.approx(1.1)


@pytest.mark.parametrize("optimizer", [SGD(lr=0.3), Adagrad(lr=0.2, rowwise=True), Adagrad(lr=0.2), Adam(lr=0.1)], ids=["sgd", "rowwise-adagrad", "adagrad", "adam"])
def test_the_masked_update_of_a_gpu_gives_the_rows_of_the_touched_row_update(optimizer):
    """The GPU's form (every row computed, the touched finite ones kept: no count read back) against the CPU's."""
    configs = [TableConfig("ebc.a", dim=4, optimizer=optimizer, init=Uniform(-0.1, 0.1), weight_bound=0.5),
               TableConfig("ebc.b", dim=4, optimizer=optimizer, init=Uniform(-0.1, 0.1), weight_bound=0.5)]
    indexed, masked = (DataParallelTables(configs, [6, 5], [("f0",), ("f1",)], seed=3) for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        grad = torch.randn(indexed.weight.numel(), generator=gen).view(11, 4)
        grad[[1, 7]] = 0.0  # untouched rows
        if step == 1:
            grad[2, 1], grad[9, 0] = float("nan"), float("inf")  # an AMP overflow: dropped and counted
        for tables, is_masked in ((indexed, False), (masked, True)):
            tables.weight.grad = grad.flatten().clone()
            tables.apply_gradients(0.5, masked=is_masked)
    torch.testing.assert_close(masked.weight, indexed.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(masked.optimizer_state, indexed.optimizer_state, rtol=0, atol=1e-6)
    assert masked.dropped_nonfinite_rows == indexed.dropped_nonfinite_rows == 2
    assert masked.weight.grad is None


def test_raw_features_index_the_kept_rows_directly_and_an_id_outside_them_is_named():
    """ids: raw (vocabulary ids) read their own row; hashed ids are folded; a raw id past the table is an error."""
    model = nn.Module()
    model.ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=N, feature_names=["x"]),
        EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=N, feature_names=["y"]),
    ])
    intercept(model, ["EmbeddingBagCollection"], [], TableDefaults(init=INIT, data_parallel_max_rows=N, raw_features=("x",)), seed=3)
    kept = model.ebc.data_parallel
    assert kept.raw_features == ("x",)
    rows = kept.rows_of(torch.tensor([0, N - 1, 7, N + 5, -1]), [3, 2])
    assert rows.tolist() == [0, N - 1, 7, 5, N - 1]  # x's ids as they are, y's modulo 30
    for bad in (N, -4):
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["x", "y"], values=torch.tensor([3, bad, 1]), lengths=torch.tensor([2, 0, 1, 0]))
        with pytest.raises(ValueError, match=rf"feature 'x': id {bad} is outside its table of {N} rows kept on the trainers"):
            model.ebc(kjt)
