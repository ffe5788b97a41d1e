"""Shard checkpoints: round trip, re-sharding, refusal of damaged files, streamed saves, fp16 rows, old format."""
import contextlib
import hashlib
import json
import os
import shutil
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_persia import checksum
from lightning_persia.ops.hashing import slot_of
from lightning_persia.ops.shard_map import SLOTS, ShardMap, shard_of
from lightning_persia.remote_ps.store import CheckpointError, ShardStore, checkpoint, shard_store
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import SGD, Adagrad, Adam, Constant, TableConfig, Uniform

IDS = torch.arange(-300, 300) * 7919


def _cluster(n: int, shard_map: ShardMap | None = None) -> list[ShardStore]:
    stores = [ShardStore(i, n, seed=5, shard_map=shard_map) for i in range(n)]
    for s in stores:
        s.configure(TableConfig("a", 4, optimizer=Adam(lr=0.1)))
        s.configure(TableConfig("b", 2))
    return stores


def _call(stores, method, table, ids, *args):
    owners = stores[0].shard_map.shard_of(ids)
    out = None
    for i, s in enumerate(stores):
        mine = owners == i
        part = getattr(s, method)(table, ids[mine], *(a[mine] for a in args)) if method == "update" else s.lookup(table, ids[mine], *args)
        if method == "lookup":
            out = torch.empty(ids.numel(), part.shape[1]) if out is None else out
            out[mine] = part
    return out


