"""The disk tier: its id map, records, segments and their mapping, compaction, faults (a full disk, a missing or damaged
segment); the table-level behaviour of its part is in test_part.py."""
import contextlib
import errno
import os
import threading

import pytest
import torch

from lightning_persia.remote_ps.store import thread_clock
from lightning_persia.remote_ps.store.chunked_rows import FieldSpec
from lightning_persia.remote_ps.store.disk import compaction, records as disk_records, segment_mapping, tier as disk_tier
from lightning_persia.remote_ps.store.disk.tier import DiskTier, DiskTierError
from lightning_persia.remote_ps.store.errors import StoreError
from lightning_persia.remote_ps.store.native import records as native_records
from lightning_persia.remote_ps.store.native.disk_map import DiskMap
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import Adagrad, ConfigError, TableConfig

pytestmark = pytest.mark.usefixtures("disk_tier_kernels")

DIM = 4


@pytest.fixture
def small_segments(monkeypatch):
    """Segments of 1,024 records, so that a few thousand rows span several."""
    monkeypatch.setattr(disk_tier, "SEGMENT_SHIFT", 10)
    monkeypatch.setattr(disk_tier, "SEGMENT_ROWS", 1 << 10)


def test_disk_map_moves_entries_in_place_and_a_save_keeps_the_points_slots():
    disk_map = DiskMap()
    ids = torch.unique(torch.randint(-(1 << 62), 1 << 62, (100_000,), generator=torch.Generator().manual_seed(2)))
    slots = torch.arange(ids.numel())
    disk_map.insert(ids, slots)
    disk_map.save_begin(boundary=ids.numel())
    copied = disk_map.save_part(0)  # a partition copied before the move: the move changes nothing of it
    to = slots[::2] + ids.numel()  # past the save's point, as compaction appends
    assert disk_map.move(ids[::2], slots[::2], to) == ids[::2].numel()
    assert disk_map.move(ids[1::2], slots[1::2] + 1, slots[1::2]) == 0  # no entry of those slots: nothing moved
    found = disk_map.find(ids)
    assert torch.equal(found[::2], to) and torch.equal(found[1::2], slots[1::2]) and disk_map.info()[0] == ids.numel()
    saved = [copied] + [disk_map.save_part(part) for part in range(1, DiskMap.PARTS)]
    disk_map.save_end()
    entries = torch.cat([part for part, _ in saved])
    at_point = (entries[entries != 0] & 0xFFFFFFFF) - 1
    assert torch.equal(torch.sort(at_point).values, slots) and sum(live for _, live in saved) == ids.numel()
    with pytest.raises(ValueError, match="slots"):
        disk_map.move(ids[:1], slots[:1], torch.tensor([-1]))


def _specs():
    return {"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float16, DIM), "state": FieldSpec(torch.float32, 1),
            "access": FieldSpec(torch.int32)}


def _rows(ids):
    n = ids.numel()
    return {"ids": ids, "weights": ids[:, None].float().expand(n, DIM) / 1024, "state": torch.ones(n, 1),
            "access": torch.full((n,), 3, dtype=torch.int32)}


def _table(tmp_path, capacity=1000, **kwargs):
    config = TableConfig("t", DIM, optimizer=Adagrad(rowwise=True), capacity=capacity, storage="disk", storage_dtype="fp16", **kwargs)
    return Table(config, seed=0, disk_dir=str(tmp_path / "tier"))


def test_disk_map_finds_removes_and_grows():
    disk_map = DiskMap()
    ids = torch.unique(torch.randint(-(1 << 62), 1 << 62, (200_000,), generator=torch.Generator().manual_seed(1)))
    slots = torch.arange(ids.numel())
    disk_map.insert(ids, slots)
    assert disk_map.info()[0] == ids.numel()
    assert torch.equal(disk_map.find(ids), slots)
    assert disk_map.remove(ids[::2], slots[::2]) == ids[::2].numel()
    found = disk_map.find(ids)
    assert bool((found[::2] == -1).all()) and torch.equal(found[1::2], slots[1::2])
    assert disk_map.remove(ids[::2], slots[::2]) == 0  # gone already
    with pytest.raises(ValueError, match="slots"):
        disk_map.insert(ids[:1], torch.tensor([-1]))


