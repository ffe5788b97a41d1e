"""Shards with a write-ahead log (real processes): killed at any moment, restarted, replayed, and their clients go
on without a rollback, every update applied exactly once; a full disk stops the acknowledgements with a clear error."""
from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import threading
import time

import grpc
import pytest
import torch

from lightning_persia.remote_ps.client import PSRequestError, RetryPolicy
from lightning_persia.remote_ps.launcher import LocalShards, read_listening_address, serve_command, stop_processes
from lightning_persia.remote_ps.table_config import SGD, Constant, TableConfig

IDS = torch.arange(300)


def _table(client, name: str) -> None:
    client.configure([TableConfig(name, 4, optimizer=SGD(lr=1.0), init=Constant(0.0))])


def _push(client, name: str) -> None:
    """A lookup that admits the ids, then an update of -1 each: the rows count the updates applied."""
    client.lookup({name: IDS}, train=True)
    client.update({name: (IDS, torch.ones(IDS.numel(), 4))}, wire_dtype="fp32")


def _rows(client, name: str) -> torch.Tensor:
    return client.lookup({name: IDS}, train=False, wire_dtype="fp32")[name]


def _wait_restarted(shards: LocalShards, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(e.kind == "restarted" for e in shards.events) < count:
        assert time.monotonic() < deadline, shards.events
        time.sleep(0.05)


def test_shards_killed_at_random_moments_replay_and_every_update_lands_exactly_once(tmp_path, make_client):
    shards = LocalShards(2, restart=True, max_restarts=4,
                         overrides=["seed=5", "durability=log", f"wal_dir={tmp_path / 'wal'}"])
    try:
        client = make_client(shards.addresses, retry=RetryPolicy(backoff_s=0.05, retry_for_s=60, timeout_s=5))
        client.wait_healthy(30)
        incarnations = client.refresh_incarnations()
        _table(client, "t")
        pushed = 0
        for _ in range(5):
            _push(client, "t")
            pushed += 1
        client.save(tmp_path / "ckpt")  # truncates both logs: the replays start from it
        shards.restore_from = str(tmp_path / "ckpt")
        done = threading.Event()

        def killer() -> None:  # a kill at a random moment of the pushes: between a write and its ack, in a lookup...
            generator = random.Random(0)
            for kill in range(2):
                time.sleep(generator.uniform(0.05, 0.4))
                os.kill(shards.processes[kill % 2].pid, signal.SIGKILL)
                _wait_restarted(shards, kill + 1)
            done.set()

        thread = threading.Thread(target=killer)
        thread.start()
        while not done.is_set():
            _push(client, "t")  # never ShardRestartedError: the restarted shards accept this client
            pushed += 1
        thread.join()
        assert torch.equal(_rows(client, "t"), torch.full((IDS.numel(), 4), -float(pushed)))
        stats = client.stats()
        assert [s["incarnation"] for s in stats] != incarnations
        for shard in stats:
            wal = shard["server"]["wal"]
            assert wal["replay"]["replayed"] and wal["replay"]["checkpoint"] == str(tmp_path / "ckpt")
            assert wal["replay"]["rows"] > 0 and wal["replay"]["seconds"] > 0  # (persia_ps_wal_replay_rows|seconds)
            assert set(incarnations) & set(wal["accepted_incarnations"])
        assert [e.kind for e in shards.events].count("restarted") == 2
    finally:
        shards.stop()


def test_a_full_disk_stops_the_acknowledgements_with_a_clear_error_and_a_restart_loses_nothing_acknowledged(tmp_path, make_client):
    def limited_files() -> None:  # the log's writes past 64 KiB fail with EFBIG (not the signal that would kill it)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    command = serve_command(0, 1, overrides=["seed=1", "durability=log", f"wal_dir={tmp_path / 'wal'}"])
    shard = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=limited_files)
    lines: list[str] = []
    try:
        address = read_listening_address(shard, lines, time.monotonic() + 60, "limited-shard")
        assert address, lines
        client = make_client([address], retry=RetryPolicy(max_retries=0))
        client.wait_healthy(30)
        _table(client, "t")
        acknowledged = 0
        with pytest.raises(PSRequestError) as refused:
            for _ in range(100):
                _push(client, "t")
                acknowledged += 1
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "write-ahead log" in refused.value.details and "File too large" in refused.value.details
        assert 0 < acknowledged < 100
        with pytest.raises(PSRequestError, match="acknowledges no more updates"):
            _rows(client, "t")  # nothing is served that could show an unlogged write
        shard.kill()
        shard.wait()
        shard = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        address = read_listening_address(shard, lines, time.monotonic() + 60, "restarted-shard")
        restarted = make_client([address])
        assert torch.equal(_rows(restarted, "t"), torch.full((IDS.numel(), 4), -float(acknowledged)))
    finally:
        stop_processes([shard], 10)