def _train(stores):
    _call(stores, "lookup", "a", IDS, True)
    _call(stores, "lookup", "b", IDS[:50], True)
    _call(stores, "update", "a", IDS, torch.randn(IDS.numel(), 4, generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("into", ["shards with tables", "empty shards"])  # files checked first / while read
@pytest.mark.parametrize("blocks", ["one block", "many blocks"])
@pytest.mark.parametrize("saved_by,loaded_by", [(2, 2), (2, 3), (3, 1)])
def test_save_load_round_trip_and_reshard(tmp_path, monkeypatch, request, saved_by, loaded_by, blocks, into):
    if blocks == "many blocks":  # a load indexes each block while it reads and writes the next one
        request.getfixturevalue("small_chunks")
        monkeypatch.setattr(checkpoint, "BLOCK_ROWS", 37)
    old = _cluster(saved_by)
    _train(old)
    for s in old:
        s.save(str(tmp_path))
    new = _cluster(loaded_by) if into == "shards with tables" else [ShardStore(i, loaded_by, seed=5) for i in range(loaded_by)]
    for s in new:
        s.load(str(tmp_path))
    for table, ids in (("a", IDS), ("b", IDS[:50])):
        assert torch.equal(_call(new, "lookup", table, ids, False), _call(old, "lookup", table, ids, False))
    assert sum(s.stats()["a"]["rows"] for s in new) == IDS.numel()
    # optimizer state survived: one more identical update keeps both clusters equal
    g = torch.ones(IDS.numel(), 4)
    _call(old, "update", "a", IDS, g)
    _call(new, "update", "a", IDS, g)
    assert torch.equal(_call(new, "lookup", "a", IDS, False), _call(old, "lookup", "a", IDS, False))


RESIZED = ShardMap.uniform(2).resized(3)


@pytest.mark.parametrize("loaded_under", [RESIZED, ShardMap.uniform(3), ShardMap.uniform(2), RESIZED.resized(2), ShardMap.uniform(4)],
                         ids=["same map", "uniform 3", "uniform 2", "resized 2", "uniform 4"])
def test_a_checkpoint_records_its_map_and_loads_under_any_other(tmp_path, loaded_under):
    old = _cluster(3, RESIZED)
    _train(old)
    for s in old:
        s.save(str(tmp_path))
    manifest = json.loads((checkpoint.shard_folder(tmp_path, 2, 3) / "manifest.json").read_text())
    assert ShardMap.from_dict(manifest["shard_map"]) == RESIZED
    new = _cluster(loaded_under.num_shards, loaded_under)
    for s in new:
        s.load(str(tmp_path))
    for table, ids in (("a", IDS), ("b", IDS[:50])):
        assert torch.equal(_call(new, "lookup", table, ids, False), _call(old, "lookup", table, ids, False))
    for s in new:  # each holds exactly the rows its map gives it
        assert s.stats()["a"]["rows"] == int((loaded_under.shard_of(IDS) == s.shard_index).sum())


def test_a_store_refuses_ids_its_map_gives_another_shard_naming_the_map_version():
    store = ShardStore(0, 3, shard_map=RESIZED)
    store.configure(TableConfig("a", 4))
    foreign = IDS[RESIZED.shard_of(IDS) == 2][:1]
    with pytest.raises(shard_store.InvalidRequestError, match="belongs to shard 2, not to this shard 0 of 3 \\(shard map version 1\\)"):
        store.lookup("a", foreign, train=True)
    with pytest.raises(ValueError, match="a shard map of 3 shards for a cluster of 2"):
        ShardStore(0, 2, shard_map=RESIZED)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="the drop-behind is posix_fadvise, which this platform "
                    "lacks (macOS, Windows): loads there keep the page cache, and the round-trip tests cover them")
@pytest.mark.parametrize("loaded_by", [2, 3])
def test_a_folder_only_its_shard_reads_leaves_the_page_cache_behind_the_load(tmp_path, monkeypatch, small_chunks, loaded_by):
    """Into as many shards as saved it, each shard drops every row it read from the page cache (its checkpoint
    does not compete with its table for memory); re-sharded, every shard reads every folder, and drops nothing."""
    monkeypatch.setattr(checkpoint, "BLOCK_ROWS", 37)
    old = _cluster(2)
    _train(old)
    for s in old:
        s.save(str(tmp_path))
    dropped: dict[int, int] = {}  # bytes dropped, by the file's inode
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):
        if advice == os.POSIX_FADV_DONTNEED:
            inode = os.fstat(fd).st_ino
            dropped[inode] = dropped.get(inode, 0) + length
        return real(fd, offset, length, advice)

    monkeypatch.setattr(checkpoint.os, "posix_fadvise", spy)
    new = [ShardStore(i, loaded_by, seed=5) for i in range(loaded_by)]
    for s in new:
        s.load(str(tmp_path))
    assert torch.equal(_call(new, "lookup", "a", IDS, False), _call(old, "lookup", "a", IDS, False))
    if loaded_by == 3:
        assert dropped == {}
        return
    files = list(tmp_path.rglob("*.npy"))
    assert files and sorted(dropped) == sorted(path.stat().st_ino for path in files)
    for path in files:
        assert dropped[path.stat().st_ino] == np.load(path, mmap_mode="r").nbytes  # every row, once; the header stays


def test_corrupted_truncated_or_incomplete_checkpoint_is_refused(tmp_path):
    old = _cluster(2)
    _train(old)
    for s in old:
        s.save(str(tmp_path))
    target = _cluster(1)[0]
    before = target.lookup("a", IDS[:5], train=True)
    weights = sorted(tmp_path.glob("shard-00001-of-00002/*.weights.npy"))[0]
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=weights.name):
        target.load(str(tmp_path))
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="corrupted"):
        target.load(str(tmp_path))
    weights.write_bytes(data)
    (tmp_path / "shard-00001-of-00002" / "manifest.json").rename(tmp_path / "manifest.moved")
    with pytest.raises(CheckpointError, match="manifest.json"):
        target.load(str(tmp_path))
    shutil.rmtree(tmp_path / "shard-00001-of-00002")
    with pytest.raises(CheckpointError, match=r"incomplete: shard folders \[1\]"):
        target.load(str(tmp_path))
    with pytest.raises(CheckpointError, match="no parameter-server checkpoint"):
        target.load(str(tmp_path / "absent"))
    assert torch.equal(target.lookup("a", IDS[:5], train=False), before)