def test_disk_map_removals_in_rounds_keep_every_other_entry_findable():
    """Entries shifted back into the holes removals leave, over partitions' wrapped ends, and inserted again."""
    generator = torch.Generator().manual_seed(2)
    disk_map = DiskMap()
    ids = torch.unique(torch.randint(-(1 << 62), 1 << 62, (100_000,), generator=generator))
    slots = torch.randperm(ids.numel(), generator=generator)
    disk_map.insert(ids, slots)
    present = torch.ones(ids.numel(), dtype=torch.bool)
    for _ in range(4):
        leaving = torch.nonzero(present & (torch.rand(ids.numel(), generator=generator) < 0.4)).squeeze(1)
        assert disk_map.remove(ids[leaving], slots[leaving]) == leaving.numel()
        present[leaving] = False
        back = leaving[: leaving.numel() // 2]
        disk_map.insert(ids[back], slots[back])
        present[back] = True
        assert torch.equal(disk_map.find(ids), torch.where(present, slots, -1))
        assert disk_map.info()[0] == int(present.sum())


def test_written_rows_read_back_and_taken_once(tmp_path, small_segments):
    tier = DiskTier(tmp_path / "tier", _specs())
    ids = torch.arange(2500) * 7 + 1  # three segments
    tier.write(_rows(ids))
    assert tier.rows == 2500
    probe = torch.cat([ids[[5, 1500, 2499]], torch.tensor([4])])  # 4 was never written
    slots, records = tier.find(probe)
    assert slots.tolist()[:3] == [5, 1500, 2499] and slots[3] == -1
    values = tier.unpack(records[:3])
    assert torch.equal(values["ids"], ids[[5, 1500, 2499]])
    assert torch.equal(values["weights"], _rows(ids[[5, 1500, 2499]])["weights"].half())
    found, taken = tier.take(probe)
    assert found.tolist() == [0, 1, 2] and torch.equal(taken["ids"], probe[:3])
    assert tier.rows == 2497
    assert tier.find(probe)[0].tolist() == [-1, -1, -1, -1]


def test_a_false_fingerprint_match_is_skipped(tmp_path):
    tier = DiskTier(tmp_path / "tier", _specs())
    tier.write(_rows(torch.tensor([10, 20])))
    # the map pointing 30 at 10's slot (as a fingerprint shared by two ids would): the record's id tells them apart
    tier._map.insert(torch.tensor([30]), torch.tensor([0]))
    slots, _ = tier.find(torch.tensor([30, 20]))
    assert slots.tolist() == [-1, 1]


def test_a_full_disk_changes_nothing_and_says_so(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path / "tier", _specs())
    tier.write(_rows(torch.arange(10)))

    def full(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_records.os, "pwrite", full)
    with pytest.raises(DiskTierError, match="could not write 5 rows: No space left on device .*stay in memory"):
        tier.write(_rows(torch.arange(100, 105)))
    monkeypatch.undo()
    assert tier.rows == 10 and tier.find(torch.arange(100, 105))[0].tolist() == [-1] * 5
    tier.write(_rows(torch.arange(100, 105)))  # once there is room again
    assert tier.find(torch.tensor([3, 104]))[0].tolist() == [3, 14]


def test_records_are_read_into_the_rows_named_and_live_bits_set_across_segments(tmp_path, small_segments):
    tier = DiskTier(tmp_path / "tier", _specs())
    ids = torch.arange(2500) * 7 + 1  # three segments
    tier.write(_rows(ids))
    fds = torch.tensor([os.open(tmp_path / "tier" / f"segment-{s:06d}.rows", os.O_RDONLY) for s in range(3)])
    none, reads = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    out = torch.zeros(4, tier.record_bytes, dtype=torch.uint8)
    native_records.read_records(fds, none, none, reads, 10, torch.tensor([5, 1500, 2499]), out, into=torch.tensor([3, 0, 1]))
    assert tier.unpack(out)["ids"].tolist() == [ids[1500], ids[2499], 0, ids[5]]  # row 2 named by no slot: left as it was
    assert reads.tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="into"):
        native_records.read_records(fds, none, none, reads, 10, torch.tensor([5]), out, into=torch.tensor([4]))
    for fd in fds.tolist():
        os.close(fd)
    pages = [torch.zeros(128, dtype=torch.uint8), torch.zeros(128, dtype=torch.uint8)]
    table = torch.tensor([pages[0].data_ptr(), 0, pages[1].data_ptr()])
    native_records.set_bits(table, 10, torch.tensor([3, 2048 + 9]), True)
    assert pages[0][0] == 8 and pages[1][1] == 2
    with pytest.raises(ValueError, match="slot 1030 has no bits"):  # segment 1 has none
        native_records.set_bits(table, 10, torch.tensor([4, 1030]), True)
    assert pages[0][0] == 8 | 16  # the slot before it was set
    got = native_records.get_bits(table, 10, torch.tensor([3, 4, 5, 2048 + 9, 2048 + 8, 1030, -1, 5000]))
    assert got.tolist() == [True, True, False, True, False, False, False, False]  # no page, or none: not set


