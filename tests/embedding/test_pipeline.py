"""The embedding pipeline in process (shard stores behind the client calls, no gRPC, no subprocess): prefetch,
one lookup and one update per step, the staleness bound, exact synchronous training, a prefetch the forward does
not use, an epoch cut short."""
from __future__ import annotations

import logging
import threading
import time

from typing import Iterable

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.embedding.pipeline import EmbeddingPipeline
from lightning_persia.embedding.planning import BatchPlanner
from lightning_persia.embedding.prefetch import PrefetchingLoader
from lightning_persia.remote_ps.store.initializers import initial_rows
from lightning_persia.remote_ps.table_config import SGD, Constant, Uniform
from lightning_persia.strategy.interception import MODULE_KINDS, TableDefaults, intercept
from lightning_persia.testing.in_process import InProcessShards

N = 20
SEED = 3
INIT = Uniform(-0.5, 0.5)


class _Model(nn.Module):
    """A collection with tables of width 4 and 8 (the second for two features), and a plain nn.Embedding of width 3."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=N, feature_names=["x"]),
            EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=N, feature_names=["y", "z"]),
        ], device=torch.device(device))
        self.emb = nn.Embedding(N, 3, device=device)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.ebc(batch["kjt"]).values().square().sum() + self.emb(batch["ids"]).square().sum()


def _batches(count: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(0, 4, (3 * 5,), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["x", "y", "z"], values=torch.randint(0, N, (int(lengths.sum()),), generator=gen), lengths=lengths)
        out.append({"kjt": kjt, "ids": torch.randint(0, N, (4, 2), generator=gen)})
    return out


def _remote(shards: InProcessShards, staleness: int, defaults: TableDefaults, model: nn.Module = None) -> tuple[nn.Module, EmbeddingPipeline]:
    model = model if model is not None else _Model("meta")
    twins = intercept(model, MODULE_KINDS, [], defaults, seed=SEED)
    shards.configure([t.config for twin in twins for t in twin.remote_tables])
    pipeline = EmbeddingPipeline(shards, staleness=staleness, wire_dtype="fp32", device=torch.device("cpu"), timeout_s=30)
    for twin in twins:
        pipeline.register(twin.planner)
        twin.row_source = pipeline
    return model, pipeline


def _train(model: nn.Module, pipeline: EmbeddingPipeline, batches: Iterable) -> PrefetchingLoader:
    loader = PrefetchingLoader(batches, pipeline)
    for batch in loader:
        pipeline.begin_step(batch)
        model(batch).backward()
        pipeline.finish_step(scale=1.0)
    pipeline.drain()
    loader.close()
    return loader


@pytest.fixture
def shards():
    shards = InProcessShards(num_shards=2, seed=SEED)
    yield shards
    shards.close()


def _assert_trained_like_local(shards: InProcessShards, batches: list[dict]) -> None:
    """The shards' rows equal the local modules' after SGD(lr=0.1) on ``batches``, from the same initial rows."""
    local = _Model()
    with torch.no_grad():
        for name, weight in (("ebc.a", local.ebc.embedding_bags["a"].weight), ("ebc.b", local.ebc.embedding_bags["b"].weight), ("emb", local.emb.weight)):
            weight.copy_(initial_rows(INIT, SEED, name, torch.arange(N), weight.shape[1]))
    for batch in batches:
        local.zero_grad()
        local(batch).backward()
        with torch.no_grad():
            for p in local.parameters():
                p -= 0.1 * p.grad
    for name, weight in (("ebc.a", local.ebc.embedding_bags["a"].weight), ("ebc.b", local.ebc.embedding_bags["b"].weight), ("emb", local.emb.weight)):
        torch.testing.assert_close(shards.rows(name, torch.arange(N)), weight.detach(), rtol=0, atol=1e-5)


def test_staleness_zero_trains_exactly_like_the_local_modules(shards):
    """Tables of different widths and two modules in one lookup and one update per step, at staleness 0."""
    batches = _batches(6)
    model, pipeline = _remote(shards, 0, TableDefaults(optimizer=SGD(lr=0.1), init=INIT))
    _train(model, pipeline, batches)
    _assert_trained_like_local(shards, batches)
    assert pipeline.prefetch_misses == 0


def test_a_dataloader_with_workers_plans_the_lookups_in_them(shards, monkeypatch):
    """The worker processes plan (dedup, sharding): nothing is planned in this process but the nn.Embedding's
    lookup, whose input the workers, started before the first step, could not place."""
    batches = _batches(6)
    model, pipeline = _remote(shards, 0, TableDefaults(optimizer=SGD(lr=0.1), init=INIT))
    planned_here = []
    plan = BatchPlanner.plan
    monkeypatch.setattr(BatchPlanner, "plan", lambda self, batch: planned_here.append(batch) or plan(self, batch))
    loader = DataLoader(batches, batch_size=None, num_workers=1)
    collate = loader.collate_fn
    _train(model, pipeline, loader)
    assert planned_here == [] and pipeline.prefetch_misses == 0
    assert loader.collate_fn is collate  # the loader's own again after the epoch
    _assert_trained_like_local(shards, batches)


def test_one_lookup_and_one_update_per_step_for_every_module_plain_ones_included(shards):
    """After the first steps show where nn.Embedding's input sits in the batch, its rows are prefetched with the
    collection's, in the step's one lookup, from the prefetch thread."""
    batches = _batches(10)
    model, pipeline = _remote(shards, 2, TableDefaults(optimizer=SGD(lr=0.1), init=INIT))
    threads: list[str] = []
    lookup = shards.lookup_sharded_async

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return lookup(*args, **kwargs)

    shards.lookup_sharded_async = recorded
    _train(model, pipeline, batches)
    trained = [keyed for keyed, train in shards.lookups if train]
    assert len(shards.updates) == len(batches)
    prefetched = [keyed for keyed, thread in zip(trained, threads) if thread == "persia-prefetch"]
    assert sorted(prefetched[-1].tables) == ["ebc.a", "ebc.b", "emb"]
    # the batches planned before the first forward could not know nn.Embedding's input: its rows came with its
    # forward; from then on every step made one lookup
    assert len(trained) - len(batches) <= pipeline.staleness + 2
    assert all(sorted(k.tables) == ["ebc.a", "ebc.b", "emb"] for k in prefetched[pipeline.staleness + 2 :])


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_a_lookup_misses_the_updates_of_at_most_staleness_earlier_steps(shards, staleness):
    """Every step adds exactly -1 to row 0 (SGD lr=1, gradient 1, rows from 0): the row a step reads counts the
    updates applied before its lookup. Slow updates make the hybrid lookups miss some, never more than the bound."""
    model = nn.ModuleDict({"emb": nn.Embedding(4, 1, device="meta")})
    _, pipeline = _remote(shards, staleness, TableDefaults(optimizer=SGD(lr=1.0), init=Constant(0.0)), model=model)
    update = shards._update

    def slow(*args):
        time.sleep(0.02)
        return update(*args)

    shards._update = slow
    batches = [torch.zeros(1, dtype=torch.int64) for _ in range(12)]
    loader = PrefetchingLoader(batches, pipeline)
    seen, lags = [], []
    for step, batch in enumerate(loader):
        pipeline.begin_step(batch)
        row = model["emb"](batch)
        seen.append(-int(row.item()))  # updates applied before this step's lookup
        figures = pipeline.step_metrics()
        lags.append((figures["staleness"], figures["staleness_at_answer"]))
        row.sum().backward()
        pipeline.finish_step(scale=1.0)
    pipeline.drain()
    loader.close()
    missed = [step - applied for step, applied in enumerate(seen)]
    assert all(0 <= m <= staleness for m in missed), missed
    # acknowledged before the lookup went out means applied before it read: the lag at issue bounds what was missed,
    # and the acknowledgements only grow until the answer
    assert all(m <= issued and answered <= issued <= staleness for m, (issued, answered) in zip(missed, lags)), (missed, lags)
    if staleness:
        assert max(missed) > 0, "the updates were slow: some lookup should have gone out before the last one was applied"
    assert shards.rows("emb", torch.zeros(1, dtype=torch.int64)).item() == -len(batches)


def test_a_prefetch_the_forward_does_not_use_is_reported_once_and_the_forward_trains_what_it_used(shards, caplog):
    model = nn.Module()
    model.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="miss", embedding_dim=4, num_embeddings=100, feature_names=["x"])],
                                       device=torch.device("meta"))
    _, pipeline = _remote(shards, 1, TableDefaults(optimizer=SGD(lr=0.1), init=Uniform(-0.1, 0.1)), model=model)

    def kjt(values):
        return KeyedJaggedTensor.from_lengths_sync(keys=["x"], values=torch.tensor(values), lengths=torch.ones(len(values), dtype=torch.int32))

    with caplog.at_level(logging.WARNING, logger="lightning_persia.embedding.pipeline"):
        loader = PrefetchingLoader([kjt([1, 2, 3])] * 3, pipeline)
        for batch in loader:
            pipeline.begin_step(batch)
            model.ebc(kjt([11, 12, 13])).values().sum().backward()  # the model changed the ids before the module
            pipeline.finish_step(scale=1.0)
        pipeline.drain()
        loader.close()
    assert pipeline.prefetch_misses == 3
    assert [sorted(k.ids.tolist()) for k in shards.updates] == [[11, 12, 13]] * 3  # trains what it used
    reports = [r.getMessage() for r in caplog.records if "prefetched" in r.getMessage()]
    assert len(reports) == 1 and "'ebc'" in reports[0] and "data pipeline" in reports[0]


def test_an_epoch_cut_short_releases_the_window(shards):
    """Steps planned but never trained are released: draining after two of ten batches returns at once."""
    model, pipeline = _remote(shards, 2, TableDefaults(optimizer=SGD(lr=0.1), init=INIT))
    loader = PrefetchingLoader(_batches(10), pipeline)
    iterator = iter(loader)
    for _ in range(2):
        batch = next(iterator)
        pipeline.begin_step(batch)
        model(batch).backward()
        pipeline.finish_step(scale=1.0)
    loader.close()
    started = time.monotonic()
    pipeline.drain()
    assert time.monotonic() - started < 5
    assert len(shards.updates) == 2


def test_non_finite_gradient_rows_are_dropped_and_counted_the_others_pushed(shards):
    model = nn.ModuleDict({"emb": nn.Embedding(8, 2, device="meta")})
    _, pipeline = _remote(shards, 0, TableDefaults(optimizer=SGD(lr=1.0), init=Constant(0.0)), model=model)
    ids = torch.tensor([1, 2, 3])
    pipeline.begin_step()
    rows = model["emb"](ids)
    (rows * torch.tensor([[1.0], [float("inf")], [1.0]])).sum().backward()  # row 2's gradient is infinite
    pipeline.finish_step(scale=1.0)
    pipeline.drain()
    assert pipeline.dropped_nonfinite_rows == 1
    assert sorted(shards.updates[-1].ids.tolist()) == [1, 3]
    assert shards.rows("emb", ids).tolist() == [[-1.0, -1.0], [0.0, 0.0], [-1.0, -1.0]]


def test_a_batch_shaped_otherwise_is_not_planned_from_a_learnt_path():
    """A learnt path that leads elsewhere in another batch plans nothing: that module's forward fetches its rows."""
    from functools import partial

    from lightning_persia.embedding.planning import TensorPlanner
    from lightning_persia.ops.bucketize import bucketize
    from lightning_persia.ops.shard_map import ShardMap

    planner = BatchPlanner((TensorPlanner("emb", "emb", 2),), (("emb", (("key", "ids"),)),), partial(bucketize, shard_map=ShardMap.uniform(1)))
    planned = planner.plan({"ids": torch.tensor([5, 1, 5])})
    assert [p.key for p in planned.plans] == ["emb"] and planned.plans[0].unique.ids.tolist() == [1, 5]
    assert planner.plan({"ids": torch.tensor([0.5])}).plans == ()
    assert planner.plan({"other": torch.tensor([1])}).plans == () and planner.plan([1, 2]).plans == ()
