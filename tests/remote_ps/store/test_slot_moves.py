"""Slots moving between live stores: a random stream of lookups and updates, interleaved with the steps of handovers
(2 -> 3 -> 2 shards), against one store that never moved, compared row for row, bit for bit."""
import os
import random
import threading
from dataclasses import replace

import pytest
import torch

from lightning_persia.ops.shard_map import SLOTS, ShardMap
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.errors import InvalidRequestError
from lightning_persia.remote_ps.store.slot_moves import MapMovedError, SlotsMovingError
from lightning_persia.remote_ps.store.wal.changes import Change, TableChange
from lightning_persia.remote_ps.table_config import SGD, Adam, Constant, TableConfig
from tests.remote_ps.checkpoint_rows import COMPARED, saved_rows

TABLES = (TableConfig("user", 4, optimizer=Adam(lr=0.05)), TableConfig("item", 2, optimizer=Adam(lr=0.1)))  # no capacity: evictions depend on which rows share a shard
DISK_TABLES = tuple(replace(config, capacity=40, storage="disk") for config in TABLES)  # most rows on disk: demoted, never lost


class PartlyRefused(Exception):
    """A lookup some of whose ids are moving: the others were looked up (and admitted)."""

    def __init__(self, rows: torch.Tensor, refused: torch.Tensor) -> None:
        super().__init__(f"{refused.numel()} ids are moving")
        self.rows, self.refused = rows, refused


class Cluster:
    """Stores routed by a client's map, as ``PSClient`` routes: a request refused because the map moved is routed
    again by the stores' newest map; one refused because its slots are moving waits."""

    def __init__(self, stores: list[ShardStore]) -> None:
        self.stores = stores
        self.map = stores[0].shard_map

    def _parts(self, ids: torch.Tensor):
        owners = self.map.shard_of(ids)
        return [(shard, torch.nonzero(owners == shard).squeeze(1)) for shard in range(self.map.num_shards)]

    def _refresh(self) -> None:
        self.map = max((store.shard_map for store in self.stores), key=lambda m: m.version)

    def _send(self, ids: torch.Tensor, call) -> list[torch.Tensor]:
        """Calls ``call(store, positions, map_version)`` for each shard's part of ``ids``, routing a part again when
        its shard says the map moved; returns the positions of the parts refused because their slots are moving."""
        pending = [(shard, where, self.map.version) for shard, where in self._parts(ids) if where.numel()]
        refused = []
        while pending:
            shard, where, version = pending.pop()
            try:
                call(self.stores[shard], where, version)
            except MapMovedError:
                self._refresh()
                pending += [(s, where[w], self.map.version) for s, w in self._parts(ids[where]) if w.numel()]
            except SlotsMovingError:
                refused.append(where)
        return refused

    def lookup(self, table: str, ids: torch.Tensor, train: bool) -> torch.Tensor:
        out = torch.empty(ids.numel(), 4 if table == "user" else 2)

        def call(store, where, version):
            out[where] = store.lookup_many([(table, ids[where])], train, map_version=version)[0]

        refused = self._send(ids, call)
        if refused:
            raise PartlyRefused(out, torch.cat(refused))
        return out

    def update(self, table: str, ids: torch.Tensor, grads: torch.Tensor):
        """The positions of the ids refused because their slots are moving (the caller sends them again later), or
        None."""
        refused = self._send(ids, lambda store, where, version: store.update_many([(table, ids[where], grads[where])],
                                                                                   map_version=version))
        return torch.cat(refused) if refused else None