def test_a_segment_deleted_under_a_running_tier_still_serves(tmp_path):
    table = _table(tmp_path, capacity=100)
    for batch in torch.arange(300).split(100):
        table.lookup(batch, train=True)
    before = table.lookup(torch.arange(100), train=False)
    for path in (tmp_path / "tier").glob("segment-*"):
        path.unlink()  # the open files keep their bytes until the tier lets them go
    assert torch.equal(table.lookup(torch.arange(100), train=False), before)


def test_a_damaged_segment_read_is_an_error_naming_the_tier(tmp_path):
    tier = DiskTier(tmp_path / "tier", _specs())
    tier.write(_rows(torch.arange(10)))
    os.ftruncate(tier._fds[0], 5 * tier.record_bytes)  # the file lost its tail
    with pytest.raises(DiskTierError, match=r"could not read: .*disk slot 7"):
        tier.find(torch.tensor([7]))
    assert tier.find(torch.tensor([2]))[0].tolist() == [2]  # the rows still there still read


def test_storage_settings_are_checked():
    with pytest.raises(ConfigError, match="storage must be one of"):
        TableConfig("t", 4, storage="ssd")
    with pytest.raises(StoreError, match="storage 'disk' but its shard has no disk folder"):
        Table(TableConfig("t", 4, storage="disk"), seed=0)


def test_segments_are_mapped_while_there_is_room_and_read_the_same(tmp_path, small_segments):
    tier = DiskTier(tmp_path / "tier", _specs())
    ids = torch.arange(3 * 1024 + 100) * 5 + 2  # three segments and a part of a fourth
    tier.write(_rows(ids))
    expected = tier.unpack(tier.find(ids)[1])
    while tier.map_step():
        pass
    assert tier.mapped_bytes == ids.numel() * tier.record_bytes
    mapped = tier.unpack(tier.find(ids)[1])
    assert all(torch.equal(mapped[name], expected[name]) for name in expected)
    more = torch.arange(200) * 5 + 3
    tier.write(_rows(more))  # the open segment grows: its new records are mapped by the next step
    assert tier.map_step() == 200 * tier.record_bytes
    assert torch.equal(tier.unpack(tier.find(more)[1])["ids"], more)


def test_past_the_budget_a_much_more_read_segment_takes_a_mapped_one_s_place(tmp_path, small_segments):
    tier = DiskTier(tmp_path / "tier", _specs(), mapped_bytes=1024 * _record_bytes())  # one segment's records
    ids = torch.arange(3 * 1024) * 5 + 2
    tier.write(_rows(ids))
    tier.find(ids)
    for _ in range(3):
        tier.find(ids[1024:2048])  # segment 1 read most
    assert tier.map_step() == 1024 * tier.record_bytes and tier.mapped_bytes == 1024 * tier.record_bytes
    assert tier.map_step() == 0  # segments 0 and 2 are read less than half as often: they wait
    for _ in range(20):
        tier.find(ids[2048:])  # segment 2 now read far more than segment 1: it takes its place
    assert tier.map_step() == 1024 * tier.record_bytes and tier.mapped_bytes == 1024 * tier.record_bytes
    assert torch.equal(tier.unpack(tier.find(ids)[1])["ids"], ids)


def test_a_budget_lowered_below_the_mapped_records_unmaps_the_least_read_segment_and_a_raised_one_maps_more(
        tmp_path, small_segments, monkeypatch):
    monkeypatch.setattr(segment_mapping, "_SHRINK_SLACK", 0)
    segment = 1024 * _record_bytes()
    tier = DiskTier(tmp_path / "tier", _specs(), mapped_bytes=3 * segment)
    ids = torch.arange(3 * 1024) * 5 + 2
    tier.write(_rows(ids))
    for _ in range(3):
        tier.find(ids[1024:])  # segments 1 and 2 read more than segment 0
    while tier.map_step():
        pass
    assert tier.mapped_bytes == 3 * segment
    tier.set_mapped_budget(2 * segment)
    assert tier.map_step() == 0 and tier.mapped_bytes == 2 * segment and tier.mapped_budget == 2 * segment
    assert tier.map_step() == 0 and tier.mapped_bytes == 2 * segment  # within the budget: nothing more is unmapped
    assert torch.equal(tier.unpack(tier.find(ids)[1])["ids"], ids)  # segment 0 is read with pread again
    tier.set_mapped_budget(3 * segment)
    assert tier.map_step() == segment and tier.mapped_bytes == 3 * segment