@pytest.mark.parametrize("loaded_by", [1, 2])  # another shard count reads every folder and keeps its ids
def test_an_empty_shard_checks_the_checksums_while_it_reads_and_keeps_no_table_of_a_damaged_checkpoint(
    tmp_path, monkeypatch, loaded_by
):
    monkeypatch.setattr(checkpoint, "BLOCK_ROWS", 64)  # the damage is found after the blocks before it were stored
    old = _cluster(2)
    _train(old)
    for s in old:
        s.save(str(tmp_path / "good"))
    shutil.copytree(tmp_path / "good", tmp_path / "damaged")
    victim = next((tmp_path / "damaged").glob("shard-00001-of-00002/t0000.weights.npy"))
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    for manifest in (tmp_path / "damaged").glob("*/manifest.json"):
        os.utime(manifest, (time.time() + 60, time.time() + 60))  # the newest checkpoint under tmp_path
    verified_first = []
    monkeypatch.setattr(checksum, "matches", lambda *args: verified_first.append(args) or True)  # no pass before the load
    empty = ShardStore(1, loaded_by, seed=5) if loaded_by == 2 else ShardStore(0, 1, seed=5)
    with pytest.raises(CheckpointError, match=f"{victim} is truncated or corrupted"):
        empty.load(str(tmp_path / "damaged"))
    assert empty.tables() == [] and verified_first == []
    assert empty.load_latest(str(tmp_path)) == str(tmp_path / "good")  # the damaged one is newer: refused, then the good one
    assert torch.equal(empty.lookup("b", IDS[:50][shard_of(IDS[:50], loaded_by) == empty.shard_index], train=False),
                       _call(old, "lookup", "b", IDS[:50], False)[shard_of(IDS[:50], loaded_by) == empty.shard_index])


