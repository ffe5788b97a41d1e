"""Clusters of the PS server/client tests (real shard processes on loopback) and client helpers."""
from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from lightning_persia.remote_ps.client import PSClient

SEED = 5
MAX_IDS = 4096  # max_ids_per_request of the YAML cluster, set by a command-line override

PS_YAML = textwrap.dedent(
    """\
    seed: ${oc.env:PERSIA_TEST_PS_SEED}
    max_ids_per_request: 1000000
    server_threads: 4
    tables:
      yaml_table:
        dim: 8
        optimizer: {kind: Adagrad, lr: 0.5, rowwise: true}
        init: {kind: Normal, std: 0.1}
      small:
        dim: 4
        optimizer: {kind: SGD, lr: 1.0}
    """
)


@pytest.fixture(scope="session")
def ps_seed() -> int:
    """The seed of every cluster of these tests."""
    return SEED


@pytest.fixture(scope="session")
def ps_max_ids() -> int:
    """max_ids_per_request of the one-shard YAML cluster."""
    return MAX_IDS


@pytest.fixture(scope="session")
def ps_yaml_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ps-config") / "ps.yaml"
    path.write_text(PS_YAML)
    return str(path)


@pytest.fixture(scope="session")
def _more_clusters(start_ps_cluster, ps_yaml_path):
    """The one-shard YAML cluster and a three-shard cluster, started in parallel."""
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(
            start_ps_cluster, 1, config_path=ps_yaml_path, env={"PERSIA_TEST_PS_SEED": str(SEED)},
            overrides=["tables.yaml_table.dim=12", f"max_ids_per_request={MAX_IDS}"],
        )
        three = pool.submit(start_ps_cluster, 3, overrides=[f"seed={SEED}"])
        return one.result(), three.result()


@pytest.fixture(scope="session")
def ps_cluster1(_more_clusters):
    """One shard from ps.yaml (seed from $PERSIA_TEST_PS_SEED, tables yaml_table and small) + dotlist overrides."""
    return _more_clusters[0]


@pytest.fixture(scope="session")
def ps_cluster3(_more_clusters):
    """Three shards, seed 5."""
    return _more_clusters[1]


@pytest.fixture
def make_client():
    """``make_client(addresses, **kwargs) -> PSClient``, closed after the test."""
    clients: list[PSClient] = []

    def make(addresses, **kwargs) -> PSClient:
        client = PSClient(addresses, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