def test_a_budget_over_the_mapped_records_by_less_than_the_slack_unmaps_nothing(tmp_path, small_segments):
    tier = DiskTier(tmp_path / "tier", _specs())
    tier.write(_rows(torch.arange(2 * 1024)))
    while tier.map_step():
        pass
    mapped = tier.mapped_bytes
    tier.set_mapped_budget(mapped - 1)  # a budget that jitters below what is mapped
    assert tier.map_step() == 0 and tier.mapped_bytes == mapped


def test_a_budget_of_nothing_maps_nothing(tmp_path, small_segments):
    tier = DiskTier(tmp_path / "tier", _specs(), mapped_bytes=0)
    ids = torch.arange(2000) * 5 + 2
    tier.write(_rows(ids))
    tier.find(ids)
    assert tier.map_step() == 0 and tier.mapped_bytes == 0
    assert torch.equal(tier.unpack(tier.find(ids)[1])["ids"], ids)


def test_a_map_step_reads_its_pages_in_without_the_tables_lock_and_a_close_meanwhile_waits_for_it(tmp_path, small_segments, monkeypatch):
    lock = threading.Lock()
    tier = DiskTier(tmp_path / "tier", _specs(), lock)
    ids = torch.arange(2 * 1024) * 5 + 2
    tier.write(_rows(ids))
    held_while_populating, unmapped = [], []
    real_populate = segment_mapping.SegmentMapping.populate

    def populate(job):
        held_while_populating.append(lock.locked())
        with lock:  # a request (here: the close) gets the lock while the pages are read in
            if len(held_while_populating) == 2:
                tier.close()
                assert not unmapped  # the mapping stays until the step has published
        real_populate(job)

    monkeypatch.setattr(segment_mapping.SegmentMapping, "populate", staticmethod(populate))
    monkeypatch.setattr(native_records, "unmap_file", lambda address, nbytes: unmapped.append(address))
    assert tier.map_step() == 1024 * tier.record_bytes
    assert tier.map_step() == 0 and tier.closed  # closed during the step: published as unmapped
    assert held_while_populating == [False, False] and len(unmapped) == 2  # both segments' mappings ended
    assert tier.map_step() == 0


def _record_bytes():
    return sum(spec.row_bytes for spec in _specs().values())


def test_a_mapped_segment_that_shrank_is_an_error_not_a_crash(tmp_path):
    tier = DiskTier(tmp_path / "tier", _specs())
    tier.write(_rows(torch.arange(10)))
    tier.find(torch.arange(10))
    assert tier.map_step() > 0
    os.ftruncate(tier._fds[0], 5 * tier.record_bytes)
    with pytest.raises(DiskTierError, match=r"could not read: .*disk slot 7"):
        tier.find(torch.tensor([7]))
    assert tier.find(torch.tensor([2]))[0].tolist() == [2]


def _segment_files(tmp_path) -> list[str]:
    return sorted(path.name for path in (tmp_path / "tier").glob("segment-*.rows"))


def test_a_full_segment_mostly_garbage_is_compacted_then_deleted(tmp_path, small_segments):
    tier = DiskTier(tmp_path / "tier", _specs())
    ids = torch.arange(3000) * 7 + 1  # segments 0 and 1 full, 2 open
    tier.write(_rows(ids))
    tier.take(ids[:800])  # segment 0: 224 of its 1,024 records live
    tier.take(ids[1024:1424])  # segment 1: 624 live, above half: left alone while garbage is under COMPACT_ANY
    before = tier.disk_bytes
    assert tier.compact_step() == 224  # its live rows written anew at the end
    assert compaction.COMPACT_ANY == 1 / 5  # segment 0 deleted: 400 garbage records of 2,200 left, under it
    assert tier.compact_step() == 0  # nothing else below half
    assert _segment_files(tmp_path) == ["segment-000001.rows", "segment-000002.rows", "segment-000003.rows"]
    assert tier.disk_bytes < before and tier.rows == 3000 - 800 - 400
    kept = torch.cat([ids[800:1024], ids[1424:]])
    slots, records = tier.find(kept)
    assert bool((slots >= 0).all()) and torch.equal(tier.unpack(records)["weights"], _rows(kept)["weights"].half())
    assert bool((tier.find(ids[:800])[0] == -1).all())


