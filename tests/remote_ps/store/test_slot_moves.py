"""Slots moving between live stores: a random stream of lookups and updates, interleaved with the steps of handovers
(2 -> 3 -> 2 shards), against one store that never moved, compared row for row, bit for bit."""
import random
import threading

import pytest
import torch

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.errors import InvalidRequestError
from lightning_persia.remote_ps.store.slot_moves import MapMovedError, SlotsMovingError
from lightning_persia.remote_ps.store.wal.changes import Change, TableChange
from lightning_persia.remote_ps.table_config import SGD, Adam, Constant, TableConfig

TABLES = (TableConfig("user", 4, optimizer=Adam(lr=0.05)), TableConfig("item", 2, optimizer=Adam(lr=0.1)))  # no capacity: evictions depend on which rows share a shard


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
        page = []
        for config, step, rows in source.begin_handover(to_map):
            page.append(Change([TableChange(config.name, step, rows=rows)]))
            if len(page) == page_blocks:
                for target in targets:
                    target.take_changes(list(TABLES), page, to_map)
                page = []
            between()
        for target in targets:
            target.take_changes(list(TABLES), page, to_map)
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


# in one move, rows in one chunk a table; and in waves of 300 slots, rows in several chunks of 1,024 going over three
# blocks a page (a block's buffers are reused two chunks on: a page must hold copies)
@pytest.mark.parametrize("seed, many_chunks", [*((seed, False) for seed in range(6)), (0, True), (1, True)])
def test_handovers_2_3_2_under_requests_keep_every_row_bit_for_bit(seed, many_chunks, request):
    rng = random.Random(seed)
    universe = torch.arange(0, 16_000 if many_chunks else 900) * 7919 - 3000
    wave_slots, page_blocks = (300, 3) if many_chunks else (4096, 1)
    if many_chunks:
        request.getfixturevalue("small_chunks")
    model = _stores(1)[0]
    cluster = Cluster(_stores(2))
    retry = []  # updates refused while their slots moved: the client sends them again

    def requests(count: int) -> None:
        for _ in range(count):
            table = rng.choice(("user", "item"))
            dim = 4 if table == "user" else 2
            ids = universe[torch.randperm(universe.numel(), generator=torch.Generator().manual_seed(rng.getrandbits(31)))[: rng.randint(1, 120)]]
            if rng.random() < 0.5:
                try:
                    found = cluster.lookup(table, ids, train=True)
                except PartlyRefused as partly:  # the client looks the refused ids up again later
                    done = torch.ones(ids.numel(), dtype=torch.bool)
                    done[partly.refused] = False
                    retry.append((table, ids[partly.refused], None))
                    ids, found = ids[done], partly.rows[done]
                assert torch.equal(found, model.lookup_many([(table, ids)], True)[0])
            else:
                grads = torch.randn(ids.numel(), dim, generator=torch.Generator().manual_seed(rng.getrandbits(31)))
                refused = cluster.update(table, ids, grads)
                applied = torch.ones(ids.numel(), dtype=torch.bool)
                if refused is not None:
                    applied[refused] = False
                    retry.append((table, ids[refused], grads[refused]))
                if applied.any():
                    model.update_many([(table, ids[applied], grads[applied])])

    def flush_retries() -> None:
        while retry:
            table, ids, grads = retry.pop(0)
            if grads is None:
                assert torch.equal(cluster.lookup(table, ids, train=True), model.lookup_many([(table, ids)], True)[0])
                continue
            assert cluster.update(table, ids, grads) is None
            model.update_many([(table, ids, grads)])

    if many_chunks:  # over three chunks of rows per table and shard
        for table in ("user", "item"):
            assert torch.equal(cluster.lookup(table, universe, train=True), model.lookup_many([(table, universe)], True)[0])
    requests(40)
    cluster.stores.append(ShardStore(2, 3, seed=7))  # a new shard: no request reaches it before it adopts the map
    for wave in cluster.stores[0].shard_map.waves(3, wave_slots):
        _move(cluster.stores, wave, lambda: requests(rng.randint(0, 6)), page_blocks)
    flush_retries()
    requests(40)
    for wave in cluster.stores[0].shard_map.waves(2, wave_slots):
        _move(cluster.stores, wave, lambda: requests(rng.randint(0, 6)), page_blocks)
    flush_retries()
    requests(20)
    for table in ("user", "item"):
        assert torch.equal(_rows(cluster, table, universe), _rows(model, table, universe)), f"seed {seed}, table {table}"
        held = [store.stats()[table]["rows"] for store in cluster.stores]
        assert held[2] == 0 and sum(held) == model.stats()[table]["rows"], (seed, table, held)


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


def test_handover_refusals_name_the_problem(tmp_path):
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
    disk = ShardStore(0, 2, disk_dir=str(tmp_path))
    disk.configure(TableConfig("d", 2, storage="disk"))
    with pytest.raises(InvalidRequestError, match=r"tables \['d'\] keep rows on disk"):
        disk.begin_handover(ShardMap.uniform(2).resized(3))


@pytest.mark.parametrize("save_between", [False, True], ids=["replayed", "saved-then-replayed"])
def test_a_restarted_shard_keeps_the_map_it_adopted_and_the_rows_it_took(tmp_path, save_between):
    """The log holds the map (MAP records, and each segment's OPEN) and the rows taken over: a taker and a source
    restarted after a move route and hold exactly what they did."""
    from lightning_persia.remote_ps.store.wal import open_shard_log

    def start(index: int, num_shards: int, incarnation: str) -> ShardStore:
        store = ShardStore(index, num_shards, seed=7)
        store.log = open_shard_log(store, str(tmp_path / f"wal-{index}"), "log", incarnation, None, window=64)
        return store

    stores = [start(0, 2, "a"), start(1, 2, "a")]
    for store in stores:
        for config in TABLES:
            store.configure(config)
    cluster = Cluster(stores)
    ids = torch.arange(0, 3000) * 104729
    for table in ("user", "item"):
        cluster.lookup(table, ids, train=True)
        cluster.update(table, ids, torch.randn(ids.numel(), 4 if table == "user" else 2, generator=torch.Generator().manual_seed(1)))
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
        assert [s.stats()[table]["rows"] for s in restarted] == [int((three.shard_of(ids) == i).sum()) for i in range(3)]


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
