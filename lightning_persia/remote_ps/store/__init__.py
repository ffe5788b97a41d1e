"""The storage engine of one parameter-server shard: index, rows, optimizer state, eviction, checkpoints."""
from lightning_persia.remote_ps.store.errors import CheckpointError, InvalidRequestError, StoreError, UnknownTableError
from lightning_persia.remote_ps.store.shard_store import ShardStore

__all__ = ["ShardStore", "StoreError", "UnknownTableError", "InvalidRequestError", "CheckpointError"]
