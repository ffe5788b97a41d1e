"""Admission, deterministic init, eviction and statistics of one shard's tables."""
import itertools

import pytest
import torch

from lightning_persia.ops.shard_map import shard_of
from lightning_persia.remote_ps.store import InvalidRequestError, ShardStore, UnknownTableError, chunked_rows
from lightning_persia.remote_ps.store import table as table_module
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.store.thread_clock import LockWaits
from lightning_persia.remote_ps.store.initializers import initial_rows
from lightning_persia.remote_ps.table_config import SGD, Adagrad, Constant, Normal, TableConfig, Uniform


def test_initial_rows_depend_only_on_seed_table_and_id():
    ids = torch.tensor([3, -1, 1 << 62, 12345])
    a = initial_rows(Uniform(-1, 1), 7, "t", ids, 16)
    b = initial_rows(Uniform(-1, 1), 7, "t", ids.flip(0), 16).flip(0)
    assert torch.equal(a, b)
    assert not torch.equal(a, initial_rows(Uniform(-1, 1), 8, "t", ids, 16))
    assert not torch.equal(a, initial_rows(Uniform(-1, 1), 7, "u", ids, 16))
    assert a.min() >= -1 and a.max() <= 1


def test_initial_rows_have_the_asked_distribution():
    ids = torch.arange(20000)
    normal = initial_rows(Normal(0.5, 2.0), 0, "t", ids, 8)
    assert abs(normal.mean().item() - 0.5) < 0.05 and abs(normal.std().item() - 2.0) < 0.05
    uniform = initial_rows(Uniform(0, 1), 0, "t", ids, 8)
    assert abs(uniform.mean().item() - 0.5) < 0.01
    assert torch.equal(initial_rows(Constant(0.25), 0, "t", ids[:3], 2), torch.full((3, 2), 0.25))


@pytest.mark.parametrize("num_shards", [1, 3])
def test_same_id_same_initial_row_whatever_the_shard_count(num_shards):
    config = TableConfig("t", 8, init=Normal(0, 1))
    ids = torch.arange(-50, 50)
    owners = shard_of(ids, num_shards)
    rows = torch.empty(100, 8)
    for shard in range(num_shards):
        store = ShardStore(shard, num_shards, seed=11)
        store.configure(config)
        mine = owners == shard
        rows[mine] = store.lookup("t", ids[mine], train=True)
    torch.testing.assert_close(rows, initial_rows(config.init, 11, "t", ids, 8), rtol=0, atol=0)


def test_evaluation_lookups_never_insert():
    store = ShardStore(0, 1)
    store.configure(TableConfig("t", 4))
    first = store.lookup("t", torch.tensor([1, 2]), train=False)
    assert store.stats()["t"]["rows"] == 0
    assert torch.equal(first, store.lookup("t", torch.tensor([1, 2]), train=True))
    assert store.stats()["t"]["rows"] == 2


def test_admit_probability_zero_stores_nothing_and_drops_updates():
    store = ShardStore(0, 1)
    store.configure(TableConfig("t", 4, admit_probability=0.0, optimizer=SGD(lr=1.0)))
    before = store.lookup("t", torch.tensor([1, 2]), train=True)
    assert store.update("t", torch.tensor([1, 2]), torch.ones(2, 4)) == 0
    assert torch.equal(store.lookup("t", torch.tensor([1, 2]), train=True), before)
    assert store.stats()["t"]["rows"] == 0 and store.stats()["t"]["dropped_update_rows"] == 2


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_at_capacity_keeps_hot_rows_and_reinitialises_evicted(policy):
    store = ShardStore(0, 1)
    store.configure(TableConfig("t", 4, capacity=100, eviction=policy, optimizer=SGD(lr=1.0), init=Uniform(0, 1)))
    hot = torch.arange(0, 10)
    cold = torch.arange(10, 100)
    store.lookup("t", cold, train=True)
    for _ in range(3):
        store.lookup("t", hot, train=True)
    store.update("t", hot, torch.ones(10, 4))
    store.update("t", cold, torch.ones(90, 4))
    store.lookup("t", torch.arange(1000, 1020), train=True)  # 20 new ids do not fit: evicts in bulk
    stats = store.stats()["t"]
    assert stats["rows"] <= 100 and stats["evicted"] >= 20
    hot_rows = store.lookup("t", hot, train=False)
    assert torch.equal(hot_rows, initial_rows(Uniform(0, 1), 0, "t", hot, 4) - 1.0), "hot rows were evicted"
    evicted = [i for i in cold.tolist() if torch.equal(store.lookup("t", torch.tensor([i]), train=False), initial_rows(Uniform(0, 1), 0, "t", torch.tensor([i]), 4))]
    assert len(evicted) >= 20, "evicted rows must come back re-initialised"