def test_compaction_writes_into_segments_apart_from_the_demotions_and_a_save_seals_both(tmp_path, small_segments):
    lock = threading.Lock()
    tier = DiskTier(tmp_path / "tier", _specs(), lock)
    ids = torch.arange(3000) * 7 + 1  # segments 0 and 1 full, 2 open (952 records)
    tier.write(_rows(ids))
    tier.take(ids[:800])  # segment 0: 224 live
    assert tier.compact_step() == 224
    assert bool((tier.find(ids[800:1024])[0] >> 10 == 3).all())  # a segment of compaction's own
    demoted = torch.arange(5000, 5050) * 7 + 1
    tier.write(_rows(demoted))
    assert bool((tier.find(demoted)[0] >> 10 == 2).all())  # the demotions go on filling theirs
    tier.take(ids[800:1000])  # compaction's segment 3 the sparsest (24 live of 224), but open: not compacted
    tier.take(ids[1024:1424])  # segment 1: 624 live; 600 garbage records of 2,250, past COMPACT_ANY
    assert tier.compact_step() == 624
    assert bool((tier.find(ids[1424:2048])[0] >> 10 == 3).all())
    with lock:
        frozen = tier.freeze()
    after = torch.arange(6000, 6010) * 7 + 1
    tier.write(_rows(after))
    assert bool((tier.find(after)[0] >> 10 == 4).all())  # past every segment of the save's point
    assert tier.compact_step() > 0  # segment 3, sealed by the save, the sparsest now
    assert bool((tier.find(ids[1000:1024])[0] >> 10 == 5).all())  # into a segment of its own past the point too
    frozen.release()
    everything = torch.cat([ids[1000:1024], ids[1424:], demoted, after])
    slots, records = tier.find(everything)
    assert bool((slots >= 0).all()) and torch.equal(tier.unpack(records)["ids"], everything)
    assert tier.rows == everything.numel()


def test_a_sparse_segment_waits_until_the_tiers_garbage_passes_its_bound(tmp_path, small_segments):
    tier = DiskTier(tmp_path / "tier", _specs())
    ids = torch.arange(9300) * 7 + 1  # nine full segments, a tenth open
    tier.write(_rows(ids))
    tier.take(ids[:600])  # segment 0 below half live, but 600 of 9,300 records are garbage: under 1/8
    assert compaction.COMPACT_GARBAGE == 1 / 8 and tier.compact_step() == 0
    assert "segment-000000.rows" in _segment_files(tmp_path)
    tier.take(ids[1024:1724])  # 1,300 garbage records of 9,300: past the bound
    assert tier.compact_step() == 324  # the sparsest first: segment 1
    assert tier.compact_step() == 0  # segment 1 deleted: 600 garbage records of 8,600, under the bound again
    assert _segment_files(tmp_path)[:2] == ["segment-000000.rows", "segment-000002.rows"]
    kept = torch.cat([ids[600:1024], ids[1724:]])
    assert bool((tier.find(kept)[0] >= 0).all()) and tier.rows == kept.numel()


def test_past_its_bound_of_garbage_the_sparsest_segment_is_compacted_even_above_half_live(tmp_path, small_segments):
    tier = DiskTier(tmp_path / "tier", _specs())
    ids = torch.arange(5 * 1024 + 100) * 7 + 1  # five full segments, a sixth open
    tier.write(_rows(ids))
    for segment in (2, 0, 1):  # 450 garbage records in each of three (574 live: above half), 1,350 of 5,220
        tier.take(ids[segment * 1024 : segment * 1024 + 450])
    tier.take(ids[2 * 1024 + 450 : 2 * 1024 + 451])  # segment 2 the sparsest
    assert tier.compact_step() == 573  # past 1/5 garbage: segment 2 compacted, though above half live
    assert tier.compact_step() == 0  # deleted: 900 garbage records of 4,769, under 1/5 again; none below half
    assert "segment-000002.rows" not in _segment_files(tmp_path)
    assert tier.disk_bytes <= 1.25 * tier.rows * tier.record_bytes + 2 * 1024 * tier.record_bytes  # a segment or two aside
    kept = torch.cat([ids[450:1024], ids[1024 + 450 : 2048], ids[2048 + 451 :]])
    slots, records = tier.find(kept)
    assert bool((slots >= 0).all()) and torch.equal(tier.unpack(records)["weights"], _rows(kept)["weights"].half())


