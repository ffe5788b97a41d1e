"""A forward that receives other ids than its prefetched batch still trains right, and the user is told once."""
from __future__ import annotations

import logging
import threading

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.embedding.worker import EmbeddingWorker
from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.table_config import SGD, Uniform
from lightning_persia.strategy.interception import TableDefaults, intercept


def _kjt(values: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(keys=["x"], values=torch.tensor(values), lengths=torch.ones(len(values), dtype=torch.int32))


def test_a_prefetch_the_forward_does_not_use_is_reported_once(ps_cluster, caplog):
    model = nn.Module()
    model.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="miss_a", embedding_dim=4, num_embeddings=100, feature_names=["x"])])
    (twin,) = intercept(model, ["EmbeddingBagCollection"], [], TableDefaults(optimizer=SGD(lr=0.1), init=Uniform(-0.1, 0.1)))
    with PSClient(ps_cluster.addresses) as client:
        client.configure([t.config for t in twin.remote_tables])
        worker = EmbeddingWorker(client, staleness=1, wire_dtype="fp32", device=torch.device("cpu"))
        worker.register(twin)
        with caplog.at_level(logging.WARNING, logger="lightning_persia.embedding.worker"):
            for _ in range(3):
                step = worker.plan(_kjt([1, 2, 3]))  # what the prefetch thread does with the batch
                worker.issue(step, threading.Event())
                worker.enqueue(step)
                worker.begin_step()
                pooled = model.ebc(_kjt([11, 12, 13]))  # the model changed the ids before the module
                pooled.values().sum().backward()
                assert [r.unique[0].tolist() for r in worker._current.used] == [[11, 12, 13]]  # trains what it used
                worker.finish_step(scale=1.0)
            worker.drain()
    assert worker.prefetch_misses == 3
    reports = [r.getMessage() for r in caplog.records if "prefetched" in r.getMessage()]
    assert len(reports) == 1 and "'ebc'" in reports[0] and "data pipeline" in reports[0]
