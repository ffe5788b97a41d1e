"""What a giving shard drops when a handover ends: the rows it handed over, remembered, without reading every row's
slot again; and every row of a slot it does not own where it cannot know them (a restart, rows taken for a move
given up without it)."""
import pytest
import torch

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.wal.changes import Change, TableChange
from lightning_persia.remote_ps.table_config import SGD, Constant, TableConfig
from tests.remote_ps.checkpoint_rows import saved_rows
from tests.remote_ps.store.test_slot_moves import Cluster, _move

UNIVERSE = torch.arange(0, 1500) * 7919 - 3000


def _held(tmp_path, store: ShardStore, name: str) -> dict[str, torch.Tensor]:
    """``{field: values}`` of every row ``store`` holds (in memory or on disk), in the order of their ids: its
    checkpoint, completed by empty shards'."""
    store.save(str(tmp_path / name))
    for index in range(store.num_shards):
        if index != store.shard_index:
            empty = ShardStore(index, store.num_shards, seed=7, disk_dir=str(tmp_path / f"{name}-tiers"))
            empty.configure(store.describe("t"))
            empty.save(str(tmp_path / name))
    return saved_rows(tmp_path / name, fields=("ids", "weights"))["t"]


def _started(tmp_path, index: int, num_shards: int) -> ShardStore:
    return ShardStore(index, num_shards, seed=7, disk_dir=str(tmp_path / "tiers"), demotion_interval_s=None)


class SweepCount:
    """Counts the handovers' reads of every row's slot (``_drop_foreign_rows``), which still run."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        sweep = ShardStore._drop_foreign_rows

        def counted(store, table):
            self.calls += 1
            return sweep(store, table)

        monkeypatch.setattr(ShardStore, "_drop_foreign_rows", counted)


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_a_later_wave_drops_exactly_the_rows_it_handed_over_without_reading_every_slot(tmp_path, storage, monkeypatch, request):
    """A source's first wave reads every row's slot (a fresh shard cannot know what it holds); its second drops the
    rows it remembers handing over: those of the point, the rows written during the rounds (new ones in the moving
    slots), and none of the others, though requests evicted (memory) or demoted to disk (disk) rows meanwhile."""
    if storage == "disk":
        request.getfixturevalue("disk_tier_kernels")
    config = TableConfig("t", 2, optimizer=SGD(lr=1.0), init=Constant(0.0), capacity=300, storage=storage)
    stores = [_started(tmp_path, i, 2) for i in range(2)]
    for store in stores:
        store.configure(config)
    cluster = Cluster(stores)
    for part in UNIVERSE.split(200):  # 750 ids a shard, 300 in memory: evicted, or on disk
        cluster.lookup("t", part, train=True)
        cluster.update("t", part, torch.ones(part.numel(), 2))
    stores.append(_started(tmp_path, 2, 3))
    first, second = ShardMap.uniform(2).waves(3, 300)[:2]
    sweeps = SweepCount(monkeypatch)
    _move(stores, first, lambda: None)
    assert sweeps.calls == 1  # the first wave's source (one table)

    (index,) = {was for was, _ in first.moves(second).values()}  # a wave takes one source's slots
    source, taker = stores[index], stores[2]
    moving = lambda ids: (first.shard_of(ids) == index) & (second.shard_of(ids) != index)  # noqa: E731
    for config_, step, rows in source.begin_handover(second):
        taker.take_changes([config_], [Change([TableChange(config_.name, step, rows=rows)])], second)
    fresh = torch.arange(1, 20_000) * 7919 + 1
    cluster.lookup("t", fresh[first.shard_of(fresh) == index][:200], train=True)  # evicts, or demotes, others
    cluster.lookup("t", fresh[moving(fresh)][:60], train=True)  # new rows of the moving slots
    taker.take_changes(*source.handover_changes(), second)
    source.fence_handover()
    taker.take_changes(*source.handover_changes(), second)
    before = _held(tmp_path, source, "before")
    for store in stores:
        if store is not source:
            store.adopt_map(second)
    source.finish_handover()

    assert sweeps.calls == 1  # the second wave read no slot of a row it did not hand over
    after, taken = _held(tmp_path, source, "after"), _held(tmp_path, taker, "taken")
    handed = moving(before["ids"])
    assert handed.sum() > 60  # the point's rows kept and the new ones
    for field in ("ids", "weights"):
        assert torch.equal(after[field], before[field][~handed]), field
    mine = second.shard_of(taken["ids"]) == 2
    assert mine.all()
    at_second = first.shard_of(taken["ids"]) == index
    for field in ("ids", "weights"):
        assert torch.equal(taken[field][at_second], before[field][handed]), field


def _moved(shard_map: ShardMap, version: int, giver: int, taker: int, residue: int) -> ShardMap:
    """``shard_map`` with ``giver``'s slots ``== residue`` (mod 8) given to ``taker``, as version ``version``."""
    return ShardMap(tuple(taker if owner == giver and slot % 8 == residue else owner
                          for slot, owner in enumerate(shard_map.owners)), version)


def test_rows_taken_for_a_move_given_up_unheard_are_dropped_at_the_next_handovers_end(tmp_path, monkeypatch):
    """A taker that never heard that a move to it was given up keeps the rows it took for slots it does not own; the
    next handover it gives slots in ends by reading every row's slot, and drops them."""
    config = TableConfig("t", 2, optimizer=SGD(lr=1.0), init=Constant(0.0))
    stores = [_started(tmp_path, i, 2) for i in range(2)]
    for store in stores:
        store.configure(config)
    Cluster(stores).lookup("t", UNIVERSE, train=True)
    first = _moved(ShardMap.uniform(2), 1, giver=1, taker=0, residue=1)
    _move(stores, first, lambda: None)  # shard 1's first handover: it reads every row's slot
    given_up = _moved(first, 2, giver=0, taker=1, residue=2)
    for config_, step, rows in stores[0].begin_handover(given_up):
        stores[1].take_changes([config_], [Change([TableChange(config_.name, step, rows=rows)])], given_up)
    stores[0].abort_handover(given_up)  # shard 1 is not told
    assert (first.shard_of(_held(tmp_path, stores[1], "left")["ids"]) == 0).any()  # never served here

    sweeps = SweepCount(monkeypatch)
    last = _moved(first, 3, giver=1, taker=0, residue=3)
    _move(stores, last, lambda: None)
    assert sweeps.calls == 1
    for store in stores:
        ids = _held(tmp_path, store, f"after-{store.shard_index}")["ids"]
        assert (last.shard_of(ids) == store.shard_index).all(), store.shard_index
    assert sum(_held(tmp_path, s, f"all-{s.shard_index}")["ids"].numel() for s in stores) == UNIVERSE.numel()
