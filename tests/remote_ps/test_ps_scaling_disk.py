"""Disk tables (most of their rows demoted to disk) moving between live shard processes: grown and drained while a
client trains, shards restarted from their logs after a move; rows and optimizer state compared with one store that
never moved."""
from dataclasses import replace

import pytest
import torch

from lightning_persia.remote_ps.client import PSClient, RetryPolicy
from lightning_persia.remote_ps.client.scaling import rescale, wait_drained
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.store import ShardStore
from tests.remote_ps.checkpoint_rows import COMPARED, saved_rows
from tests.remote_ps.test_ps_scaling import TABLES, UNIVERSE, Trainer

# processes for a minute or more: CI's scenario step; make test moves disk tables in process (store/test_slot_moves.py)
pytestmark = [pytest.mark.usefixtures("disk_tier_kernels"), pytest.mark.scenario]

DISK_TABLES = [replace(config, capacity=600, storage="disk") for config in TABLES]
"""A memory budget of 600 rows a shard for 5,000 ids: most rows on disk (a request's 400 ids fit)."""


def _model(tables=TABLES) -> ShardStore:
    """One store of memory tables with no budget: the rows a cluster that never moved holds."""
    model = ShardStore(0, 1, seed=5)
    for config in tables:
        model.configure(config)
    return model


def _assert_same_rows(client: PSClient, model: ShardStore, tmp_path, name: str) -> None:
    """The cluster holds every row of ``model``, values and optimizer state, bit for bit, each once; and each shard
    holds, in memory and on disk, exactly the rows its map gives it (a source none of those it handed over)."""
    client.save(str(tmp_path / name))
    model.save(str(tmp_path / f"{name}-model"))
    held, expected = saved_rows(tmp_path / name), saved_rows(tmp_path / f"{name}-model")
    shard_map = client.shard_map
    for config, stats in zip(TABLES, zip(*[[entry["tables"][t.name] for t in TABLES] for entry in client.stats()])):
        for field in COMPARED:
            assert torch.equal(held[config.name][field], expected[config.name][field]), (name, config.name, field)
        owners = shard_map.shard_of(expected[config.name]["ids"])
        counts = [s["rows"] + s["disk_rows"] for s in stats]
        assert counts == [int((owners == shard).sum()) for shard in range(shard_map.num_shards)], (name, config.name, counts)


def _on_disk(client: PSClient) -> tuple[int, int]:
    """Rows of the tables in memory and on disk over the shards."""
    stats = [entry["tables"][config.name] for entry in client.stats() for config in DISK_TABLES]
    return sum(s["rows"] for s in stats), sum(s["disk_rows"] for s in stats)


def test_disk_tables_grow_and_drain_while_a_client_trains_losing_nothing(tmp_path):
    with LocalShards(2, overrides=["seed=5", f"disk_dir={tmp_path / 'tiers'}"]) as shards:
        client, admin = PSClient(shards.addresses), PSClient(shards.addresses)
        client.wait_healthy(60)
        client.configure(DISK_TABLES)
        model = _model()
        trainer = Trainer(client, model, DISK_TABLES)
        trainer.start()
        trainer.wait_for(20)  # most ids seen: most rows demoted before the move
        memory, disk = _on_disk(client)
        assert disk > memory, (memory, disk)
        grown = rescale(admin, shards.grow(3))
        trainer.wait_for(trainer.step + 10)
        shrunk = rescale(admin, shards.addresses[:2])
        wait_drained(admin, [2])
        shards.shrink(2)
        trainer.stop_at = trainer.step + 10
        trainer.join(300)
        assert trainer.error is None, repr(trainer.error)
        for config in TABLES:
            found = client.lookup({config.name: UNIVERSE}, train=False, wire_dtype="fp32")[config.name]
            assert torch.equal(found, model.lookup(config.name, UNIVERSE, train=False)), config.name
        assert grown.rows_moved > 0.2 * UNIVERSE.numel() and shrunk.rows_moved > 0.2 * UNIVERSE.numel()
        _assert_same_rows(client, model, tmp_path, "after")
        client.close()
        admin.close()


def _logged_shards(tmp_path, deadline_s: float = 1.0) -> LocalShards:
    """Two shards with disk tiers that log every update and come back from their logs when killed."""
    return LocalShards(2, overrides=["seed=5", f"disk_dir={tmp_path / 'tiers'}", "durability=log", f"wal_dir={tmp_path / 'wal'}",
                                     f"handover_deadline_s={deadline_s}"], restart=True)


def _trained(client: PSClient, steps: int) -> ShardStore:
    """``steps`` of a client's training of the disk tables (every id seen, most rows on disk); returns the model."""
    model = _model()
    trainer = Trainer(client, model, DISK_TABLES)
    trainer.stop_at = steps
    trainer.run()
    assert trainer.error is None, repr(trainer.error)
    return model


def test_a_source_and_a_taker_restarted_from_their_logs_after_a_move_hold_what_they_did(tmp_path):
    import os
    import signal

    with _logged_shards(tmp_path) as shards:
        with PSClient(shards.addresses, retry=RetryPolicy(retry_for_s=60)) as client:
            client.wait_healthy(60)
            client.configure(DISK_TABLES)
            model = _trained(client, 15)
            assert rescale(client, shards.grow(3)).map_version == 1
            for shard in (0, 2):  # a source and the taker
                os.kill(shards.processes[shard].pid, signal.SIGKILL)
            client.wait_healthy(120)
            for config in TABLES:
                found = client.lookup({config.name: UNIVERSE}, train=False, wire_dtype="fp32")[config.name]
                assert torch.equal(found, model.lookup(config.name, UNIVERSE, train=False)), config.name
            assert client.shard_map.version == 1  # the sources answered the lookup with the map they replayed
            _assert_same_rows(client, model, tmp_path, "restarted")


def test_a_taker_killed_after_it_took_disk_rows_comes_back_from_its_log_and_the_move_goes_through(tmp_path):
    """The taker dies after the rows and before the last changes (it took rows into its memory and disk): it replays
    them from its log, the coordinator's calls wait for it, and the move goes through with every row."""
    import os
    import signal

    with _logged_shards(tmp_path, deadline_s=60) as shards:
        with PSClient(shards.addresses, retry=RetryPolicy(retry_for_s=60)) as client:
            client.wait_healthy(60)
            client.configure(DISK_TABLES)
            model = _trained(client, 15)
            grown = shards.grow(3)
            with PSClient(grown, retry=RetryPolicy(timeout_s=30, retry_for_s=60)) as admin:
                kill = lambda step: step == "last changes" and os.kill(shards.processes[2].pid, signal.SIGKILL)  # noqa: E731
                assert rescale(admin, grown, on_step=kill).map_version == 1
            assert shards.restarts[2] == 1
            for config in TABLES:  # the client hears of the new map
                found = client.lookup({config.name: UNIVERSE}, train=False, wire_dtype="fp32")[config.name]
                assert torch.equal(found, model.lookup(config.name, UNIVERSE, train=False)), config.name
            assert client.shard_map.version == 1
            _assert_same_rows(client, model, tmp_path, "after")