def _rows(store_or_cluster, table: str, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(store_or_cluster, Cluster):
        return store_or_cluster.lookup(table, ids, train=False)
    return store_or_cluster.lookup_many([(table, ids)], False)[0]


def _stores(n: int, tables=TABLES) -> list[ShardStore]:
    stores = [ShardStore(i, n, seed=7) for i in range(n)]
    for store in stores:
        for config in tables:
            store.configure(config)
    return stores


def _move(stores: list[ShardStore], to_map: ShardMap, between, page_blocks: int = 1):
    """The steps of a handover from every store that gives slots away, calling ``between()`` (requests) between
    them; the rows go over ``page_blocks`` blocks at a time (as a shard's pages gather them). Returns nothing,
    asserts the rows moved."""
    live = stores[0].shard_map  # shard 0 is never a new one
    sources = [s for s in stores if any(o == s.shard_index != n for o, n in zip(live.owners, to_map.owners))]
    targets = [s for s in stores if s not in sources]
    for source in sources:
        page, configs = [], {}
        for config, step, rows in source.begin_handover(to_map):
            configs[config.name] = config
            page.append(Change([TableChange(config.name, step, rows=rows)]))
            if len(page) == page_blocks:
                for target in targets:
                    target.take_changes(list(configs.values()), page, to_map)
                page = []
            between()
        for target in targets:
            target.take_changes(list(configs.values()), page, to_map)
    for fenced in (False, True):
        for _ in range(2):
            for source in sources:
                configs, changes = source.handover_changes()
                for target in targets:
                    target.take_changes(configs, changes, to_map)
            between()
        if not fenced:
            for source in sources:
                source.fence_handover()
            between()  # requests of the moving slots are refused now
    for target in targets:
        target.adopt_map(to_map)
    for source in sources:
        source.finish_handover()


class Traffic:
    """A client's random lookups and updates of ``universe`` (``max_ids`` a request at most) sent to ``cluster`` and
    applied to ``model`` (a store that never moves), their answers compared; updates refused while their slots move
    are sent again by :meth:`flush_retries`."""

    def __init__(self, seed: int, cluster: Cluster, model: ShardStore, universe: torch.Tensor, max_ids: int = 120) -> None:
        self.rng = random.Random(seed)
        self.cluster, self.model, self.universe, self.max_ids = cluster, model, universe, max_ids
        self.retry = []

    def __call__(self, count: int) -> None:
        rng, cluster, model = self.rng, self.cluster, self.model
        for _ in range(count):
            table = rng.choice(("user", "item"))
            dim = 4 if table == "user" else 2
            ids = self.universe[torch.randperm(self.universe.numel(), generator=torch.Generator().manual_seed(rng.getrandbits(31)))[: rng.randint(1, self.max_ids)]]
            if rng.random() < 0.5:
                try:
                    found = cluster.lookup(table, ids, train=True)
                except PartlyRefused as partly:  # the client looks the refused ids up again later
                    done = torch.ones(ids.numel(), dtype=torch.bool)
                    done[partly.refused] = False
                    self.retry.append((table, ids[partly.refused], None))
                    ids, found = ids[done], partly.rows[done]
                assert torch.equal(found, model.lookup_many([(table, ids)], True)[0])
            else:
                grads = torch.randn(ids.numel(), dim, generator=torch.Generator().manual_seed(rng.getrandbits(31)))
                refused = cluster.update(table, ids, grads)
                applied = torch.ones(ids.numel(), dtype=torch.bool)
                if refused is not None:
                    applied[refused] = False
                    self.retry.append((table, ids[refused], grads[refused]))
                if applied.any():
                    model.update_many([(table, ids[applied], grads[applied])])

    def between(self) -> None:
        """A few requests: what a move's steps see between them."""
        self(self.rng.randint(0, 6))

    def flush_retries(self) -> None:
        while self.retry:
            table, ids, grads = self.retry.pop(0)
            if grads is None:
                assert torch.equal(self.cluster.lookup(table, ids, train=True), self.model.lookup_many([(table, ids)], True)[0])
                continue
            assert self.cluster.update(table, ids, grads) is None
            self.model.update_many([(table, ids, grads)])


def _moves_2_3_2(traffic: Traffic, new_shard: ShardStore, wave_slots: int = SLOTS, page_blocks: int = 1) -> None:
    """Requests, a move to 3 shards (``new_shard`` the third), requests, a move back to 2, requests; each move in
    waves of ``wave_slots`` slots."""
    cluster = traffic.cluster
    traffic(40)
    cluster.stores.append(new_shard)  # a new shard: no request reaches it before it adopts the map
    for size in (3, 2):
        for wave in cluster.stores[0].shard_map.waves(size, wave_slots):
            _move(cluster.stores, wave, traffic.between, page_blocks)
        traffic.flush_retries()
        traffic(40 if size == 3 else 20)


# in one move, rows in one chunk a table; and in waves of 300 slots, rows in several chunks of 1,024 going over three
# blocks a page (a block's buffers are reused two chunks on: a page must hold copies)
@pytest.mark.parametrize("seed, many_chunks", [*((seed, False) for seed in range(6)), (0, True), (1, True)])
def test_handovers_2_3_2_under_requests_keep_every_row_bit_for_bit(seed, many_chunks, request):
    universe = torch.arange(0, 16_000 if many_chunks else 900) * 7919 - 3000
    wave_slots, page_blocks = (300, 3) if many_chunks else (SLOTS, 1)
    if many_chunks:
        request.getfixturevalue("small_chunks")
    model = _stores(1)[0]
    cluster = Cluster(_stores(2))
    if many_chunks:  # over three chunks of rows per table and shard
        for table in ("user", "item"):
            assert torch.equal(cluster.lookup(table, universe, train=True), model.lookup_many([(table, universe)], True)[0])
    _moves_2_3_2(Traffic(seed, cluster, model, universe), ShardStore(2, 3, seed=7), wave_slots, page_blocks)
    for table in ("user", "item"):
        assert torch.equal(_rows(cluster, table, universe), _rows(model, table, universe)), f"seed {seed}, table {table}"
        held = [store.stats()[table]["rows"] for store in cluster.stores]
        assert held[2] == 0 and sum(held) == model.stats()[table]["rows"], (seed, table, held)


def _disk_stores(tmp_path, n: int, tables=DISK_TABLES) -> list[ShardStore]:
    """``n`` stores of ``tables`` whose requests demote what they need (no demoter: the rows in memory depend on the
    requests alone)."""
    stores = [ShardStore(i, n, seed=7, disk_dir=str(tmp_path / "tiers"), demotion_interval_s=None) for i in range(n)]
    for store in stores:
        for config in tables:
            store.configure(config)
    return stores


def _saved(tmp_path, stores: list[ShardStore], name: str, fields=COMPARED) -> dict[str, dict[str, torch.Tensor]]:
    """Every row of the shards of ``stores``' map as their checkpoint (at ``tmp_path / name``) holds it."""
    for store in stores[: stores[0].shard_map.num_shards]:
        store.save(str(tmp_path / name))
    return saved_rows(tmp_path / name, fields=fields)


@pytest.mark.usefixtures("disk_tier_kernels")
@pytest.mark.parametrize("seed", range(3))
def test_disk_tables_move_2_3_2_under_requests_with_every_row_and_its_optimizer_state(tmp_path, seed):
    """Most rows on disk (a memory budget of 40 rows a shard for 900 ids): the rows at the point come from both
    tiers, rows changed during the copy are shipped whether they were demoted or promoted since, and what the
    stores hold at the end (values and optimizer state) is what one store that never moved holds. The last seed moves
    in waves of 500 slots."""
    universe = torch.arange(0, 900) * 7919 - 3000
    model = _stores(1)[0]
    cluster = Cluster(_disk_stores(tmp_path, 2))
    new_shard = ShardStore(2, 3, seed=7, disk_dir=str(tmp_path / "tiers"), demotion_interval_s=None)
    _moves_2_3_2(Traffic(seed, cluster, model, universe, max_ids=40), new_shard, wave_slots=500 if seed == 2 else SLOTS)
    for table in ("user", "item"):
        assert torch.equal(_rows(cluster, table, universe), _rows(model, table, universe)), f"seed {seed}, table {table}"
        stats = [store.stats()[table] for store in cluster.stores]
        assert stats[2]["rows"] == stats[2]["disk_rows"] == 0, stats[2]
        assert sum(s["rows"] + s["disk_rows"] for s in stats) == model.stats()[table]["rows"]
        assert sum(s["disk_rows"] for s in stats) > sum(s["rows"] for s in stats)  # most rows on disk
    kept, expected = _saved(tmp_path, cluster.stores, "moved"), _saved(tmp_path, [model], "model")
    for table in ("user", "item"):
        for field in COMPARED:
            assert torch.equal(kept[table][field], expected[table][field]), (seed, table, field)


@pytest.mark.usefixtures("disk_tier_kernels")
def test_a_quiet_move_carries_each_disk_row_whole_with_its_access_count(tmp_path):
    """No request during the move: every row (ids, values, optimizer state, LFU access count) is after the move what
    it was before, whichever tier it was in on either side."""
    tables = tuple(replace(config, eviction="lfu") for config in DISK_TABLES)
    stores = _disk_stores(tmp_path, 2, tables)
    cluster = Cluster(stores)
    ids = torch.arange(0, 600) * 104729
    generator = torch.Generator().manual_seed(2)
    for round_ in range(4):  # rows looked up 1 to 4 times: access counts that differ
        for table, dim in (("user", 4), ("item", 2)):
            for batch in ids[: 600 - 150 * round_].split(40):
                cluster.lookup(table, batch, train=True)
                cluster.update(table, batch, torch.randn(batch.numel(), dim, generator=generator))
    fields = (*COMPARED, "access")
    before = _saved(tmp_path, stores, "before", fields)
    stores.append(ShardStore(2, 3, seed=7, disk_dir=str(tmp_path / "tiers"), demotion_interval_s=None))
    three = ShardMap.uniform(2).resized(3)
    _move(stores, three, lambda: None)
    after = _saved(tmp_path, stores, "after", fields)
    for table in ("user", "item"):
        for field in fields:
            assert torch.equal(after[table][field], before[table][field]), (table, field)
        assert stores[2].stats()[table]["disk_rows"] > 0  # the taker's budget: what it took went on to its disk
        held = [(store.stats()[table]["rows"] + store.stats()[table]["disk_rows"]) for store in stores]
        assert held == [int((three.shard_of(ids) == i).sum()) for i in range(3)], (table, held)


@pytest.mark.usefixtures("disk_tier_kernels")
def test_a_row_changed_during_the_copy_then_demoted_is_shipped_as_a_row_not_a_removal(tmp_path):
    config = DISK_TABLES[0]
    source = _disk_stores(tmp_path, 2, (config,))[0]
    ids = torch.arange(0, 2000) * 104729
    mine = ids[ShardMap.uniform(2).shard_of(ids) == 0]
    for batch in mine.split(40):
        source.lookup("user", batch, train=True)
    three = ShardMap.uniform(2).resized(3)
    moving = mine[three.shard_of(mine) == 2]
    staying = mine[three.shard_of(mine) == 0]
    list(source.begin_handover(three))
    source.update("user", moving[:5], torch.ones(5, 4))  # brought in from disk, changed
    for batch in staying.split(40):  # every one of the five demoted again
        source.lookup("user", batch, train=True)
    assert source.stats()["user"]["rows"] <= config.capacity
    _, changes = source.handover_changes()
    (change,) = [table for c in changes for table in c.tables]
    assert change.removed.numel() == 0
    assert torch.equal(torch.sort(change.rows["ids"])[0], torch.sort(moving[:5])[0])
    assert torch.equal(change.rows["weights"].float(), source.lookup("user", change.rows["ids"], train=False))
    assert change.rows["state"].abs().sum() > 0  # Adam's moments of the update


@pytest.mark.usefixtures("disk_tier_kernels")
def test_a_disk_segment_cut_short_during_the_copy_fails_the_handover_naming_it(tmp_path):
    from lightning_persia.remote_ps.store.disk.tier import DiskTierError

    source = _disk_stores(tmp_path, 2, DISK_TABLES[:1])[0]
    ids = torch.arange(0, 4000)
    for batch in ids[ShardMap.uniform(2).shard_of(ids) == 0].split(40):
        source.lookup("user", batch, train=True)
    rows = source.begin_handover(ShardMap.uniform(2).resized(3))
    (segment,) = (tmp_path / "tiers").glob("shard-*/user.*/segment-000000.rows")
    os.truncate(segment, 100)
    with pytest.raises(DiskTierError, match=r"table 'user' could not be read at its point: disk segment .*segment-000000.rows ends before"):
        list(rows)
    source.abort_handover()
    assert source.handover is None


def test_concurrent_updates_during_a_handover_are_applied_once_each():
    """Updates from two threads while the slots move: integer gradients under SGD(lr=1) sum exactly in any order,
    so the rows must equal the sum of every update sent, once."""
    tables = (TableConfig("t", 2, optimizer=SGD(lr=1.0), init=Constant(0.0)),)
    stores = _stores(2, tables)
    cluster_lock = threading.Lock()
    cluster = Cluster(stores)
    ids = torch.arange(0, 2000)
    cluster.lookup("t", ids, train=True)  # updates change only rows that exist
    expected = torch.zeros(ids.numel(), 2)
    stop = threading.Event()

    def sender(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        while not stop.is_set():
            pick = torch.randperm(ids.numel(), generator=gen)[:50]
            grads = torch.randint(-3, 4, (50, 2), generator=gen).float()
            while True:
                with cluster_lock:  # the client's map is shared; the calls are not serialised by it
                    client = Cluster(cluster.stores)
                    client.map = cluster.map
                refused = client.update("t", ids[pick], grads)
                with cluster_lock:
                    cluster.map = max(cluster.map, client.map, key=lambda m: m.version)
                    expected[pick] -= grads
                    if refused is not None:
                        expected[pick[refused]] += grads[refused]
                if refused is None:
                    break
                pick, grads = pick[refused], grads[refused]

    threads = [threading.Thread(target=sender, args=(s,)) for s in (1, 2)]
    for thread in threads:
        thread.start()
    three = ShardMap.uniform(2).resized(3)
    stores.append(ShardStore(2, 3, seed=7))
    stores[2].configure(tables[0])
    _move(stores, three, lambda: threading.Event().wait(0.02))
    _move(stores, three.resized(2), lambda: threading.Event().wait(0.02))
    stop.set()
    for thread in threads:
        thread.join()
    final = Cluster(stores)
    final.map = three.resized(2)
    assert torch.equal(final.lookup("t", ids, train=False), expected)


def test_handover_refusals_name_the_problem():
    store = _stores(2)[0]
    with pytest.raises(InvalidRequestError, match="not newer than this shard's 0"):
        store.begin_handover(ShardMap.uniform(2))
    with pytest.raises(InvalidRequestError, match="no handover is under way"):
        store.fence_handover()
    rows = store.begin_handover(ShardMap.uniform(2).resized(3))
    with pytest.raises(InvalidRequestError, match="a handover to shard map version 1 is under way"):
        store.begin_handover(ShardMap.uniform(2).resized(3))
    with pytest.raises(InvalidRequestError, match="finishes once fenced"):
        store.finish_handover()
    list(rows)
    store.abort_handover()
    with pytest.raises(InvalidRequestError, match="older than or differs"):
        store.adopt_map(ShardMap(tuple([1, 0] * 2048), 0))  # version 0, another map


@pytest.mark.parametrize("storage", ["memory", "disk"])
@pytest.mark.parametrize("save_between", [False, True], ids=["replayed", "saved-then-replayed"])
def test_a_restarted_shard_keeps_the_map_it_adopted_and_the_rows_it_took(tmp_path, save_between, storage, request, monkeypatch):
    """The log holds the map (MAP records, and each segment's OPEN) and the rows taken over: a taker and a source
    restarted after a move route and hold exactly what they did (a disk table: in memory and on disk, the source
    none of the rows it handed over in either tier, dropped in several logged removals)."""
    from lightning_persia.remote_ps.store import handover
    from lightning_persia.remote_ps.store.wal import open_shard_log

    monkeypatch.setattr(handover, "_DROPPED_A_RECORD", 100)

    tables, batch = (TABLES, 3000) if storage == "memory" else (DISK_TABLES, 40)
    if storage == "disk":
        request.getfixturevalue("disk_tier_kernels")

    def start(index: int, num_shards: int, incarnation: str) -> ShardStore:
        store = ShardStore(index, num_shards, seed=7, disk_dir=str(tmp_path / "tiers"), demotion_interval_s=None)
        store.log = open_shard_log(store, str(tmp_path / f"wal-{index}"), "log", incarnation, None, window=64)
        return store

    stores = [start(0, 2, "a"), start(1, 2, "a")]
    for store in stores:
        for config in tables:
            store.configure(config)
    cluster = Cluster(stores)
    ids = torch.arange(0, 3000) * 104729
    generator = torch.Generator().manual_seed(1)
    for table in ("user", "item"):
        for part in ids.split(batch):
            cluster.lookup(table, part, train=True)
            cluster.update(table, part, torch.randn(part.numel(), 4 if table == "user" else 2, generator=generator))
    stores.append(start(2, 3, "a"))
    three = ShardMap.uniform(2).resized(3)
    _move(stores, three, lambda: None)
    before = {table: _rows(Cluster(stores), table, ids) for table in ("user", "item")}
    if save_between:
        for store in stores:
            store.save(str(tmp_path / "ckpt"))
    for store in stores:
        store.log.close()
    restarted = [start(i, 3 if i == 2 else 2, "b") for i in range(3)]
    assert all(store.shard_map == three for store in restarted)
    after = Cluster(restarted)
    for table in ("user", "item"):
        assert torch.equal(_rows(after, table, ids), before[table]), table
        held = [s.stats()[table]["rows"] + s.stats()[table]["disk_rows"] for s in restarted]
        assert held == [int((three.shard_of(ids) == i).sum()) for i in range(3)], (table, held)
        if storage == "disk":
            assert all(s.stats()[table]["disk_rows"] > s.stats()[table]["rows"] for s in restarted)


@pytest.mark.parametrize("save_between", [False, True], ids=["replayed", "saved-then-replayed"])
def test_a_source_restarted_fenced_comes_back_fenced_until_the_move_is_settled(tmp_path, save_between):
    """The fence is in the log (its own record, and every later segment's OPEN): a source restarted before its move
    ended refuses the moving slots, cannot give changes it no longer knows, and settles either way; the settling is
    in the log too."""
    from lightning_persia.remote_ps.store.wal import open_shard_log

    def start(incarnation: str) -> ShardStore:
        store = ShardStore(0, 2, seed=7)
        store.log = open_shard_log(store, str(tmp_path / "wal"), "log", incarnation, None, window=64)
        return store

    source = start("a")
    source.configure(TABLES[0])
    ids = torch.arange(0, 2000) * 104729
    mine = ids[ShardMap.uniform(2).shard_of(ids) == 0]
    source.lookup("user", mine, train=True)
    three = ShardMap.uniform(2).resized(3)
    moving = mine[three.shard_of(mine) == 2]
    list(source.begin_handover(three, ["a:1", "b:1", "c:1"]))
    source.fence_handover()
    if save_between:
        source.save(str(tmp_path / "ckpt"))  # a new segment: its OPEN carries the fence
    source.log.close()

    restarted = start("b")
    assert restarted.fence == {"to_map": three.to_dict(), "addresses": ["a:1", "b:1", "c:1"]}
    assert restarted.handover.takers == [2] and restarted.handover.sources == [0, 1]
    with pytest.raises(SlotsMovingError):
        restarted.lookup("user", moving[:3], train=False)
    with pytest.raises(InvalidRequestError, match="restarted during the move"):
        restarted.handover_changes()
    assert restarted.abort_handover(three) == 0  # rolled back: the slots are served again
    assert restarted.lookup("user", moving[:3], train=False).shape == (3, 4)
    restarted.log.close()
    again = start("c")
    assert again.fence is None and again.handover is None and again.shard_map.version == 0
    again.log.close()


def test_a_taker_that_gave_a_move_up_never_adopts_it_until_a_coordinator_starts_over():
    taker = ShardStore(0, 3, seed=7)
    two = ShardMap.uniform(3).resized(2)  # shard 0 takes some of shard 2's slots
    assert taker.abort_handover(two) == 0  # not adopted: from now on refused
    with pytest.raises(InvalidRequestError, match="rolled back on this shard"):
        taker.adopt_map(two)
    with pytest.raises(InvalidRequestError, match="rolled back on this shard"):
        taker.take_changes([], [], two)
    taker.forget_given_up()
    taker.adopt_map(two)
    assert taker.abort_handover(two) == 1  # adopted: the answer says the move went through, and nothing changes
    assert taker.shard_map == two


def test_a_handover_deadline_must_be_positive():
    from lightning_persia.remote_ps.config import ConfigError, PSConfig

    with pytest.raises(ConfigError, match="handover_deadline_s must be > 0, got 0"):
        PSConfig(handover_deadline_s=0)
