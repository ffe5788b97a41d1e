"""The shard map: ids to slots by a fixed hash, slots to shards by a versioned map that moves few slots when resized."""
import pytest
import torch

from lightning_persia.ops.shard_map import SLOTS, ShardMap, shard_of


def test_shard_of_is_stable_and_balanced():
    ids = torch.arange(100_000)
    shards = shard_of(ids, 3)
    assert shards.min() >= 0 and shards.max() < 3
    counts = torch.bincount(shards, minlength=3).float()
    assert (counts / counts.mean() - 1).abs().max() < 0.02
    # pinned values: a change of the hash or of the uniform map would silently re-shard every checkpoint and log
    assert shard_of(torch.tensor([0, 1, 2, 3, 42, -5, 2**40]), 7).tolist() == [0, 4, 6, 4, 5, 4, 4]


def _rows_moved(before: ShardMap, after: ShardMap, ids: torch.Tensor) -> float:
    return float((before.shard_of(ids) != after.shard_of(ids)).float().mean())


@pytest.mark.parametrize("start,end", [(1, 2), (2, 3), (3, 4), (3, 2), (4, 3), (2, 5), (8, 9), (9, 8)])
def test_resizing_moves_about_the_ideal_share_of_rows_and_balances(start, end):
    ids = torch.randint(-(2**62), 2**62, (200_000,), generator=torch.Generator().manual_seed(start * 10 + end))
    before = ShardMap.uniform(start)
    after = before.resized(end)
    assert after.version == before.version + 1 and after.num_shards == end
    held = torch.bincount(after.table, minlength=end)
    assert int(held.max() - held.min()) <= 1  # every shard SLOTS // end slots or one more
    ideal = abs(end - start) / max(start, end)
    moved = _rows_moved(before, after, ids)
    assert moved <= 1.05 * ideal + 0.005, (moved, ideal)
    # hash % n would have moved most rows
    assert _rows_moved(ShardMap.uniform(start), ShardMap.uniform(end), ids) > 0.4


def test_2_3_2_comes_back_to_an_even_map_and_every_slot_moves_to_or_from_the_new_shard():
    two = ShardMap.uniform(2)
    three = two.resized(3)
    moves = two.moves(three)
    assert {to for _, to in moves.values()} == {2} and len(moves) in (SLOTS // 3, SLOTS // 3 + 1)
    back = three.resized(2)
    assert back.version == 2 and set(back.owners) == {0, 1}
    assert {frm for frm, _ in three.moves(back).values()} == {2}  # only the removed shard's slots move


def test_a_map_travels_as_a_plain_dict_and_bad_ones_are_refused():
    resized = ShardMap.uniform(2).resized(3)
    assert ShardMap.from_dict(resized.to_dict()) == resized
    with pytest.raises(ValueError, match=f"owner of each of {SLOTS} slots, got 3"):
        ShardMap((0, 1, 0))
    with pytest.raises(ValueError, match=r"shards \[1\] own none"):
        ShardMap(tuple([0] * (SLOTS - 1) + [2]))
    with pytest.raises(ValueError, match="not a shard map"):
        ShardMap.from_dict({"owners": [0] * SLOTS})
    with pytest.raises(ValueError, match="num_shards must be >= 1, got 0"):
        ShardMap.uniform(2).resized(0)


def test_first_foreign_agrees_with_shard_of_on_a_resized_map():
    shard_map = ShardMap.uniform(2).resized(3)
    ids = torch.arange(-1000, 1000)
    owners = shard_map.shard_of(ids)
    for shard in range(3):
        assert shard_map.first_foreign(ids[owners == shard], shard) == -1
        assert shard_map.first_foreign(ids, shard) == int(torch.nonzero(owners != shard)[0, 0])


@pytest.mark.parametrize("start, end, wave_slots", [(2, 3, 100), (3, 2, 100), (2, 6, 3), (6, 2, 2), (4, 5, 4096), (3, 3, 10)])
def test_waves_move_resized_slots_each_once_in_steps_of_at_most_wave_slots(start, end, wave_slots):
    before = ShardMap.uniform(start).resized(start)  # version 1 (no slot moves): the waves count on from it
    waves = before.waves(end, wave_slots)
    target = before.resized(end)
    if not before.moves(target):
        assert waves == []
        return
    assert waves[-1].owners == target.owners
    assert [m.version for m in waves] == list(range(before.version + 1, before.version + 1 + len(waves)))
    moved = 0
    for was, now in zip([before, *waves], waves):
        step = was.moves(now)
        assert 0 < len(step) <= wave_slots
        assert all(now.owners[slot] == target.owners[slot] for slot in step)  # each slot moves once, to its end owner
        moved += len(step)
    assert moved == len(before.moves(target))
    bigger = max(start, end)
    if wave_slots >= abs(end - start):  # every map but the last spans the larger shard count
        assert all(m.num_shards == bigger for m in waves[:-1])


def test_a_grow_in_waves_starts_the_new_shard_with_few_slots_and_takes_one_source_at_a_time():
    waves = ShardMap.uniform(2).waves(3, 200)
    assert len(waves) == 7  # 1365 slots in steps of 200
    assert len(waves[0].slots_of(2)) == 200
    sources = [{was for was, _ in before.moves(after).values()} for before, after in zip([ShardMap.uniform(2), *waves], waves)]
    assert sum(len(s) == 1 for s in sources) >= len(waves) - 1  # only the step where one source's slots end has two


def test_waves_refuse_an_empty_step():
    with pytest.raises(ValueError, match="wave_slots must be >= 1"):
        ShardMap.uniform(2).waves(3, 0)
