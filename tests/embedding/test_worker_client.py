"""Embedding workers against real shards: rows, updates and deduplication as the trainer's own client and planning
give them, through shared buffers; bad input refused; a worker that dies is started again and its unanswered calls sent
to the new one, each update applied once, or, past its restarts, fails every call, in flight or to come, with an error
naming it."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.embedding import worker_client
from lightning_persia.embedding.planning import CollectionPlanner
from lightning_persia.embedding.worker_client import EmbeddingWorkerError, EmbeddingWorkers, WorkerDeduplication
from lightning_persia.ops.dedup import keyed_unique
from lightning_persia.ops.keyed_ids import KeyedIds
from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.table_config import SGD, Constant, TableConfig
from lightning_persia.strategy.local_cluster import LocalCluster

TABLES = [TableConfig("a", 4, optimizer=SGD(lr=1.0), init=Constant(0.5)), TableConfig("b", 8, optimizer=SGD(lr=1.0), init=Constant(-1.0))]
DIMS = {t.name: t.dim for t in TABLES}


@pytest.fixture(scope="module")
def cluster():
    cluster = LocalCluster(2, seed=0)
    client = PSClient(cluster.addresses)
    client.wait_healthy(60)
    client.configure(TABLES)
    yield cluster, client
    client.close()
    cluster.stop()


def _workers(client: PSClient, count: int = 1, restarts: int = 0) -> EmbeddingWorkers:
    return EmbeddingWorkers(count, client.addresses, DIMS, client.retry, lambda: client.incarnations, start_timeout_s=120, restarts=restarts)


def _keyed(a: list[int], b: list[int]) -> KeyedIds:
    return KeyedIds(("a", "b"), (len(a), len(b)), torch.tensor(a + b, dtype=torch.int64))


def test_rows_and_updates_through_the_workers_are_the_clients(cluster):
    _, client = cluster
    workers = _workers(client, count=2)
    try:
        keyed = _keyed([1, 2, 3 << 40], [7, -5])
        sharded = workers.shard(keyed)
        rows = workers.lookup_sharded_async(sharded, train=True, wire_dtype="fp32").result(60)
        expected = client.lookup_sharded_async(client.shard(keyed), train=False, wire_dtype="fp32").result(60)
        torch.testing.assert_close(rows, expected, rtol=0, atol=0)
        grads = torch.arange(rows.numel(), dtype=torch.float32) / 100
        workers.update_sharded_async(sharded, grads, (4, 8), wire_dtype="fp32").result(60)
        after = client.lookup_sharded_async(client.shard(keyed), train=False, wire_dtype="fp32").result(60)
        torch.testing.assert_close(after, expected - grads, rtol=0, atol=1e-6)  # SGD(lr=1)
        # An update without a lookup of its own (the ranks' merged one) goes through worker 0, sharded there.
        workers.update_sharded_async(workers.shard(keyed), grads, (4, 8), wire_dtype="fp32", sender="merged").result(60)
        torch.testing.assert_close(client.lookup_sharded_async(client.shard(keyed), train=False, wire_dtype="fp32").result(60),
                                   expected - 2 * grads, rtol=0, atol=1e-6)
        assert len(set(workers.pids)) == 2 and os.getpid() not in workers.pids
    finally:
        workers.close()


def test_workers_that_cannot_read_the_trainers_memory_get_copies_and_answer_the_same(cluster, monkeypatch):
    _, client = cluster
    with monkeypatch.context() as patch:  # the workers are told of a process they may not read: as under Yama's ptrace_scope 1
        patch.setattr(worker_client.os, "getpid", lambda: 2**22 + 7)
        workers = _workers(client)
    try:
        assert workers.read_trainer_memory == [False]
        keyed = KeyedIds(("a", "b"), (6, 4), torch.tensor([5, 1, 5, 9, 1, 1, 7, -2, 7, 7]) + (1 << 30))
        unique, inverse = workers.deduplicate(keyed)
        expected_unique, expected_inverse = keyed_unique(keyed)
        assert torch.equal(unique.ids, expected_unique.ids) and torch.equal(inverse, expected_inverse)
        fresh = _keyed([1 << 31, 2 << 31], [3 << 31])  # not in a shared buffer: copied into one
        sharded = workers.shard(fresh)
        rows = workers.lookup_sharded_async(sharded, train=True, wire_dtype="fp32").result(60)
        grads = torch.arange(rows.numel(), dtype=torch.float32) / 10
        workers.update_sharded_async(sharded, grads, (4, 8), wire_dtype="fp32").result(60)
        after = client.lookup_sharded_async(client.shard(fresh), train=False, wire_dtype="fp32").result(60)
        torch.testing.assert_close(after, rows - grads, rtol=0, atol=1e-6)
    finally:
        workers.close()


def test_the_workers_deduplicate_like_the_trainer(cluster):
    _, client = cluster
    workers = _workers(client)
    try:
        keyed = KeyedIds(("a", "b"), (6, 4), torch.tensor([5, 1, 5, 9, 1, 1, 7, -2, 7, 7]))
        unique, inverse = workers.deduplicate(keyed)
        expected_unique, expected_inverse = keyed_unique(keyed)
        assert unique.tables == ("a", "b") and unique.counts == expected_unique.counts == (3, 2)
        assert torch.equal(unique.ids, expected_unique.ids) and torch.equal(inverse, expected_inverse)
        empty, rows = workers.deduplicate(KeyedIds(("a",), (0,), torch.empty(0, dtype=torch.int64)))
        assert empty.counts == (0,) and rows.numel() == 0
    finally:
        workers.close()


def test_a_collection_planned_through_the_workers_is_planned_as_in_the_trainer(cluster):
    _, client = cluster
    workers = _workers(client)
    try:
        generator = torch.Generator().manual_seed(4)
        features = ["f0", "f1", "f2"]
        lengths = torch.randint(0, 5, (3 * 64,), generator=generator)
        values = torch.randint(0, 40, (int(lengths.sum()),), generator=generator)
        kjt = KeyedJaggedTensor(keys=features, values=values, lengths=lengths)
        planner = CollectionPlanner("ebc", ("a", "b"), (4, 8), tuple(features), (0, 1, 1))
        local = planner.plan(kjt)
        dedup = WorkerDeduplication(workers)
        through = planner.plan(kjt, dedup)
        if workers.read_trainer_memory[0]:  # counted by the worker from the lengths
            assert dedup.by_features(("a", "b"), (0, 1, 1), 64, values, lengths) is not None
        assert through.id_counts == local.id_counts and through.unique.counts == local.unique.counts
        assert torch.equal(through.unique.ids, local.unique.ids) and torch.equal(through.inverse, local.inverse)
        assert torch.equal(through.block_rows(), local.block_rows())
        if workers.read_trainer_memory[0]:  # int32 lengths (TorchRec's usual) are read as well
            short = dedup.by_features(("a", "b"), (0, 1, 1), 64, values, lengths.int())
            assert short is not None and short[2] == local.id_counts and torch.equal(short[1], local.inverse)
        # ids not int64 are not read in place: the planning counts them and the worker deduplicates, as before
        assert dedup.by_features(("a", "b"), (0, 1, 1), 64, values.int(), lengths) is None
    finally:
        workers.close()


def test_bad_input_is_refused_with_its_name(cluster):
    _, client = cluster
    workers = _workers(client)
    try:
        with pytest.raises(ValueError, match=r"tables \['c'\] are not among the remote tables \['a', 'b'\]"):
            workers.lookup_sharded_async(workers.shard(KeyedIds(("c",), (1,), torch.tensor([1]))), train=True)
        with pytest.raises(ValueError, match="grads must be a flat float tensor of 12 values"):
            workers.update_sharded_async(workers.shard(_keyed([1], [2])), torch.zeros(3), (4, 8))
        with pytest.raises(TypeError, match="expected the ids as EmbeddingWorkers.shard"):
            workers.lookup_sharded_async(client.shard(_keyed([1], [2])), train=True)
        with pytest.raises(ValueError, match="count must be >= 1"):
            EmbeddingWorkers(0, client.addresses, DIMS, client.retry, lambda: client.incarnations)
        with pytest.raises(ValueError, match="restarts must be >= 0, got -1"):
            EmbeddingWorkers(1, client.addresses, DIMS, client.retry, lambda: client.incarnations, restarts=-1)
    finally:
        workers.close()


def test_a_worker_that_dies_fails_the_calls_in_flight_and_later_ones_naming_it(cluster):
    _, client = cluster
    workers = _workers(client)
    try:
        keyed = _keyed(list(range(2000)), list(range(500)))
        pid = workers.pids[0]
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EmbeddingWorkerError, match=rf"embedding worker 0 of rank 0 \(pid {pid}\) exited with code -9"):
            for _ in range(50):  # until the pipe tells of the death: every call fails, none waits forever
                workers.lookup_sharded_async(workers.shard(keyed), train=True).result(30)
        assert time.monotonic() - started < 30
        with pytest.raises(EmbeddingWorkerError, match="embedding worker 0 of rank 0"):
            workers.update_sharded_async(workers.shard(keyed), torch.zeros(2000 * 4 + 500 * 8), (4, 8)).result(5)
    finally:
        workers.close()


def test_a_worker_that_cannot_reach_the_shards_fails_the_start_naming_it(cluster):
    _, client = cluster
    with pytest.raises(EmbeddingWorkerError, match=r"embedding worker 0 of rank 3 \(pid \d+\) could not reach the shards"):
        EmbeddingWorkers(1, client.addresses, {"nope": 4}, client.retry, lambda: client.incarnations, rank=3)


@pytest.mark.timeout(240)
def test_a_worker_killed_with_calls_in_flight_is_started_again_and_each_update_lands_once(cluster):
    _, client = cluster
    workers = _workers(client, restarts=2)
    try:
        keyed = _keyed(list(range(10_000, 14_000)), list(range(10_000, 11_000)))
        before = client.lookup_sharded_async(client.shard(keyed), train=False, wire_dtype="fp32").result(60)
        grads = torch.rand(4000 * 4 + 1000 * 8)
        expected = before
        for delay in (0.0, 0.05):  # killed before the worker read the update, or while it sends it
            sharded = workers.shard(keyed)
            workers.lookup_sharded_async(sharded, train=True, wire_dtype="fp32").result(60)  # the rows exist, as after a forward
            update = workers.update_sharded_async(sharded, grads, (4, 8), wire_dtype="fp32")
            time.sleep(delay)
            os.kill(workers.pids[0], signal.SIGKILL)
            update.result(120)  # answered by the worker started in its place (or by the first, just before it died)
            expected = expected - grads  # SGD(lr=1), once, whether or not the dead worker's attempt reached a shard
            after = client.lookup_sharded_async(client.shard(keyed), train=False, wire_dtype="fp32").result(60)
            torch.testing.assert_close(after, expected, rtol=0, atol=1e-5)
            # A call made after the death is answered by the worker started in its place.
            torch.testing.assert_close(workers.lookup_sharded_async(workers.shard(keyed), train=False, wire_dtype="fp32").result(120),
                                       expected, rtol=0, atol=1e-5)
        assert workers.restarted == 2
        # The third death is past its restarts: the calls fail naming the worker, after both restarts.
        os.kill(workers.pids[0], signal.SIGKILL)
        with pytest.raises(EmbeddingWorkerError, match=r"embedding worker 0 of rank 0 \(pid \d+\) exited with code -9 after 2 restart"):
            for _ in range(50):
                workers.lookup_sharded_async(workers.shard(keyed), train=True).result(30)
    finally:
        workers.close()
