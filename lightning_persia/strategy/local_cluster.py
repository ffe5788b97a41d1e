"""The embedded parameter server: shard processes on this machine, owned by global rank 0.

The shards outlive a single ``fit``/``test`` call so that ``trainer.fit(); trainer.test()`` sees the trained
tables; they stop when the strategy closes, when the trainer raises, at interpreter exit, and (through
``--parent-pid``) when the trainer process is killed.
"""
from __future__ import annotations

import atexit
from typing import Optional

from lightning_persia.remote_ps.server import LocalShards


class LocalCluster:
    """``num_shards`` shards on loopback whose rows start from ``seed``.

    Example::

        cluster = LocalCluster(2, seed=0)
        client = PSClient(cluster.addresses)
        ...
        cluster.stop()
    """

    def __init__(
        self, num_shards: int, seed: int = 0, config_path: Optional[str] = None, *, restart: bool = False, max_restarts: int = 3,
    ) -> None:
        self._shards = LocalShards(num_shards, config_path=config_path, overrides=[f"seed={seed}"], restart=restart, max_restarts=max_restarts)
        self.addresses = list(self._shards.addresses)
        atexit.register(self.stop)

    @property
    def restore_from(self) -> Optional[str]:
        """The PS checkpoint a restarted shard loads (``--restore-from``); set after every checkpoint."""
        return self._shards.restore_from

    @restore_from.setter
    def restore_from(self, path: Optional[str]) -> None:
        self._shards.restore_from = path

    @property
    def events(self) -> list:
        """What the launcher saw and did (shards that exited, restarts, give-ups)."""
        return self._shards.events

    @property
    def shards(self) -> LocalShards:
        return self._shards

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._shards.stop()