def test_long_run_at_capacity_stays_bounded():
    store = ShardStore(0, 1)
    store.configure(TableConfig("t", 4, capacity=1000))
    for start in range(0, 50_000, 500):
        store.lookup("t", torch.arange(start, start + 500), train=True)
    stats = store.stats()["t"]
    assert stats["rows"] <= 1000 and stats["rows_allocated"] <= 1000  # evicted rows are reused, never appended
    assert stats["index_bytes"] <= 393_248 + 1000 * 12  # the smallest index (4,096 partitions of one bucket) + 12 B a row


def test_bad_requests_name_the_problem_and_change_nothing():
    store = ShardStore(0, 2)
    store.configure(TableConfig("t", 4))
    mine = torch.arange(100)[shard_of(torch.arange(100), 2) == 0][:3]
    before = store.lookup("t", mine, train=True)
    with pytest.raises(UnknownTableError, match="unknown table 'nope'"):
        store.lookup("nope", mine, train=True)
    with pytest.raises(InvalidRequestError, match="shape"):
        store.update("t", mine, torch.ones(3, 5))
    with pytest.raises(InvalidRequestError, match="NaN"):
        store.update("t", mine, torch.full((3, 4), float("nan")))
    with pytest.raises(InvalidRequestError, match="int64"):
        store.lookup("t", mine.to(torch.int32), train=True)
    foreign = torch.arange(100)[shard_of(torch.arange(100), 2) == 1][:1]
    with pytest.raises(InvalidRequestError, match="belongs to shard 1"):
        store.lookup("t", foreign, train=True)
    with pytest.raises(InvalidRequestError, match="dim 4"):
        store.configure(TableConfig("t", 8))
    assert torch.equal(store.lookup("t", mine, train=False), before)


def test_one_request_of_several_tables_gives_what_table_by_table_requests_give(native_kernels, monkeypatch):
    """The native path runs every table of a request in one call (lookups, and the SGD / Adagrad rules); the tensor
    path runs them one by one. Duplicate, unsorted and absent ids, fp16 rows and a weight bound included."""
    configs = [
        TableConfig("sgd", 4, optimizer=SGD(lr=0.1, weight_decay=0.01), weight_bound=0.3),
        TableConfig("ada", 8, optimizer=Adagrad(lr=0.05, initial_accumulator_value=0.1), storage_dtype="fp16"),
        TableConfig("row", 16, optimizer=Adagrad(lr=0.05, rowwise=True)),
    ]

    def run(store: ShardStore) -> list[torch.Tensor]:
        for config in configs:
            store.configure(config)
        generator = torch.Generator().manual_seed(0)
        for step in range(5):
            ids = [torch.randint(0, 300, (200,), generator=generator) for _ in configs]
            store.lookup_many([(c.name, i.unique()) for c, i in zip(configs, ids)], train=True)
            extra = torch.tensor([10_000 + step])  # never looked up: its update is dropped
            store.update_many([(c.name, torch.cat([i, extra]), torch.randn(201, c.dim, generator=generator))
                               for c, i in zip(configs, ids)])
        return store.lookup_many([(c.name, torch.arange(300)) for c in configs], train=False)

    native_rows = run(ShardStore(0, 1, seed=5))
    monkeypatch.setattr(chunked_rows.native, "available", lambda: False)
    tensor_store = ShardStore(0, 1, seed=5)
    tensor_rows = run(tensor_store)
    for native_table, tensor_table in zip(native_rows, tensor_rows):
        torch.testing.assert_close(native_table, tensor_table, rtol=1e-5, atol=1e-6)
    assert tensor_store.stats()["sgd"]["dropped_update_rows"] == 5


ADMITTED = [  # every field a new record gets: each rule's state, fp16 rows, LRU and LFU access values
    TableConfig("ada16", 8, optimizer=Adagrad(lr=0.05, initial_accumulator_value=0.1), storage_dtype="fp16"),
    TableConfig("row", 16, optimizer=Adagrad(lr=0.05, rowwise=True), eviction="lfu"),
    TableConfig("sgd", 4, optimizer=SGD(lr=0.1), init=Uniform(-0.3, 0.7)),
]


