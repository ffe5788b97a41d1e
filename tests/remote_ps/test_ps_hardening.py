"""Hardening of a shard beyond the token/TLS tests: an explicitly insecure non-loopback bind, checkpoint
folders confined to ``checkpoint_root``, and checkpoint files that would unpickle code or escape their folder."""
from __future__ import annotations

import json
import os

import grpc
import numpy as np
import pytest
import torch

from lightning_persia import checksum
from lightning_persia.remote_ps.client import PSClient, PSRequestError, RetryPolicy
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.store import CheckpointError, ShardStore
from lightning_persia.remote_ps.table_config import SGD, Constant, TableConfig


def test_insecure_non_loopback_shard_starts_warns_and_confines_checkpoints(tmp_path):
    root = tmp_path / "ckpts"
    root.mkdir()
    shards = LocalShards(1, host="0.0.0.0", extra_args=["--insecure"], overrides=[f"checkpoint_root={root}"])
    try:
        assert shards.addresses[0].startswith("0.0.0.0:")
        port = shards.addresses[0].rsplit(":", 1)[1]
        with PSClient([f"127.0.0.1:{port}"], retry=RetryPolicy(timeout_s=10)) as client:
            client.wait_healthy(10)
            client.configure([TableConfig("hardening", 2, optimizer=SGD(lr=1.0), init=Constant(0.0))])
            client.lookup({"hardening": torch.arange(4)}, train=True)
            client.save(root / "inside")
            client.load(root / "inside")
            for call in (lambda: client.save(tmp_path / "outside"), lambda: client.load(root / ".." / "outside"),
                         lambda: client.save("/etc/persia-should-not-exist")):
                with pytest.raises(PSRequestError, match="outside this shard's checkpoint_root") as info:
                    call()
                assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert not (tmp_path / "outside").exists() and not os.path.exists("/etc/persia-should-not-exist")
        assert "with neither TLS nor a token (--insecure)" in shards.output(0)
    finally:
        shards.stop()


class _Payload:
    """Unpickling this object would create the file named by ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _checkpoint(tmp_path):
    store = ShardStore(0, 1, seed=1)
    store.configure(TableConfig("t", 2, optimizer=SGD(lr=1.0), init=Constant(0.5)))
    store.lookup("t", torch.arange(10), train=True)
    store.save(str(tmp_path / "ckpt"), save_id="one")
    folder = tmp_path / "ckpt" / "shard-00000-of-00001"
    return folder, json.loads((folder / "manifest.json").read_text())


def test_pickle_bearing_npy_is_refused_even_with_a_matching_checksum(tmp_path):
    folder, manifest = _checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    spec = manifest["tables"]["t"]["files"]["weights"]
    array = np.empty(1, dtype=object)
    array[0] = _Payload(str(marker))
    with open(folder / spec["file"], "wb") as f:
        np.save(f, array, allow_pickle=True)
    spec.update(checksum.of_file(folder / spec["file"]), bytes=(folder / spec["file"]).stat().st_size)  # the attacker fixes the manifest too
    (folder / "manifest.json").write_text(json.dumps(manifest))

    target = ShardStore(0, 1, seed=1)
    with pytest.raises(CheckpointError, match=r"holds object \(1,\), not the 10 rows of weights"):
        target.load(str(tmp_path / "ckpt"))
    assert not marker.exists() and target.tables() == []


def test_checkpoint_files_outside_their_folder_or_malformed_manifests_are_refused(tmp_path):
    folder, manifest = _checkpoint(tmp_path)
    original = json.dumps(manifest)
    manifest["tables"]["t"]["files"]["ids"]["file"] = "../../../../etc/passwd"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    target = ShardStore(0, 1, seed=1)
    with pytest.raises(CheckpointError, match="names a file outside its folder"):
        target.load(str(tmp_path / "ckpt"))
    for bad in ({"format_version": 1, "shard_index": 0, "tables": {"t": {"files": 3}}}, ["not", "a", "dict"]):
        (folder / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError):
            target.load(str(tmp_path / "ckpt"))
    (folder / "manifest.json").write_text(original)
    target.load(str(tmp_path / "ckpt"))
    assert torch.equal(target.lookup("t", torch.arange(10), train=False), torch.full((10, 2), 0.5))
