"""Each remote twin gives what its local module gives for the same rows, and pushes the gradient the local one gets."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.embedding.pipeline import EmbeddingPipeline
from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.store.initializers import initial_rows
from lightning_persia.remote_ps.table_config import SGD, Uniform
from lightning_persia.embedding.batch_rows import RemoteTable
from lightning_persia.strategy.interception import TableDefaults, intercept

SEED = 5  # the seed of the session's ps_cluster
INIT = Uniform(-0.5, 0.5)
N = 30


class _Model(nn.Module):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"{prefix}a", embedding_dim=4, num_embeddings=N, feature_names=["x"]),
            EmbeddingBagConfig(name=f"{prefix}b", embedding_dim=8, num_embeddings=N, feature_names=["y", "z"]),
        ])
        self.ec = EmbeddingCollection(tables=[EmbeddingConfig(name=f"{prefix}c", embedding_dim=4, num_embeddings=N, feature_names=["x"])])
        self.bag = nn.EmbeddingBag(N, 4, mode="mean")
        self.emb = nn.Embedding(N, 4)


@pytest.fixture
def pair(ps_cluster, request):
    prefix = request.node.name[:20].replace("[", "_").replace("]", "_") + "_"
    local = _Model(prefix)
    remote = _Model(prefix)
    twins = intercept(remote, ["EmbeddingBagCollection", "EmbeddingCollection", "EmbeddingBag", "Embedding"], [], TableDefaults(optimizer=SGD(lr=1.0), init=INIT))
    client = PSClient(ps_cluster.addresses)
    client.configure([t.config for twin in twins for t in twin.remote_tables])
    pipeline = EmbeddingPipeline(client, staleness=0, wire_dtype="fp32", device=torch.device("cpu"))
    for twin in twins:
        pipeline.register(twin.planner)
        twin.row_source = pipeline
    with torch.no_grad():
        for twin in twins:
            for table in twin.remote_tables:
                module_path, _, table_name = table.name.rpartition(".")
                owner = local.get_submodule(module_path) if module_path in ("ebc", "ec") else local.get_submodule(table.name)
                weight = owner.embedding_bags[table_name].weight if module_path == "ebc" else owner.embeddings[table_name].weight if module_path == "ec" else owner.weight
                weight.copy_(initial_rows(INIT, SEED, table.name, torch.arange(N), weight.shape[1]))
    yield local, remote, pipeline
    client.close()


def _kjt(seed: int = 0) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * 5,), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(keys=["z", "x", "y"], values=torch.randint(0, N, (int(lengths.sum()),), generator=gen), lengths=lengths)


def _outputs(model: nn.Module, kjt: KeyedJaggedTensor, ids: torch.Tensor, offsets: torch.Tensor) -> list[torch.Tensor]:
    pooled = model.ebc(kjt)
    seq = model.ec(kjt)
    return [pooled.values(), torch.cat([pooled["x"], pooled["y"], pooled["z"]], 1), seq["x"].values(), seq["x"].lengths().float(), model.bag(ids, offsets), model.emb(ids.view(2, -1))]


def test_evaluation_outputs_equal_the_local_modules(pair):
    local, remote, _ = pair
    kjt, ids, offsets = _kjt(), torch.tensor([3, 7, 7, 1, 29, 0]), torch.tensor([0, 2])
    for mine, theirs in zip(_outputs(remote, kjt, ids, offsets), _outputs(local, kjt, ids, offsets)):
        torch.testing.assert_close(mine, theirs)


def test_training_pushes_the_gradient_the_local_module_gets(pair):
    local, remote, pipeline = pair
    kjt, ids, offsets = _kjt(1), torch.tensor([3, 7, 7, 1, 29, 0]), torch.tensor([0, 2])
    pipeline.begin_step()
    sum(o.square().sum() for o in _outputs(remote, kjt, ids, offsets)).backward()
    pipeline.finish_step(scale=1.0)
    pipeline.drain()
    sum(o.square().sum() for o in _outputs(local, kjt, ids, offsets)).backward()
    with torch.no_grad():
        for p in local.parameters():
            p -= p.grad  # SGD(lr=1.0), as on the shards
    for mine, theirs in zip(_outputs(remote, kjt, ids, offsets), _outputs(local, kjt, ids, offsets)):
        torch.testing.assert_close(mine, theirs)


def test_missing_features_name_the_module_and_the_feature(pair):
    _, remote, _ = pair
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["x"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(KeyError, match=r"'ebc'.*\['y', 'z'\]"):
        remote.ebc(kjt)


def test_intercept_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="padding_idx"):
        intercept(nn.Sequential(nn.Embedding(5, 2, padding_idx=0)), ["Embedding"], [], TableDefaults())
    with pytest.raises(ValueError, match="unknown module kinds"):
        intercept(nn.Sequential(), ["Linear"], [], TableDefaults())
    with pytest.raises(ValueError, match="table_overrides name tables the model does not have"):
        from lightning_persia.strategy.interception import TableOverride

        intercept(nn.Sequential(nn.Embedding(5, 2)), ["Embedding"], [], TableDefaults(overrides={"nope": TableOverride(capacity=3)}))


def test_exclude_keeps_a_module_local_and_overrides_apply():
    from lightning_persia.strategy.interception import TableOverride

    model = nn.ModuleDict({"keep": nn.Embedding(5, 2), "go": nn.Embedding(5, 2)})
    twins = intercept(model, ["Embedding"], ["keep"], TableDefaults(overrides={"go": TableOverride(capacity=7, optimizer=SGD(lr=3.0))}))
    assert isinstance(model["keep"], nn.Embedding) and [t.key for t in twins] == ["go"]
    config = twins[0].remote_tables[0].config
    assert config.capacity == 7 and config.optimizer == SGD(lr=3.0)


def test_torchrec_init_bounds_become_the_remote_initialiser():
    from lightning_persia.remote_ps.table_config import Constant

    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="zero", embedding_dim=1, num_embeddings=10, feature_names=["a"], weight_init_min=0.0, weight_init_max=0.0),
        EmbeddingBagConfig(name="bounded", embedding_dim=2, num_embeddings=10, feature_names=["b"], weight_init_min=-0.2, weight_init_max=0.3),
        EmbeddingBagConfig(name="default", embedding_dim=2, num_embeddings=100, feature_names=["c"]),
    ], device=torch.device("meta"))
    (twin,) = intercept(nn.ModuleDict({"ebc": ebc}), ["EmbeddingBagCollection"], [], TableDefaults())
    inits = [t.config.init for t in twin.remote_tables]
    assert inits == [Constant(0.0), Uniform(-0.2, 0.3), Uniform(-0.1, 0.1)]


def test_the_torchrec_twins_implement_the_torchrec_interfaces():
    """Code that asks a collection for its configs keeps working after the swap."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, EmbeddingCollectionInterface

    model = _Model("iface_")
    bag_configs, configs = model.ebc.embedding_bag_configs(), model.ec.embedding_configs()
    intercept(model, ["EmbeddingBagCollection", "EmbeddingCollection"], [], TableDefaults())
    assert isinstance(model.ebc, EmbeddingBagCollectionInterface) and isinstance(model.ec, EmbeddingCollectionInterface)
    assert model.ebc.embedding_bag_configs() == bag_configs and not model.ebc.is_weighted()
    assert model.ec.embedding_configs() == configs and model.ec.embedding_dim() == 4 and not model.ec.need_indices()
    assert model.ec.embedding_names_by_table() == [["x"]]