def _admitting_steps(store: ShardStore, generator: torch.Generator) -> list[torch.Tensor]:
    """Training lookups with new, known, repeated and unsorted ids, and updates in between; every lookup's rows."""
    for config in ADMITTED:
        store.configure(config)
    seen = []
    for step in range(6):
        requests = []
        for config in ADMITTED:
            ids = torch.randint(0, 4000, (900,), generator=generator)
            ids[:50] = ids[50:100]  # repeated ids, some of them new
            requests.append((config.name, ids))
        seen += store.lookup_many(requests, train=True)
        store.update_many([(name, ids.unique(), torch.randn(ids.unique().numel(), c.dim, generator=generator))
                           for (name, ids), c in zip(requests, ADMITTED)])
        seen.append(store.lookup("sgd", torch.tensor([100_000 + step, 100_000 + step]), train=True))  # a single-table lookup
    return seen


def test_a_training_lookup_admits_new_ids_natively_as_the_tensor_path_does(native_kernels, small_chunks, monkeypatch):
    """New ids are admitted in one native pass (no tensor op per field): the same rows, bit for bit, the same records
    (state and version: the updates that follow agree) and counters as the tensor path, across chunk boundaries, with
    ids repeated in a request (one row each). (With eviction the two paths may pick other victims among rows of equal
    access values, as rows are numbered in another order: see the eviction tests, which run this pass.)"""
    write_admitted = Table.write_admitted
    tensor_admissions = []
    monkeypatch.setattr(Table, "write_admitted", lambda self, ids, initial: tensor_admissions.append(ids) or write_admitted(self, ids, initial))
    native_store = ShardStore(0, 1, seed=3)
    native_rows = _admitting_steps(native_store, torch.Generator().manual_seed(0))
    assert tensor_admissions == []  # every admission above ran natively

    monkeypatch.setattr(chunked_rows.native, "available", lambda: False)
    tensor_store = ShardStore(0, 1, seed=3)
    tensor_rows = _admitting_steps(tensor_store, torch.Generator().manual_seed(0))
    assert tensor_admissions
    # The first lookups admit only: bit for bit. Later ones read rows the rules changed (the native rules and the
    # tensor ones agree to float32 rounding, which may flip the last bit of an fp16 row).
    def close(config: TableConfig) -> dict:
        return dict(rtol=1e-3, atol=1e-4) if config.storage_dtype == "fp16" else dict(rtol=1e-5, atol=1e-6)

    configs = [*ADMITTED, ADMITTED[2]] * 6  # each step: one lookup of the three tables, one of "sgd" alone
    for i, (config, native_table, tensor_table) in enumerate(zip(configs, native_rows, tensor_rows, strict=True)):
        assert native_table.dtype == tensor_table.dtype
        if i < len(ADMITTED):
            assert torch.equal(native_table, tensor_table)
        torch.testing.assert_close(native_table, tensor_table, **close(config))
    everything = torch.arange(4000)
    for config in ADMITTED:
        torch.testing.assert_close(native_store.lookup(config.name, everything, train=False),
                                   tensor_store.lookup(config.name, everything, train=False), **close(config))
    counters = ("rows", "inserted", "lookup_rows")
    native_stats, tensor_stats = native_store.stats(), tensor_store.stats()
    for config in ADMITTED:
        assert {k: native_stats[config.name][k] for k in counters} == {k: tensor_stats[config.name][k] for k in counters}
    assert native_stats["sgd"]["rows_allocated"] > 1024  # the table spans chunks


def test_an_id_repeated_in_a_training_lookup_is_admitted_once(native_kernels):
    store = ShardStore(0, 1)
    store.configure(TableConfig("t", 4))
    rows = store.lookup("t", torch.tensor([7, 3, 7, 7, 3]), train=True)
    assert torch.equal(rows[0], rows[2]) and torch.equal(rows[0], rows[3]) and torch.equal(rows[1], rows[4])
    stats = store.stats()["t"]
    assert stats["inserted"] == stats["rows"] == 2
    assert stats["rows_allocated"] == 5  # taken for the 5 absent ids; the 3 not needed are free rows now
    store.lookup("t", torch.arange(100, 103), train=True)
    assert store.stats()["t"]["rows_allocated"] == 5  # ... which the next new ids reuse


def test_an_admission_cut_short_keeps_what_it_admitted_and_frees_the_other_rows(native_kernels, monkeypatch):
    """The native pass stops where it fails (the index cannot grow, or too few rows were given): the ids admitted
    until then stay and are counted, the rows it did not use go back to the free list, and nothing leaks."""
    from lightning_persia.remote_ps.store.native import jobs

    admit = jobs.admit

    def cut_short(job):
        job.fresh_count = 3  # the pass runs out of rows after 3 ids
        return admit(job)

    store = ShardStore(0, 1)
    store.configure(TableConfig("t", 4))
    monkeypatch.setattr(jobs, "admit", cut_short)
    with pytest.raises(ValueError, match="too few"):
        store.lookup("t", torch.arange(10), train=True)
    stats = store.stats()["t"]
    assert (stats["rows"], stats["inserted"], stats["rows_allocated"]) == (3, 3, 10)
    monkeypatch.setattr(jobs, "admit", admit)
    rows = store.lookup("t", torch.arange(10), train=True)
    assert torch.equal(rows, initial_rows(TableConfig("t", 4).init, 0, "t", torch.arange(10), 4))
    stats = store.stats()["t"]
    assert (stats["rows"], stats["inserted"], stats["rows_allocated"]) == (10, 10, 10)  # the 7 freed rows reused


