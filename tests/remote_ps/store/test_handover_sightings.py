"""Sightings of ids not admitted yet (``admit_after``) move with their slots: the counting filter's counters are split by
slot, and a handover ships its moving slots' counters once fenced, which the taker merges by the larger count."""
import pytest
import torch

from lightning_persia.ops.shard_map import SLOTS, ShardMap
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.admission import CountingFilter
from lightning_persia.remote_ps.store.errors import InvalidRequestError
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.store.wal.changes import Change, TableChange
from lightning_persia.remote_ps.table_config import TableConfig

AFTER = 3
UNIVERSE = torch.arange(0, 3000) * 7919 - 5


def test_a_filter_hands_over_its_slots_counters_and_merges_by_the_larger_count():
    giver, taker = CountingFilter(SLOTS * 8), CountingFilter(SLOTS * 8)
    ids = torch.tensor([11, 12, 13])
    giver.add(ids)
    giver.add(ids[:2])
    taker.add(ids[2:])
    slots = torch.arange(SLOTS)
    taker.merge(slots, giver.counters(slots))
    assert taker.add(ids).tolist() == [3, 3, 2]  # the giver's 2, 2, 1 sightings, and the taker's 1 of id 13
    assert giver.counters(torch.tensor([5, 9])).shape == (2, 8)


