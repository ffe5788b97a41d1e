"""Each remote twin gives what its local module gives for the same rows, and pushes the gradient the local one gets."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.embedding.worker import EmbeddingWorker
from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.store.initializers import initial_rows
from lightning_persia.remote_ps.table_config import SGD, Uniform
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
    worker = EmbeddingWorker(client, staleness=0, wire_dtype="fp32", device=torch.device("cpu"))
    for twin in twins:
        worker.register(twin)
    with torch.no_grad():
        for twin in twins:
            for table in twin.remote_tables:
                module_path, _, table_name = table.name.rpartition(".")
                owner = local.get_submodule(module_path) if module_path in ("ebc", "ec") else local.get_submodule(table.name)
                weight = owner.embedding_bags[table_name].weight if module_path == "ebc" else owner.embeddings[table_name].weight if module_path == "ec" else owner.weight
                weight.copy_(initial_rows(INIT, SEED, table.name, torch.arange(N), weight.shape[1]))
    yield local, remote, worker
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
    local, remote, worker = pair
    kjt, ids, offsets = _kjt(), torch.tensor([3, 7, 7, 1, 29, 0]), torch.tensor([0, 2])
    for mine, theirs in zip(_outputs(remote, kjt, ids, offsets), _outputs(local, kjt, ids, offsets)):
        torch.testing.assert_close(mine, theirs)


def test_training_pushes_the_gradient_the_local_module_gets(pair):
    local, remote, worker = pair
    kjt, ids, offsets = _kjt(1), torch.tensor([3, 7, 7, 1, 29, 0]), torch.tensor([0, 2])
    worker.begin_step()
    sum(o.square().sum() for o in _outputs(remote, kjt, ids, offsets)).backward()
    worker.finish_step(scale=1.0)
    worker.drain()
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