@pytest.mark.parametrize("config", [
    TableConfig("t", 4, init=Normal(0.0, 0.1)),
    TableConfig("t", 4, admit_probability=0.5),
    TableConfig("t", 4, capacity=10),
], ids=["normal-init", "admission-draw", "more-new-ids-than-capacity"])
def test_tables_the_native_pass_does_not_cover_admit_in_tensor_ops(native_kernels, config, monkeypatch):
    native_admissions = []
    monkeypatch.setattr(Table, "admit_in_one_pass", lambda *args: native_admissions.append(args))
    store = ShardStore(0, 1, seed=1)
    store.configure(config)
    rows = store.lookup("t", torch.arange(20), train=True)
    assert native_admissions == []
    kept = store.stats()["t"]["rows"]
    assert 0 < kept <= min(20, config.capacity)
    expected = initial_rows(config.init, 1, "t", torch.arange(20), 4)
    assert torch.equal(rows, expected)


def test_the_longest_insert_is_split_into_cpu_waiting_for_a_core_and_blocked():
    store = ShardStore(0, 1)
    store.configure(TableConfig("t", 4))
    store.lookup("t", torch.arange(10), train=True)  # too small to time: only its held time counts
    store.lookup("t", torch.arange(10, 10 + 8192), train=True)
    stats = store.stats()["t"]
    assert stats["worst_insert_cpu_s"] > 0
    for part in ("cpu", "runnable", "blocked"):  # each the worst of its own, none longer than the longest hold
        assert -1e-3 <= stats[f"worst_insert_{part}_s"] <= stats["worst_insert_s"] + 1e-3, stats
    store.lookup("t", torch.arange(10, 10 + 8192), train=False)
    assert store.stats()["t"]["worst_insert_s"] == stats["worst_insert_s"]  # nothing inserted, nothing timed


def test_a_large_table_at_capacity_evicts_cold_rows_a_slice_at_a_time_and_keeps_hot_ones():
    store = ShardStore(0, 1)
    store.configure(TableConfig("t", 2, capacity=80_000, optimizer=SGD(lr=1.0), init=Uniform(0, 1)))
    hot = torch.arange(1000)
    store.lookup("t", torch.arange(80_000), train=True)
    evicted = []
    for wave in range(1, 9):
        store.lookup("t", hot, train=True)
        store.update("t", hot, torch.ones(1000, 2))
        before = store.stats()["t"]["evicted"]
        store.lookup("t", torch.arange(wave * 100_000, wave * 100_000 + 10_000), train=True)
        evicted.append(store.stats()["t"]["evicted"] - before)
    assert all(10_000 <= n <= 10_000 + 4_000 for n in evicted), evicted  # what the wave needs (5% of 80k at least)
    assert store.stats()["t"]["rows"] <= 80_000
    torch.testing.assert_close(store.lookup("t", hot, train=False), initial_rows(Uniform(0, 1), 0, "t", hot, 2) - 8)


def test_a_request_of_no_table_answers_nothing_with_either_kernels(store_kernels):
    store = ShardStore(shard_index=0, num_shards=1, seed=0)
    store.configure(TableConfig("t", dim=4))
    assert store.lookup_many([], train=True) == []
    assert store.update_many([]) == 0


def test_every_request_counts_its_wait_for_the_table_lock_in_the_stats(monkeypatch):
    ticks = itertools.count()  # a clock one second further at each reading: each taking of the lock counts 1 s
    monkeypatch.setattr(table_module, "LockWaits", lambda: LockWaits(clock=lambda: float(next(ticks))))
    table = Table(TableConfig("t", 4, optimizer=SGD(lr=0.1)), seed=0)
    ids = torch.arange(8)
    requests = {"lookup": lambda: table.lookup(ids, train=True), "update": lambda: table.update(ids, torch.ones(8, 4)),
                "lookup of several tables": lambda: Table.lookup_together([(table, ids)], train=True, dtype=torch.float32),
                "evaluation lookup": lambda: table.lookup(ids, train=False)}
    for name, request in requests.items():
        before = table.stats()["lock_wait_s"]
        request()
        assert table.stats()["lock_wait_s"] - before == 1.0, name  # one taking of the lock: a table all in memory
