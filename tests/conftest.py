"""Fixtures shared by the whole suite."""
from __future__ import annotations

import pytest

from lightning_persia.remote_ps.server import LocalShards


# ---- parameter-server clusters: real shard processes on loopback (`lightning-persia ps serve --port 0`) ----


@pytest.fixture(scope="session")
def start_ps_cluster():
    """``start_ps_cluster(num_shards, **LocalShards kwargs) -> LocalShards``; every cluster stops at session end.

    Safe to call from several threads at once (clusters then start in parallel).
    """
    started: list[LocalShards] = []

    def start(num_shards: int, **kwargs) -> LocalShards:
        shards = LocalShards(num_shards, **kwargs)
        started.append(shards)
        return shards

    yield start
    for shards in started:
        shards.stop()


@pytest.fixture(scope="session")
def ps_cluster(start_ps_cluster) -> LocalShards:
    """Two shards (seed 5) shared by the session; tests keep to their own table names."""
    return start_ps_cluster(2, overrides=["seed=5"])