def test_a_filter_refuses_a_width_and_counters_that_do_not_fit_its_slots():
    with pytest.raises(ValueError, match="multiple of the 4096 routing slots"):
        CountingFilter(SLOTS + 1)
    counts = CountingFilter(SLOTS * 4)
    with pytest.raises(ValueError, match=r"uint8 \[2, 4\], got torch.uint8 \[2, 8\]"):
        counts.merge(torch.tensor([1, 2]), torch.zeros(2, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="slots are in 0..4095"):
        counts.merge(torch.tensor([SLOTS]), torch.zeros(1, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="the slots repeat"):
        counts.merge(torch.tensor([3, 3]), torch.zeros(2, 4, dtype=torch.uint8))


def _store(tmp_path, storage: str, index: int, total: int) -> ShardStore:
    disk = {"disk_dir": str(tmp_path / "tiers"), "demotion_interval_s": None} if storage == "disk" else {}
    store = ShardStore(index, total, seed=3, **disk)
    store.configure(TableConfig("t", 4, admit_after=AFTER, storage=storage, capacity=10_000))
    return store


def _sight(stores: list[ShardStore], ids: torch.Tensor) -> None:
    """One training lookup of ``ids`` on the shards that own them."""
    owners = stores[0].shard_map.shard_of(ids)
    for store in stores:
        mine = ids[owners == store.shard_index]
        if mine.numel():
            store.lookup_many([("t", mine)], train=True)


def _rows(stores: list[ShardStore]) -> int:
    return sum(store.stats()["t"]["rows"] for store in stores)


def _move(stores: list[ShardStore], to_map: ShardMap) -> None:
    """Every step of a handover of the slots ``to_map`` moves, as the coordinator runs them."""
    current = stores[0].shard_map
    sources = [s for s in stores if any(o == s.shard_index != n for o, n in zip(current.owners, to_map.owners))]
    takers = [s for s in stores if s not in sources]
    for source in sources:
        for config, step, rows in source.begin_handover(to_map):
            for taker in takers:
                taker.take_changes([config], [Change([TableChange(config.name, step, rows=rows)])] if rows else [], to_map)
        source.fence_handover()
        configs, changes = source.handover_changes()
        blocks = list(source.handover_sightings())
        assert blocks, "a table that counts sightings ships them"
        for taker in takers:
            taker.take_changes(configs, changes, to_map)
            for name, slots, counters in blocks:
                taker.take_sightings(name, slots, counters, to_map)
    for taker in takers:
        taker.adopt_map(to_map)
    for source in sources:
        source.finish_handover()


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_an_id_sighted_short_of_admission_on_the_giver_is_admitted_at_its_first_sighting_on_the_taker(tmp_path, storage, request):
    if storage == "disk":
        request.getfixturevalue("disk_tier_kernels")
    stores = [_store(tmp_path, storage, i, 2) for i in range(2)]
    for _ in range(AFTER - 1):
        _sight(stores, UNIVERSE)
    _sight(stores, UNIVERSE + 1)  # one sighting short of that
    assert _rows(stores) == 0
    stores.append(_store(tmp_path, storage, 2, 3))
    to_map = stores[0].shard_map.resized(3)
    _move(stores, to_map)
    moved = UNIVERSE[to_map.shard_of(UNIVERSE) == 2]
    assert moved.numel() > 500
    stores[2].lookup_many([("t", moved)], train=True)
    assert stores[2].stats()["t"]["rows"] == moved.numel()  # the giver's sightings, and this one
    once = (UNIVERSE + 1)[to_map.shard_of(UNIVERSE + 1) == 2]
    stores[2].lookup_many([("t", once)], train=True)
    assert stores[2].stats()["t"]["rows"] == moved.numel()  # the giver's one sighting, and this one: two
    stores[2].lookup_many([("t", once)], train=True)
    assert stores[2].stats()["t"]["rows"] == moved.numel() + once.numel()


def test_a_drain_leaves_the_ids_of_slots_that_stay_to_their_own_sightings():
    """3 -> 2: the takers own slots of their own, whose ids seen once before the move are admitted at their third
    sighting, as without it; the moving ids at their first sighting on their taker."""
    stores = [_store(None, "memory", i, 3) for i in range(3)]
    to_map = stores[0].shard_map.resized(2)
    owners = stores[0].shard_map.shard_of(UNIVERSE)
    moving, staying = UNIVERSE[owners == 2], UNIVERSE[owners != 2]
    for _ in range(AFTER - 1):
        _sight(stores, moving)
    _sight(stores, staying)
    _move(stores, to_map)
    _sight(stores, staying)
    assert _rows(stores) == 0
    _sight(stores, moving)
    assert _rows(stores) == moving.numel()
    _sight(stores, staying)
    assert _rows(stores) == UNIVERSE.numel()


def test_a_merge_changes_no_counter_of_the_slots_that_stay():
    """Whole filters merged would raise the counters the giver's ids share with the taker's; split by slot, the
    taker's other slots keep exactly the counts they had."""
    config = TableConfig("t", 4, admit_after=AFTER)
    giver, taker = Table(config, seed=0), Table(config, seed=0)
    for _ in range(AFTER - 1):
        giver.lookup(UNIVERSE, train=True)
    taker.lookup(UNIVERSE + 1, train=True)
    moving = torch.arange(0, SLOTS, 3)
    staying = torch.tensor([s for s in range(SLOTS) if s % 3])
    before, had = taker.sightings(staying), taker.sightings(moving)
    taker.merge_sightings(moving, giver.sightings(moving))
    assert torch.equal(taker.sightings(staying), before)
    assert torch.equal(taker.sightings(moving), torch.maximum(had, giver.sightings(moving)))
    assert int(taker.sightings(moving).sum()) > int(had.sum())


def test_sightings_move_once_fenced_and_a_taker_refuses_ones_that_do_not_fit():
    stores = [_store(None, "memory", i, 2) for i in range(2)] + [_store(None, "memory", 2, 3)]
    to_map = stores[0].shard_map.resized(3)
    list(stores[0].begin_handover(to_map))
    with pytest.raises(InvalidRequestError, match="once fenced"):
        stores[0].handover_sightings()
    with pytest.raises(InvalidRequestError, match="do not fit its filter"):
        stores[2].take_sightings("t", torch.tensor([2]), torch.zeros(1, 7, dtype=torch.uint8), to_map)
    with pytest.raises(InvalidRequestError, match="outside 0..4095"):
        stores[2].take_sightings("t", torch.tensor([SLOTS]), torch.zeros(1, 7, dtype=torch.uint8), to_map)
