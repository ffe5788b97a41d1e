"""An injected delay (``fault_delay_s``) slows lookups and updates, and nothing else."""
import pytest
import torch

from lightning_persia.remote_ps.client import PSClient, RetryPolicy, ShardUnavailableError
from lightning_persia.remote_ps.config import load_ps_config
from lightning_persia.remote_ps.faults import DelayInterceptor
from lightning_persia.remote_ps.server import ShardServer
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.table_config import TableConfig


def test_a_delayed_shard_misses_the_deadline_of_lookups_but_answers_other_calls():
    server = ShardServer(ShardStore(0, 1), load_ps_config(None, ["fault_delay_s=2.0"]))
    server.start()
    try:
        with PSClient([server.address], retry=RetryPolicy(timeout_s=0.3, max_retries=0)) as client:
            client.configure([TableConfig("slow", 2)])
            assert client.stats()[0]["num_shards"] == 1
            with pytest.raises(ShardUnavailableError, match="Lookup: DEADLINE_EXCEEDED"):
                client.lookup({"slow": torch.arange(3)}, train=True)
    finally:
        server.stop(0)


def test_a_delay_must_be_positive():
    with pytest.raises(ValueError, match="a fault delay must be > 0 s, got 0"):
        DelayInterceptor(0)