def test_a_subclass_of_a_registered_module_gets_its_twin_and_new_kinds_can_be_registered():
    from lightning_persia.embedding.modules import RemoteEmbedding
    from lightning_persia.strategy.interception import _TWINS, register_twin

    class MyEmbedding(nn.Embedding):
        pass

    class Hashed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dim = 3

    model = nn.ModuleDict({"mine": MyEmbedding(5, 2)})
    (twin,) = intercept(model, ["Embedding"], [], TableDefaults())
    assert isinstance(model["mine"], RemoteEmbedding) and twin.remote_tables[0].dim == 2

    @register_twin(Hashed, "Hashed")
    def _hashed(path, module, defaults, seed):
        return RemoteEmbedding(path, RemoteTable(path, defaults.config_for(path, path, module.dim, INIT)))

    try:
        model = nn.ModuleDict({"h": Hashed()})
        assert intercept(model, ["Embedding"], [], TableDefaults()) == []  # not a kind asked for
        (twin,) = intercept(model, ["Hashed"], [], TableDefaults())
        assert twin.remote_tables[0].dim == 3
    finally:
        del _TWINS[Hashed]


def test_a_twin_without_a_row_source_says_what_runs_it():
    model = nn.ModuleDict({"emb": nn.Embedding(5, 2)})
    intercept(model, ["Embedding"], [], TableDefaults())
    with pytest.raises(RuntimeError, match="'emb' has no row source; it runs under PersiaStrategy"):
        model["emb"](torch.tensor([1]))
