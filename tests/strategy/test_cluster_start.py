"""A trainer started against shards it did not start (``ps.addresses``), with a wrong list or a shard it cannot
reach: a clear error naming the addresses, before any table is created or any update lands, and no hang."""
from __future__ import annotations

import socket
import time

import lightning as L
import pytest

from lightning_persia import PersiaStrategy, PSSettings
from lightning_persia.remote_ps.client import PSClient, PSError, ShardUnavailableError
from toy import ToyRecommender, loader, make_batches


def _fit(addresses: list[str], timeout_s: float = 10.0) -> None:
    strategy = PersiaStrategy(ps=PSSettings(addresses=addresses, timeout_s=timeout_s))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(ToyRecommender(), loader(make_batches(2)))


@pytest.fixture(scope="module")
def cluster(start_ps_cluster):
    return start_ps_cluster(2)


def _untouched(addresses: list[str]) -> None:
    with PSClient(addresses) as client:
        for shard in client.stats():
            assert shard["tables"] == {}, "a table was created before the shard list was checked"
            assert shard["server"].get("update_rows", 0) == 0


@pytest.mark.parametrize("order", ["reversed", "one missing", "one twice"])
def test_a_wrong_shard_list_fails_at_start_naming_both_before_anything_lands(cluster, order):
    a0, a1 = cluster.addresses
    listed = {"reversed": [a1, a0], "one missing": [a1], "one twice": [a0, a0]}[order]
    with pytest.raises(PSError, match="the parameter-server addresses do not match the shards") as info:
        _fit(listed)
    message = str(info.value)
    assert f"listed: {', '.join(listed)}" in message
    assert f"{listed[0]} is shard" in message and "listed as shard" in message
    _untouched([a0, a1])


def test_an_unreachable_shard_fails_at_start_naming_it_without_hanging(cluster):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{closed.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(ShardUnavailableError, match=rf"shard 1 at {gone} did not answer after \d+ tries over"):
        _fit([cluster.addresses[0], gone], timeout_s=2.0)
    assert time.monotonic() - started < 30
    _untouched(cluster.addresses)