def test_save_replaces_previous_atomically(tmp_path):
    stores = _cluster(1)
    _train(stores)
    stores[0].save(str(tmp_path))
    stores[0].save(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["shard-00000-of-00001"]


# ---- streamed saves: one consistent point while the table keeps changing ---------------------------------


def _rows_by_id(chunks) -> dict[int, tuple]:
    out = {}
    for chunk in chunks:
        for i, id_ in enumerate(chunk["ids"].tolist()):
            assert id_ not in out, f"id {id_} saved twice"
            out[id_] = (chunk["weights"][i].float(), chunk["state"][i])
    return out


@pytest.mark.parametrize("slots", [None, "even slots"])  # a move's snapshot: the moving slots' rows alone
@pytest.mark.parametrize("origin", ["inserted", "loaded"])
def test_a_streamed_snapshot_holds_the_rows_of_its_point_while_the_table_changes(small_chunks, store_kernels, origin, slots):
    slot_mask = (torch.arange(SLOTS) % 2 == 0) if slots else None
    kept = (lambda ids: slot_mask[slot_of(ids, SLOTS)]) if slots else None
    config = TableConfig("t", 4, optimizer=Adagrad(lr=0.5, rowwise=True), capacity=5000, init=Uniform(-1, 1))
    table = Table(config, seed=1)
    ids = torch.arange(5000) * 3 + 1  # five chunks of 1,024 rows
    if origin == "loaded":  # rows read from a checkpoint: the oldest version there is
        table.append({"ids": ids, "weights": torch.rand(5000, 4), "state": torch.zeros(5000, 1),
                      "access": torch.ones(5000, dtype=torch.int32)})
    else:
        table.lookup(ids, train=True)
    table.update(ids[::2], torch.ones(2500, 4))
    at_point = table.lookup(ids, train=False)
    with table.lock:
        snapshot = table.begin_snapshot(slot_mask=slot_mask)
    chunks = ({name: values.clone() for name, values in chunk.items()} for chunk in snapshot.chunks())  # reused buffers
    saved = [next(chunks)]  # chunk 0 is written; the others are not yet
    grads = torch.randn(5000, 4, generator=torch.Generator().manual_seed(3))
    table.update(ids, grads)  # every row changes, in written and unwritten chunks
    table.lookup(torch.arange(10**6, 10**6 + 800), train=True)  # at capacity: evicts 800+ rows, reuses them
    table.update(ids[:100], grads[:100])
    saved += list(chunks)
    snapshot.close()
    rows = _rows_by_id(saved)
    wanted = torch.ones(5000, dtype=torch.bool) if kept is None else kept(ids)
    assert sorted(rows) == ids[wanted].tolist() and snapshot.rows == 5000 and 2000 < int(wanted.sum()) <= 5000
    torch.testing.assert_close(torch.stack([rows[i][0] for i in ids[wanted].tolist()]), at_point[wanted], rtol=0, atol=0)
    # the table itself kept every change made during the save
    assert table.stats()["evicted"] >= 800 and table.stats()["saving_preimage_rows"] == 0
    assert not torch.equal(table.lookup(ids[-5:], train=False), at_point[-5:])


def test_a_save_concurrent_with_updates_is_one_consistent_point(tmp_path, small_chunks):
    store = ShardStore(0, 1, seed=4, fault_save_delay_s=0.02)  # a pause after each chunk written: updates land in between
    store.configure(TableConfig("t", 2, optimizer=SGD(lr=1.0), init=Constant(0.0)))
    ids = torch.arange(20_000) * 11  # 20 chunks
    store.lookup("t", ids, train=True)
    store.save(str(tmp_path / "first"))
    store.load(str(tmp_path / "first"))  # loaded rows carry the oldest version there is
    stop = threading.Event()
    updates = []

    def train() -> None:
        while not stop.is_set():
            store.update("t", ids, torch.ones(ids.numel(), 2))  # every row loses 1 at once
            updates.append(1)

    worker = threading.Thread(target=train)
    worker.start()
    try:
        while len(updates) < 3:
            time.sleep(0.01)
        before = len(updates)
        store.save(str(tmp_path / "second"))
        after = len(updates)
    finally:
        stop.set()
        worker.join()
    assert after - before >= 2, "the save stopped the updates"
    loaded = ShardStore(0, 1, seed=4)
    loaded.load(str(tmp_path / "second"))
    rows = loaded.lookup("t", ids, train=False)
    assert torch.unique(rows).numel() == 1, "rows saved at different points"
    # The point lies within the save's own span; under load the save may start several updates after `before` was
    # read, and one update may have landed without being counted yet.
    assert before <= -float(rows[0, 0]) <= after + 1
    assert -float(rows[0, 0]) < after, "the save took its point at its end, not its start"


def test_a_damaged_streamed_checkpoint_is_refused_naming_the_file(tmp_path, small_chunks):
    store = ShardStore(0, 1)
    store.configure(TableConfig("t", 4, storage_dtype="fp16"))
    store.lookup("t", torch.arange(5000), train=True)
    store.save(str(tmp_path))
    state = next(tmp_path.glob("shard-*/t0000.state.npy"))
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    target = ShardStore(0, 1)
    target.configure(TableConfig("t", 4))
    target.lookup("t", torch.arange(3), train=True)
    with pytest.raises(CheckpointError, match=f"{state.name} is truncated or corrupted"):
        target.load(str(tmp_path))
    assert target.stats()["t"]["rows"] == 3  # nothing replaced


def test_files_are_checksummed_with_xxh3_and_an_entry_without_a_known_checksum_is_refused(tmp_path):
    store = ShardStore(0, 1)
    store.configure(TableConfig("t", 4))
    store.lookup("t", torch.arange(100), train=True)
    store.save(str(tmp_path))
    path = next(tmp_path.glob("shard-*/manifest.json"))
    manifest = json.loads(path.read_text())
    assert manifest["format_version"] == checkpoint.FORMAT_VERSION == 3
    entry = manifest["tables"]["t"]["files"]["ids"]
    assert sorted(entry) == ["bytes", "file", "xxh3_128"] and len(entry["xxh3_128"]) == 32
    entry["md5"] = entry.pop("xxh3_128")
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=rf"{path}: the entry of {entry['file']}: no checksum of a known algorithm"):
        ShardStore(0, 1).load(str(tmp_path))


# ---- fp16 storage ------------------------------------------------------------------------------------------


