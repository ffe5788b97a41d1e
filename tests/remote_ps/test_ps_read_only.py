"""Inference shards (`ps serve --read-only --restore-from CKPT`): lookups only, every write refused, nothing inserted."""
from __future__ import annotations

import grpc
import pytest
import torch

from lightning_persia.remote_ps.client import PSClient, PSRequestError, RetryPolicy
from lightning_persia.remote_ps.store.initializers import initial_rows
from lightning_persia.remote_ps.table_config import SGD, TableConfig, Uniform

TABLE = TableConfig("read_only_t", dim=4, optimizer=SGD(lr=1.0), init=Uniform(-0.1, 0.1))
TRAINED = torch.arange(20)
UNSEEN = torch.tensor([1000, 1001, -7])


@pytest.fixture(scope="module")
def trained_rows(ps_cluster, tmp_path_factory):
    """A table trained on the 2-shard cluster and saved; returns (checkpoint folder, its rows of TRAINED)."""
    directory = tmp_path_factory.mktemp("read-only") / "ckpt"
    with PSClient(ps_cluster.addresses, retry=RetryPolicy(timeout_s=30)) as client:
        client.configure([TABLE])
        client.lookup({TABLE.name: TRAINED}, train=True)
        client.update({TABLE.name: (TRAINED, torch.ones(len(TRAINED), 4))}, wire_dtype="fp32")
        client.save(directory)
        rows = client.lookup({TABLE.name: TRAINED}, train=False, wire_dtype="fp32")[TABLE.name]
    return directory, rows


@pytest.fixture(scope="module")
def read_only(trained_rows, start_ps_cluster, ps_seed):
    """One read-only shard restored from the 2-shard checkpoint (the tables re-shard on load)."""
    shards = start_ps_cluster(1, extra_args=["--read-only", "--restore-from", str(trained_rows[0])], overrides=[f"seed={ps_seed}"])
    with PSClient(shards.addresses, retry=RetryPolicy(timeout_s=30, max_retries=0)) as client:
        client.wait_healthy(60)
        yield client


def _refused(call) -> str:
    with pytest.raises(PSRequestError) as caught:
        call()
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION, caught.value
    assert "read-only mode" in caught.value.details
    return caught.value.details


def test_training_lookups_read_trained_and_initial_rows_and_insert_nothing(read_only, trained_rows, ps_seed):
    def figures() -> tuple:
        stats = read_only.stats()[0]["tables"][TABLE.name]
        return stats["rows"], stats["inserted"], stats["evicted"], stats["step"]

    before = figures()
    ids = torch.cat([TRAINED, UNSEEN])
    rows = read_only.lookup({TABLE.name: ids}, train=True, wire_dtype="fp32")[TABLE.name]
    assert torch.equal(rows[: len(TRAINED)], trained_rows[1])
    assert torch.equal(rows[len(TRAINED):], initial_rows(TABLE.init, ps_seed, TABLE.name, UNSEEN, TABLE.dim))
    assert figures() == before and before[:3] == (len(TRAINED), 0, 0)  # no row inserted, evicted or touched


def test_every_write_is_refused_naming_read_only_mode_and_the_rows_stay(read_only, trained_rows, tmp_path):
    assert "Update refused" in _refused(lambda: read_only.update({TABLE.name: (TRAINED, torch.ones(len(TRAINED), 4))}))
    assert "new table 'fresh'" in _refused(lambda: read_only.configure([TableConfig("fresh", dim=4)]))
    changed = TableConfig(TABLE.name, dim=4, optimizer=SGD(lr=0.5), init=TABLE.init)
    assert "another configuration" in _refused(lambda: read_only.configure([changed]))
    assert "Save refused" in _refused(lambda: read_only.save(tmp_path / "save"))
    assert "Load refused" in _refused(lambda: read_only.load(trained_rows[0]))
    assert not (tmp_path / "save").exists()

    assert read_only.configure([TABLE]) == [TABLE]  # confirming the table as it is changes nothing
    rows = read_only.lookup({TABLE.name: TRAINED}, train=False, wire_dtype="fp32")[TABLE.name]
    assert torch.equal(rows, trained_rows[1])
    assert read_only.stats()[0]["tables"][TABLE.name]["update_rows"] == 0
