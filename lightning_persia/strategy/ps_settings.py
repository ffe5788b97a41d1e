"""``PSSettings``: where a trainer's parameter-server shards are and how it reaches them (``PersiaStrategy(ps=...)``)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from lightning_persia.remote_ps.protocol import ADDRESSES_ENV, TOKEN_ENV


@dataclass
class PSSettings:
    """The parameter server as the trainers see it: the shards' addresses (or how many to start here), the
    credentials and the deadline of a call.

    Example (YAML: ``trainer.strategy.init_args.ps: {addresses: [ps-0:5000, ps-1:5000], timeout_s: 120}``)::

        PersiaStrategy(ps=PSSettings(addresses=["ps-0:5000", "ps-1:5000"], token="...", timeout_s=120))
    """

    addresses: Optional[list[str]] = None
    """``host:port`` of every shard in shard order. ``None`` reads ``PERSIA_PS_ADDRESSES`` (comma-separated) and,
    if unset, starts ``num_local_shards`` shards on this machine (embedded mode)."""
    num_local_shards: int = 2
    """Shards of the embedded cluster."""
    seed: int = 0
    """Seed of the embedded shards' deterministic row initialisation (recorded in checkpoints for serving)."""
    config: Optional[str] = None
    """PS YAML config of the embedded shards (``PSConfig``: durability, disk tier, limits)."""
    token: Optional[str] = None
    """Shared secret of shards started with ``--token`` (default: ``PERSIA_PS_TOKEN``)."""
    tls_root_cert: Optional[str] = None
    """PEM file that signed the shards' TLS certificates."""
    timeout_s: float = 60.0
    """Deadline of one attempt of a parameter-server call, and of the wait for the shards to answer at start (a line
    every 2 s names a shard that has not answered yet). A failed attempt is retried for
    ``RecoveryConfig.wait_for_shards_s``; a wait for rows or on the staleness window lasts as long as the call it
    waits for may."""

    def __post_init__(self) -> None:
        if self.num_local_shards < 1:
            raise ValueError(f"PSSettings: num_local_shards must be >= 1, got {self.num_local_shards}")
        if not self.timeout_s > 0:
            raise ValueError(f"PSSettings: timeout_s must be > 0, got {self.timeout_s}")

    @property
    def embedded(self) -> bool:
        """Whether the trainers start the shards themselves (no addresses given, here or in the environment)."""
        return not self.addresses

    def with_environment(self) -> PSSettings:
        """These settings with the addresses and token the environment gives where they are unset."""
        addresses = [a.strip() for a in os.environ.get(ADDRESSES_ENV, "").split(",") if a.strip()]
        return dataclasses.replace(
            self, addresses=list(self.addresses) if self.addresses else (addresses or None), token=self.token or os.environ.get(TOKEN_ENV),
        )
