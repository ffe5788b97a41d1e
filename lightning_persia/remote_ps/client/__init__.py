"""Client of a parameter-server cluster: shards ids by hash, talks to every shard at once, retries, reassembles.

All RPCs run on one background thread with a ``grpc.aio`` event loop; the public ``*_async`` methods return
:class:`concurrent.futures.Future` objects, so a trainer can keep several batches in flight.

- ``ps_client.py``: :class:`PSClient`, and its hot path (lookups and updates);
- ``admin.py``: the calls off the hot path (tables, checkpoints, deltas, stats, health);
- ``connection.py``: the channels and the event loop; ``retry.py``: the retry and fencing policy;
- ``sharding.py``: ids bucketed by shard and encoded once per batch; ``errors.py``: what a call raises.

Example::

    client = PSClient(["127.0.0.1:5000", "127.0.0.1:5001"])
    client.wait_healthy(60)
    client.configure([TableConfig("user", dim=16, optimizer=Adagrad(rowwise=True))])
    rows = client.lookup({"user": torch.tensor([3, 7, 11])}, train=True)["user"]      # float32 [3, 16]
    client.update({"user": (torch.tensor([3, 7, 11]), torch.randn(3, 16))})

    sharded = client.shard(KeyedIds(("user",), (3,), torch.tensor([3, 7, 11])))       # once per batch
    flat = client.lookup_sharded_async(sharded, train=True).result()                   # float32 [3 * 16]
    client.update_sharded_async(sharded, torch.randn(3 * 16), dims=[16])
"""
from lightning_persia.remote_ps.client.admin import ShardWait
from lightning_persia.remote_ps.client.errors import PSError, PSRequestError, ShardRestartedError, ShardUnavailableError
from lightning_persia.remote_ps.client.ps_client import PSClient
from lightning_persia.remote_ps.client.retry import RetryPolicy
from lightning_persia.remote_ps.client.sharding import ShardedIds, Sharder

__all__ = [
    "PSClient", "PSError", "PSRequestError", "RetryPolicy", "ShardRestartedError", "ShardUnavailableError", "ShardWait",
    "ShardedIds", "Sharder",
]
