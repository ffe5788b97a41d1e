"""Shard checkpoints: round trip, re-sharding, refusal of damaged files."""
import shutil

import pytest
import torch

from lightning_persia.ops.hashing import shard_of
from lightning_persia.remote_ps.store import CheckpointError, ShardStore
from lightning_persia.remote_ps.table_config import Adam, TableConfig

IDS = torch.arange(-300, 300) * 7919


def _cluster(n: int) -> list[ShardStore]:
    stores = [ShardStore(i, n, seed=5) for i in range(n)]
    for s in stores:
        s.configure(TableConfig("a", 4, optimizer=Adam(lr=0.1)))
        s.configure(TableConfig("b", 2))
    return stores


def _call(stores, method, table, ids, *args):
    owners = shard_of(ids, len(stores))
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


@pytest.mark.parametrize("saved_by,loaded_by", [(2, 2), (2, 3), (3, 1)])
def test_save_load_round_trip_and_reshard(tmp_path, saved_by, loaded_by):
    old = _cluster(saved_by)
    _train(old)
    for s in old:
        s.save(str(tmp_path))
    new = _cluster(loaded_by)
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


def test_save_replaces_previous_atomically(tmp_path):
    stores = _cluster(1)
    _train(stores)
    stores[0].save(str(tmp_path))
    stores[0].save(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["shard-00000-of-00001"]