def test_fp16_storage_round_trips_and_trains_like_fp32_within_its_precision(tmp_path, small_chunks):
    stores = {}
    for dtype in ("fp32", "fp16"):
        store = stores[dtype] = ShardStore(0, 1, seed=9)
        store.configure(TableConfig("t", 8, optimizer=Adagrad(lr=0.05, rowwise=True), storage_dtype=dtype))
        ids = torch.arange(3000) * 5
        store.lookup("t", ids, train=True)
        generator = torch.Generator().manual_seed(1)
        for _ in range(20):
            store.update("t", ids, torch.randn(3000, 8, generator=generator))
    half, full = stores["fp16"].lookup("t", ids, train=False), stores["fp32"].lookup("t", ids, train=False)
    torch.testing.assert_close(half, full, rtol=2e-3, atol=2e-3)
    assert stores["fp16"].stats()["t"]["row_bytes"] == stores["fp32"].stats()["t"]["row_bytes"] - 8 * 2
    stores["fp16"].save(str(tmp_path))
    weights = np.load(next(tmp_path.glob("shard-*/t0000.weights.npy")))
    assert weights.dtype == np.float16 and weights.shape == (3000, 8)
    again = ShardStore(0, 1, seed=9)
    again.load(str(tmp_path))
    assert again.describe("t").storage_dtype == "fp16"
    assert torch.equal(again.lookup("t", ids, train=False), half)
    as_fp16 = stores["fp16"].lookup("t", ids, train=False, dtype=torch.float16)
    assert as_fp16.dtype == torch.float16 and torch.equal(as_fp16.float(), half)