def test_a_compaction_steps_holds_of_the_lock_count_as_the_tables_disk_work(tmp_path, small_segments, monkeypatch):
    lock = threading.Lock()
    tier = DiskTier(tmp_path / "tier", _specs(), lock)
    ids = torch.arange(3000) * 7 + 1
    tier.write(_rows(ids))
    tier.take(ids[:800])
    held = []

    @contextlib.contextmanager
    def holding():
        held.append(lock.locked())
        yield

    assert tier.compact_step(holding) == 224 and held == [True, True]  # choosing, then moving; not the read between
    table = _table(tmp_path / "table", capacity=1000)
    for start in list(range(0, 4000, 500)) + list(range(0, 2000, 500)):  # rows in, out and in again: garbage
        table.lookup(torch.arange(start, start + 500), train=True)
    clock = iter(range(10**6))
    monkeypatch.setattr(thread_clock.time, "thread_time", lambda: 100.0 * next(clock))  # each reading 100 s on
    assert table.disk.compact() > 0
    assert table.stats()["worst_disk_work_of"] == "compaction" and table.stats()["worst_disk_work_cpu_s"] >= 100


@pytest.mark.parametrize("with_map", [True, False], ids=["a save", "a live move's point"])
def test_a_segment_is_deleted_only_once_no_read_or_save_needs_it(tmp_path, small_segments, with_map):
    lock = threading.Lock()
    tier = DiskTier(tmp_path / "tier", _specs(), lock)
    ids = torch.arange(2500) * 7 + 1
    tier.write(_rows(ids))
    tier.take(ids[:1000])
    with lock:
        ahead = tier.begin_read(torch.arange(2), ids[1000:1002])  # a lookup's read under way
        frozen = tier.freeze(with_map)  # and a save, or a move's point (which reads the segments, not the map)
    assert (frozen.id_map is not None) == with_map and frozen.rows == 1500
    point = torch.cat([tier.unpack(block)["ids"] for block in disk_records.live_records(frozen.files(), tier.record_bytes, 700)])
    assert torch.equal(point, ids[1000:]) and torch.equal(torch.cat(list(disk_records.live_ids(frozen.files()))), ids[1000:])
    assert tier.compact_step() == 24
    assert tier.compact_step() == 0 and "segment-000000.rows" in _segment_files(tmp_path)  # both still need it
    ahead.read()
    with lock:
        tier.end_read()
    tier.compact_step()
    assert "segment-000000.rows" in _segment_files(tmp_path)  # the save still does
    frozen.release()
    tier.compact_step()
    assert "segment-000000.rows" not in _segment_files(tmp_path)
    assert bool((tier.find(ids[1000:])[0] >= 0).all())


def _segment_zero_live_at(tmp_path, slots):
    """A tier of 2,500 rows in segments of 1,024 whose segment 0 keeps only the rows at ``slots``."""
    tier = DiskTier(tmp_path / "tier", _specs())
    ids = torch.arange(2500) * 7 + 1
    tier.write(_rows(ids))
    tier.take(ids[:1024][torch.ones(1024, dtype=torch.bool).index_fill_(0, slots, False)])
    return tier, ids


def test_a_compaction_step_moves_the_live_rows_of_one_span_read_at_once(tmp_path, small_segments, monkeypatch):
    monkeypatch.setattr(compaction, "_COMPACT_SPAN", 256)
    live = torch.tensor([300, 301, 310, 555, 556, 557, 600, 1000])
    tier, ids = _segment_zero_live_at(tmp_path, live)
    reads = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: reads.append((offset, memoryview(buffers[0]).nbytes))
                        or real(fd, buffers, offset))
    assert tier.compact_step() == 4  # the 256 records from the first live one: 300, 301, 310, 555
    assert reads == [(300 * tier.record_bytes, 256 * tier.record_bytes)]  # one read, the first to the last
    assert tier.compact_step() == 3 and tier.compact_step() == 1  # 556, 557, 600; then 1000
    assert tier.compact_step() == 0 and "segment-000000.rows" not in _segment_files(tmp_path)
    slots, records = tier.find(ids[live])
    assert bool((slots >= 2048).all())  # written anew after segment 1
    assert torch.equal(tier.unpack(records)["weights"], _rows(ids[live])["weights"].half()) and tier.rows == 1476 + 8


