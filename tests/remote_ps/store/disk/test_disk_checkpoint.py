"""Checkpoints of disk tables: segments linked (not copied), loads that link them back or re-shard, damage refused."""
import json
import os
import time

import pytest
import torch

from lightning_persia.ops.shard_map import shard_of
from lightning_persia.remote_ps.store import CheckpointError
from lightning_persia.remote_ps.store.disk import tier as disk_tier
from lightning_persia.remote_ps.store.shard_store import ShardStore
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

pytestmark = pytest.mark.usefixtures("disk_tier_kernels")

DIM = 4
ROWS = 6000
CONFIG = TableConfig("t", DIM, optimizer=Adagrad(rowwise=True), capacity=1000, storage="disk", storage_dtype="fp16")


def _trained(tmp_path):
    store = ShardStore(0, 1, disk_dir=str(tmp_path / "disk-a"))
    store.configure(CONFIG)
    ids = torch.arange(ROWS) * 3
    for batch in ids.split(500):
        store.lookup("t", batch, train=True)
        store.update("t", batch, torch.ones(batch.numel(), DIM))
    return store, ids


def _promoted(store):
    """Waits for the shard's demoter to promote what the lookups read from disk (it does so between requests)."""
    deadline = time.monotonic() + 30
    while store.stats()["t"]["pending_promotions"] and time.monotonic() < deadline:
        time.sleep(0.005)


def _read(store, ids):
    return torch.cat([store.lookup("t", batch, train=False) for batch in ids.split(500)])


def test_a_save_links_the_segments_and_a_load_serves_them(tmp_path):
    store, ids = _trained(tmp_path)
    expected = _read(store, ids)
    store.save(str(tmp_path / "ckpt"))
    store.update("t", ids[:500], torch.ones(500, DIM))  # after the point: not in the checkpoint
    folder = tmp_path / "ckpt" / "shard-00000-of-00001"
    entry = json.loads((folder / "manifest.json").read_text())["tables"]["t"]
    linked = sorted((folder / entry["disk"]["folder"]).glob("segment-*.rows"))
    assert linked and all(path.stat().st_nlink == 2 for path in linked)  # the tier's file and the checkpoint's: one inode
    assert entry["rows"] + sum(rows for _, rows in entry["disk"]["segments"]) >= ROWS

    restarted = ShardStore(0, 1, disk_dir=str(tmp_path / "disk-b"))
    restarted.load(str(tmp_path / "ckpt"))
    stats = restarted.stats()["t"]
    assert stats["rows"] + stats["disk_rows"] == ROWS
    assert torch.equal(_read(restarted, ids), expected)
    # the restarted table trains on: it promotes, demotes into new segments, and loses nothing
    for batch in ids.split(500):
        restarted.lookup("t", batch, train=True)
    assert torch.equal(_read(restarted, ids), expected)


def test_a_second_save_after_more_demotions_loads_whole(tmp_path):
    store, ids = _trained(tmp_path)
    store.save(str(tmp_path / "first"))  # seals the open segment: later rows go to the next one
    more = torch.arange(ROWS, ROWS + 1500) * 3
    for batch in more.split(500):
        store.lookup("t", batch, train=True)
    everything = torch.cat([ids, more])
    expected = _read(store, everything)
    store.save(str(tmp_path / "second"))
    restarted = ShardStore(0, 1, disk_dir=str(tmp_path / "disk-b"))
    restarted.load(str(tmp_path / "second"))
    assert torch.equal(_read(restarted, everything), expected)


def test_a_load_into_more_shards_reshards_the_disk_rows(tmp_path):
    store, ids = _trained(tmp_path)
    expected = _read(store, ids)
    store.save(str(tmp_path / "ckpt"))
    shards = [ShardStore(i, 2, disk_dir=str(tmp_path / f"disk-{i}")) for i in range(2)]
    got = torch.empty_like(expected)
    for index, shard in enumerate(shards):
        shard.load(str(tmp_path / "ckpt"))
        mine = shard_of(ids, 2) == index
        got[mine] = _read(shard, ids[mine])
        stats = shard.stats()["t"]
        assert stats["rows"] <= CONFIG.capacity and stats["rows"] + stats["disk_rows"] == int(mine.sum())
    assert torch.equal(got, expected)


def test_a_missing_or_damaged_disk_file_refuses_the_load_and_keeps_the_tables(tmp_path):
    store, ids = _trained(tmp_path)
    store.save(str(tmp_path / "ckpt"))
    folder = tmp_path / "ckpt" / "shard-00000-of-00001"
    disk = folder / json.loads((folder / "manifest.json").read_text())["tables"]["t"]["disk"]["folder"]
    other = ShardStore(0, 1, disk_dir=str(tmp_path / "disk-b"))
    other.configure(CONFIG)
    other.lookup("t", torch.arange(10), train=True)
    kept = other.lookup("t", torch.arange(10), train=False)

    live = disk / "live.bits"
    data = bytearray(live.read_bytes())
    data[0] ^= 0xFF
    live.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="live.bits is missing, truncated or corrupted"):
        other.load(str(tmp_path / "ckpt"))
    data[0] ^= 0xFF
    live.write_bytes(bytes(data))

    segment = sorted(disk.glob("segment-*.rows"))[0]
    os.truncate(segment, 100)
    with pytest.raises(CheckpointError, match=f"disk segment .*{segment.name} of the checkpoint is truncated"):
        other.load(str(tmp_path / "ckpt"))
    segment.unlink()
    with pytest.raises(CheckpointError, match=f"disk segment .*{segment.name} of the checkpoint is missing"):
        other.load(str(tmp_path / "ckpt"))
    assert torch.equal(other.lookup("t", torch.arange(10), train=False), kept)


def test_a_tier_compacted_by_the_demoter_saves_and_loads_without_its_deleted_segments(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "SEGMENT_SHIFT", 10)  # segments of 1,024 records: training leaves sparse ones
    monkeypatch.setattr(disk_tier, "SEGMENT_ROWS", 1 << 10)
    store, ids = _trained(tmp_path)
    for _ in range(3):  # rows in and out again: their old records are garbage
        for batch in ids.split(500):
            store.lookup("t", batch, train=True)
            _promoted(store)
    expected = _read(store, ids)
    written = store.stats()["t"]["demoted"] // 1024  # full segments written in all (each demoted row is a record)

    def files() -> int:
        return len(list((tmp_path / "disk-a").rglob("segment-*.rows")))

    deadline = time.monotonic() + 30
    while files() >= written / 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the demoter compacts a step a pass, and deletes what it emptied
    assert files() < written / 2
    assert torch.equal(_read(store, ids), expected)
    store.save(str(tmp_path / "ckpt"))
    restarted = ShardStore(0, 1, disk_dir=str(tmp_path / "disk-b"))
    restarted.load(str(tmp_path / "ckpt"))
    assert torch.equal(_read(restarted, ids), expected)