def test_a_checkpoint_of_format_1_still_loads(tmp_path):
    """Format 1 (before chunked tables): fp32 weights, configs without storage_dtype, written by np.save."""
    folder = tmp_path / "shard-00000-of-00001"
    folder.mkdir()
    arrays = {"ids": np.array([3, 9, -4], dtype=np.int64), "weights": np.arange(6, dtype=np.float32).reshape(3, 2),
              "state": np.full((3, 1), 0.5, dtype=np.float32), "access": np.array([1, 2, 3], dtype=np.int32)}
    files = {}
    for name, array in arrays.items():
        np.save(folder / f"t0000.{name}.npy", array, allow_pickle=False)
        data = (folder / f"t0000.{name}.npy").read_bytes()
        files[name] = {"file": f"t0000.{name}.npy", "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    config = TableConfig("old", 2, optimizer=Adagrad(rowwise=True)).to_dict()
    del config["storage_dtype"]
    manifest = {"format_version": 1, "shard_index": 0, "num_shards": 1, "save_id": "x",
                "tables": {"old": {"config": config, "step": 7, "rows": 3, "files": files}}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    store = ShardStore(0, 1)
    store.load(str(tmp_path))
    assert torch.equal(store.lookup("old", torch.tensor([9, 3, -4]), train=False), torch.tensor([[2.0, 3], [0, 1], [4, 5]]))
    assert store.stats()["old"]["step"] == 7 and store.describe("old").storage_dtype == "fp32"


# ---- deltas (serving) ----------------------------------------------------------------------------------------


def test_deltas_carry_only_what_changed_and_replay_the_training_tables_into_any_shard_count(tmp_path):
    train = _cluster(2)
    for s in train:
        s.configure(TableConfig("small", 2, optimizer=SGD(lr=1.0), capacity=100))
    _train(train)
    seen = torch.arange(-2000, 2000) * 31
    _call(train, "lookup", "small", seen[:150], True)
    for s in train:
        s.save_delta(str(tmp_path / "v1"), "v1")  # the first delta is whole
    serving = [ShardStore(i, 3, seed=5) for i in range(3)]
    for s in serving:
        s.stage_delta(str(tmp_path / "v1")).commit()
    _call(train, "update", "a", IDS[:40], torch.ones(40, 4))  # 40 rows change
    _call(train, "lookup", "small", seen[150:400], True)  # 250 new ids: the tables of 100 rows a shard evict
    for s in train:
        s.save_delta(str(tmp_path / "v2"), "v2", base_id="v1")
    manifests = [json.loads(m.read_text()) for m in sorted((tmp_path / "v2").glob("shard-*/manifest.json"))]
    assert sum(m["tables"]["a"]["rows"] for m in manifests) == 40 and all(m["tables"]["a"]["since"] > 0 for m in manifests)
    assert sum(m["tables"]["b"]["rows"] for m in manifests) == 0
    assert sum(m["tables"]["small"].get("removed", {}).get("rows", 0) for m in manifests) >= 150
    staged = [s.stage_delta(str(tmp_path / "v2")) for s in serving]
    assert sum(d.rows for d in staged) == 40 + sum(m["tables"]["small"]["rows"] for m in manifests)
    for d in staged:
        d.commit()
    for table, ids in (("a", IDS), ("b", IDS[:50]), ("small", seen[:400])):
        assert torch.equal(_call(serving, "lookup", table, ids, False), _call(train, "lookup", table, ids, False)), table
    assert sum(s.stats()["small"]["rows"] for s in serving) == sum(s.stats()["small"]["rows"] for s in train)
    restarted = ShardStore(0, 2, seed=5)  # a new process knows no earlier delta: what it writes is whole
    restarted.load(str(tmp_path / "v1"))
    restarted.save_delta(str(tmp_path / "v3"), "v3", base_id="v2")
    manifest = json.loads((tmp_path / "v3" / "shard-00000-of-00002" / "manifest.json").read_text())
    assert {entry["since"] for entry in manifest["tables"].values()} == {0}


def test_a_delta_after_a_load_is_whole_the_points_of_earlier_deltas_are_forgotten(tmp_path):
    train = _cluster(1)
    _train(train)
    train[0].save(str(tmp_path / "ckpt"))
    train[0].save_delta(str(tmp_path / "v1"), "v1")
    _call(train, "update", "a", IDS[:30], torch.ones(30, 4))
    train[0].load(str(tmp_path / "ckpt"))  # a rollback: the tables restart, and with them their versions
    _call(train, "update", "a", IDS[:10], torch.ones(10, 4))
    train[0].save_delta(str(tmp_path / "v2"), "v2", base_id="v1")
    manifest = json.loads((tmp_path / "v2" / "shard-00000-of-00001" / "manifest.json").read_text())
    assert {entry["since"] for entry in manifest["tables"].values()} == {0}
    serving = ShardStore(0, 1, seed=5)
    for version in ("v1", "v2"):
        serving.stage_delta(str(tmp_path / version)).commit()
    for table, ids in (("a", IDS), ("b", IDS[:50])):
        assert torch.equal(_call([serving], "lookup", table, ids, False), _call(train, "lookup", table, ids, False)), table


class _PausingExitStack(contextlib.ExitStack):
    """An ExitStack whose first enter_context waits for ``release`` (after setting ``paused``)."""

    paused = threading.Event()
    release = threading.Event()

    def enter_context(self, cm):
        if not self.paused.is_set():
            self.paused.set()
            self.release.wait(10)
        return super().enter_context(cm)


def test_a_lookup_during_the_commit_of_a_whole_table_never_sees_it_half_built(tmp_path, monkeypatch):
    train = _cluster(1)
    _train(train)
    train[0].save_delta(str(tmp_path / "v1"), "v1")  # whole tables
    serving = _cluster(1)[0]
    staged = serving.stage_delta(str(tmp_path / "v1"))
    monkeypatch.setattr(shard_store, "contextlib", SimpleNamespace(ExitStack=_PausingExitStack))
    committing = threading.Thread(target=staged.commit)
    committing.start()
    assert _PausingExitStack.paused.wait(10)  # the commit is under way, stopped before it takes the tables' locks
    found = {}
    reader = threading.Thread(target=lambda: found.update(rows=serving.lookup("a", IDS, train=False)))
    reader.start()
    reader.join(0.5)  # a lookup answered now would be of the table being built
    _PausingExitStack.release.set()
    committing.join(10)
    reader.join(10)
    assert torch.equal(found["rows"], _call(train, "lookup", "a", IDS, False))