def test_a_segment_cut_short_fails_its_compaction_naming_it_and_moves_nothing(tmp_path, small_segments):
    tier, ids = _segment_zero_live_at(tmp_path, torch.tensor([300, 301, 900]))
    os.ftruncate(tier._fds[0], 400 * tier.record_bytes)  # the file lost its tail, row 900 with it
    with pytest.raises(DiskTierError, match=r"could not read segment 0 to compact it: .*ends before record 900"):
        tier.compact_step()
    slots, records = tier.find(ids[[300, 301]])
    assert slots.tolist() == [300, 301] and torch.equal(tier.unpack(records)["ids"], ids[[300, 301]])
    assert tier.rows == 1476 + 3


def test_an_expiry_sweep_over_a_segment_cut_short_is_an_error_naming_it(tmp_path):
    tier = DiskTier(tmp_path / "tier", _specs())
    tier.write(_rows(torch.arange(10)))
    os.ftruncate(tier._fds[0], 5 * tier.record_bytes)
    with pytest.raises(DiskTierError, match=r"segment-000000.rows ends before its 10 rows"):
        tier.expire(limit=3, lock=threading.Lock())
    assert tier.rows == 10  # nothing dropped


def test_a_full_disk_while_compacting_moves_nothing(tmp_path, small_segments, monkeypatch):
    tier = DiskTier(tmp_path / "tier", _specs())
    ids = torch.arange(2500) * 7 + 1
    tier.write(_rows(ids))
    tier.take(ids[:1000])

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real = disk_tier.write_all
    monkeypatch.setattr(disk_tier, "write_all", full)
    with pytest.raises(DiskTierError, match=r"could not write 24 rows: No space left on device \(the rows stay in segment 0\)"):
        tier.compact_step()
    monkeypatch.setattr(disk_tier, "write_all", real)  # (undo would also undo the small segments)
    slots, records = tier.find(ids[1000:1024])
    assert slots.tolist() == list(range(1000, 1024))  # still where they were
    assert torch.equal(tier.unpack(records)["ids"], ids[1000:1024]) and tier.rows == 1500


def test_a_step_moving_one_row_and_the_deleted_numbers_written_anew_once_no_save_is_under_way(tmp_path, small_segments):
    lock = threading.Lock()
    tier = DiskTier(tmp_path / "tier", _specs(), lock)
    ids = torch.arange(3000) * 7 + 1
    tier.write(_rows(ids))
    tier.take(ids[1:1024])  # segment 0: one live row
    assert tier.compact_step() == 1 and tier.compact_step() == 0
    assert "segment-000000.rows" not in _segment_files(tmp_path)
    with lock:
        frozen = tier.freeze()
    tier.write(_rows(torch.arange(5000, 6100) * 7 + 1))  # a save is under way: above every segment, not in 0
    assert "segment-000000.rows" not in _segment_files(tmp_path)
    frozen.release()
    generation = tier.generation  # no number written anew so far
    more = torch.arange(7000, 8100) * 7 + 1
    tier.write(_rows(more))  # the sealed segment filled, the next one is the deleted number 0, written anew
    assert "segment-000000.rows" in _segment_files(tmp_path)
    assert tier.generation == generation + 1  # a record read from segment 0 before is no longer its slot's
    assert bool((tier.find(more)[0] >> 10 == 0).any())
    everything = torch.cat([ids[:1], ids[1024:], torch.arange(5000, 6100) * 7 + 1, more])
    slots, records = tier.find(everything)
    assert bool((slots >= 0).all()) and torch.equal(tier.unpack(records)["ids"], everything)


