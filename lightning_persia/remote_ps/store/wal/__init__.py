"""The write-ahead log of a shard: record framing, the group-commit writer, what a record holds, and replay."""
from lightning_persia.remote_ps.store.wal.log import LogStats, WriteAheadLog
from lightning_persia.remote_ps.store.wal.shard_log import ReplayReport, ShardLog, open_shard_log

__all__ = ["LogStats", "ReplayReport", "ShardLog", "WriteAheadLog", "open_shard_log"]
