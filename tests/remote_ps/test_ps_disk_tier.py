"""Disk tables through real shard processes: rows past the memory budget served from disk, a restarted shard serving
from its checkpoint's linked segments, re-sharding 1 -> 2, and the errors a client sees."""
from __future__ import annotations

import time

import pytest
import torch

from lightning_persia.remote_ps.client import PSError
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

pytestmark = pytest.mark.usefixtures("disk_tier_kernels")

CONFIG = TableConfig("big", 8, optimizer=Adagrad(rowwise=True), capacity=2000, storage="disk", storage_dtype="fp16")
IDS = torch.arange(10_000) * 13 + 5


def _read(client, ids):
    return torch.cat([client.lookup({"big": batch}, train=False, wire_dtype="fp32")["big"] for batch in ids.split(1000)])


def test_disk_table_trains_saves_and_restarts_from_linked_segments(tmp_path, start_ps_cluster, make_client):
    shards = start_ps_cluster(1, overrides=[f"disk_dir={tmp_path / 'tier'}"])
    client = make_client(shards.addresses)
    client.configure([CONFIG])
    for batch in IDS.split(1000):
        client.lookup({"big": batch}, train=True)
        client.update({"big": (batch, torch.full((batch.numel(), 8), 0.5))})
    stats = client.stats()[0]["tables"]["big"]
    assert stats["rows"] <= 2000 and stats["rows"] + stats["disk_rows"] == IDS.numel() and stats["disk_bytes"] > 0
    expected = _read(client, IDS)
    deadline = time.monotonic() + 30
    while client.stats()[0]["tables"]["big"]["disk_mapped_bytes"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # the demoter maps the segments it finds written, a step at a time
    assert client.stats()[0]["tables"]["big"]["disk_mapped_bytes"] > 0
    assert client.stats()[0]["server"]["background_cpu_s"]["demoter"] > 0  # its passes' CPU, counted by the shard
    with pytest.raises(PSError, match="INVALID_ARGUMENT.*larger than the table's memory budget of 2000 rows"):
        client.lookup({"big": torch.arange(2001)}, train=True)
    client.save(str(tmp_path / "ckpt"))
    shards.stop()

    restarted = start_ps_cluster(1, overrides=[f"disk_dir={tmp_path / 'tier'}", f"restore_from={tmp_path / 'ckpt'}", "disk_mapped_mb=0"])
    again = make_client(restarted.addresses)
    assert torch.equal(_read(again, IDS), expected)
    time.sleep(0.2)  # passes of the demoter, which maps nothing with no room to map
    assert again.stats()[0]["tables"]["big"]["disk_mapped_bytes"] == 0
    resharded = start_ps_cluster(2, overrides=[f"disk_dir={tmp_path / 'tier2'}", f"restore_from={tmp_path / 'ckpt'}",
                                               "memory_limit_mb=65536"])
    client = make_client(resharded.addresses)
    assert torch.equal(_read(client, IDS), expected)
    while any(s["tables"]["big"]["disk_mapped_bytes"] == 0 for s in client.stats()) and time.monotonic() < deadline + 30:
        time.sleep(0.05)
    for stats in client.stats():  # each shard maps what the limit leaves, not disk_mapped_mb's 1 GB
        assert stats["tables"]["big"]["disk_mapped_bytes"] > 0 and stats["tables"]["big"]["disk_mapped_budget_bytes"] > 32 << 30


def test_a_disk_table_on_a_shard_without_a_disk_folder_is_refused(ps_cluster, make_client):
    client = make_client(ps_cluster.addresses)
    with pytest.raises(PSError, match="storage 'disk' but its shard has no disk folder"):
        client.configure([TableConfig("nowhere", 4, storage="disk")])