def test_a_failed_write_at_a_segments_start_leaves_the_segment_it_opened_to_be_written(tmp_path, small_segments, monkeypatch):
    tier = DiskTier(tmp_path / "tier", _specs())
    tier.write(_rows(torch.arange(1024) * 7 + 1))  # segment 0 full: the next write starts segment 1
    real, calls = disk_tier.write_all, []

    def fails_third(*args):
        calls.append(1)
        if len(calls) == 3:  # segment 1 written, segment 2's records refused
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(*args)

    monkeypatch.setattr(disk_tier, "write_all", fails_third)
    with pytest.raises(DiskTierError):
        tier.write(_rows(torch.arange(2000, 3500) * 7 + 1))
    monkeypatch.setattr(disk_tier, "write_all", real)
    tier.compact_step()  # nothing live in segment 1, but the tier writes into it next: not deleted
    again = torch.arange(4000, 5500) * 7 + 1
    tier.write(_rows(again))
    assert torch.equal(tier.unpack(tier.find(again)[1])["ids"], again)


def _ids_bytewise(records):
    return torch.tensor([int.from_bytes(bytes(row[:8].tolist()), "little", signed=True) for row in records], dtype=torch.int64)


@pytest.mark.parametrize("record_bytes", [48, 20, 18, 13])  # copied as 8-, 4-, 2-byte words, and bytes
def test_records_taken_a_word_at_a_time_are_the_records_taken_a_byte_at_a_time(record_bytes):
    records = torch.randint(0, 256, (64, record_bytes), dtype=torch.uint8)
    records[:, :8] = (torch.arange(64) * 1_000_003 + 5).view(torch.uint8).reshape(64, 8)
    for part in (records, records[7:], records[63:]):  # a queue hands on the rows past a slice: views at an offset
        for index in (torch.tensor([5, 0, 5, -1])[: part.shape[0]].clamp(max=part.shape[0] - 1), part[:, 8] % 2 == 0):
            assert torch.equal(disk_records.take_records(part, index), part[index])
            ids = disk_records.record_ids(part, index)
            assert ids.is_contiguous() and torch.equal(ids, _ids_bytewise(part[index]))
        assert torch.equal(disk_records.record_ids(part), _ids_bytewise(part))
        assert disk_records.record_ids(part).view(torch.uint8).numel() == 8 * part.shape[0]  # one id too: a byte view of it works


@pytest.mark.parametrize("dim", [DIM, 3])  # 48-byte records, and 22-byte ones (a float state at byte 14)
def test_records_unpack_alike_whatever_words_their_fields_allow(dim):
    specs = {"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float16, dim), "state": FieldSpec(torch.float32, 1),
             "access": FieldSpec(torch.int32)}
    ids = torch.arange(10) * 9 + 4
    rows = {"ids": ids, "weights": ids[:, None].float().expand(10, dim) / 1024, "state": ids[:, None] / 7.0,
            "access": ids.to(torch.int32)}
    records = torch.cat([rows[name].to(spec.dtype).contiguous().view(torch.uint8).reshape(10, spec.row_bytes)
                         for name, spec in specs.items()], dim=1)
    for part in (records, records[3:], records[9:]):  # one record alone too: its row keeps the records' stride
        values = disk_records.unpack(part, specs)
        skip = 10 - part.shape[0]
        for name, spec in specs.items():
            assert torch.equal(values[name], rows[name][skip:].to(spec.dtype).reshape(values[name].shape))


@pytest.mark.parametrize("dim", [5, 6])  # records of 26 and 28 bytes: their ids are not 8-byte words apart
def test_a_table_whose_records_are_no_multiple_of_8_bytes_reads_a_single_row_back_from_disk(tmp_path, disk_tier_kernels, dim):
    config = TableConfig("odd", dim, optimizer=Adagrad(rowwise=True), capacity=64, storage="disk", storage_dtype="fp16")
    table = Table(config, seed=0, disk_dir=str(tmp_path / "tier"))
    ids = torch.arange(200)
    first = table.lookup(ids[:64], train=True)
    table.lookup(ids[64:128], train=True)  # the first 64 demoted to make room
    assert table.stats()["disk_rows"] >= 1
    for train in (False, True):
        assert torch.equal(table.lookup(ids[:1], train=train), first[:1])


def test_an_expiry_sweep_reads_the_access_of_a_lone_odd_sized_record(tmp_path):
    specs = {"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float16, 5), "state": FieldSpec(torch.float32, 1),
             "access": FieldSpec(torch.int32)}  # 26-byte records: the access value at byte 22
    tier = DiskTier(tmp_path / "tier", specs)
    tier.write({"ids": torch.tensor([7]), "weights": torch.ones(1, 5), "state": torch.ones(1, 1),
                "access": torch.tensor([1], dtype=torch.int32)})
    assert tier.expire(limit=2, lock=threading.Lock()) == 1 and tier.rows == 0
