"""The disk tier's id map saved with a checkpoint: the map of the point, whatever changed meanwhile; mapped by a load."""
import json
import threading

import pytest
import torch

from lightning_persia.remote_ps.store import CheckpointError
from lightning_persia.remote_ps.store.chunked_rows import FieldSpec
from lightning_persia.remote_ps.store.disk import id_map_file
from lightning_persia.remote_ps.store.disk.tier import DiskTier
from lightning_persia.remote_ps.store.native.disk_map import DiskMap
from lightning_persia.remote_ps.store.shard_store import ShardStore
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

pytestmark = pytest.mark.usefixtures("disk_tier_kernels")

DIM = 4


def _tier(path):
    specs = {"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float16, DIM), "access": FieldSpec(torch.int32)}
    return DiskTier(path, specs)


def _rows(ids):
    n = ids.numel()
    return {"ids": ids, "weights": torch.ones(n, DIM), "access": torch.zeros(n, dtype=torch.int32)}


def test_the_saved_map_is_the_point_s_whatever_changed_before_its_parts_were_copied(tmp_path):
    tier = _tier(tmp_path / "tier")
    ids = torch.arange(50_000) * 11 + 5
    tier.write(_rows(ids))
    at_point, _ = tier.find(ids)
    frozen = tier.freeze()
    taken, _ = tier.take(ids[:20_000])  # promoted after the point: still in the point's map
    tier.write(_rows(ids[:5_000]))  # demoted again, into a new segment: not in it
    tier.write(_rows(torch.arange(3_000) * 11 + 6))  # new ids after the point: not in it
    entry = id_map_file.write(frozen.id_map, tmp_path / "idmap.bin", threading.Lock())
    frozen.release()

    adopted = DiskMap()
    id_map_file.adopt(adopted, tmp_path / "idmap.bin", entry)
    assert adopted.info()[0] == ids.numel()
    assert torch.equal(adopted.find(ids), at_point)
    assert bool((adopted.find(torch.arange(3_000) * 11 + 6) == -1).all())
    adopted.insert(torch.tensor([7]), torch.tensor([123]))  # the adopted map changes (and grows) in memory
    adopted.remove(ids[:10], at_point[:10])
    assert adopted.find(torch.tensor([7])).tolist() == [123] and bool((adopted.find(ids[:10]) == -1).all())
    assert torch.equal(tier.find(ids[20_000:])[0], at_point[20_000:])  # the tier's own map went on as it was


def test_a_damaged_truncated_or_foreign_map_file_is_refused_naming_it(tmp_path):
    tier = _tier(tmp_path / "tier")
    tier.write(_rows(torch.arange(1000)))
    path = tmp_path / "idmap.bin"
    entry = id_map_file.write(tier.freeze().id_map, path, threading.Lock())
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match="idmap.bin is truncated or its header is damaged"):
        id_map_file.adopt(DiskMap(), path, entry)
    path.write_bytes(data[:20] + bytes([data[20] ^ 1]) + data[21:])
    with pytest.raises(CheckpointError, match="idmap.bin is truncated or its header is damaged"):
        id_map_file.adopt(DiskMap(), path, entry)
    path.write_bytes(b"LPDMAP\0\0" + (2).to_bytes(4, "little") + data[12:])
    digest = id_map_file.checksum.Digest()
    digest.update(path.read_bytes()[: 16 + DiskMap.PARTS * 24])  # a header as sound as another version's
    with pytest.raises(CheckpointError, match="id map of version 2 .* this version reads version 1"):
        id_map_file.adopt(DiskMap(), path, {**entry, "head": digest.entry()})
    with pytest.raises(CheckpointError, match="cannot be opened"):
        id_map_file.adopt(DiskMap(), tmp_path / "absent.bin", entry)


def _saved(tmp_path):
    store = ShardStore(0, 1, disk_dir=str(tmp_path / "disk-a"))
    store.configure(TableConfig("t", DIM, optimizer=Adagrad(rowwise=True), capacity=1000, storage="disk", storage_dtype="fp16"))
    ids = torch.arange(6000) * 3
    for batch in ids.split(500):
        store.lookup("t", batch, train=True)
    store.save(str(tmp_path / "ckpt"))
    folder = tmp_path / "ckpt" / "shard-00000-of-00001"
    return store, ids, folder


def test_a_checkpoint_without_a_saved_map_loads_by_indexing_the_ids(tmp_path):
    store, ids, folder = _saved(tmp_path)
    expected = store.lookup("t", ids, train=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["tables"]["t"]["disk"]["idmap"]  # as saved before the map was
    (folder / "manifest.json").write_text(json.dumps(manifest))
    restarted = ShardStore(0, 1, disk_dir=str(tmp_path / "disk-b"))
    restarted.load(str(tmp_path / "ckpt"))
    assert torch.equal(restarted.lookup("t", ids, train=False), expected)


def test_a_checkpoint_whose_map_is_gone_refuses_the_load(tmp_path):
    store, ids, folder = _saved(tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    disk = folder / manifest["tables"]["t"]["disk"]["folder"]
    (disk / "idmap.bin").unlink()
    restarted = ShardStore(0, 1, disk_dir=str(tmp_path / "disk-b"))
    with pytest.raises(CheckpointError, match="idmap.bin .*id map.* is missing or truncated"):
        restarted.load(str(tmp_path / "ckpt"))
