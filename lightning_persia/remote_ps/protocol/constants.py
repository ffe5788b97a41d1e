"""Every name the two ends of the parameter-server protocol must spell alike, beside ``persia.proto``.

Metadata keys and the fenced methods travel with the RPCs; the ``PERSIA_PS_*`` lines are what a ``ps serve``
process prints for its launcher; the environment variables are read by the CLI and the strategy; the commit
marker is the file a trainer writes into a checkpoint folder and a restarting shard looks for. Import them
from the package (``from lightning_persia.remote_ps.protocol import TOKEN_ENV``).
"""
from __future__ import annotations

# ---- call metadata -------------------------------------------------------------------------------------

AUTH_METADATA_KEY = "authorization"
"""Metadata key of the shared token, sent as ``authorization: Bearer <token>`` (see :func:`bearer_metadata`)."""

BEARER_PREFIX = "Bearer "
"""What precedes the token in the value of :data:`AUTH_METADATA_KEY`."""

INCARNATION_METADATA_KEY = "persia-incarnation"
"""Metadata key under which a client names the shard incarnation it knows (fencing, see ``persia.proto``)."""

MAP_VERSION_METADATA_KEY = "persia-shard-map-version"
"""Trailing metadata key of a refusal of ids this shard's newer shard map gives another shard: the map's version
(the client fetches it with GetShardMap and routes the ids again)."""

FENCED_METHODS = frozenset({"Lookup", "Update", "Save", "SaveDelta"})
"""Calls that must never land on a restarted shard without the caller knowing (they read or write rows that a
restart may have lost or rolled back). The other calls are safe whatever the shard's history."""


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries ``token`` (empty without one)."""
    return ((AUTH_METADATA_KEY, f"{BEARER_PREFIX}{token}"),) if token else ()


# ---- the lines a shard process prints ------------------------------------------------------------------

LISTENING_PREFIX = "PERSIA_PS_LISTENING"
"""``PERSIA_PS_LISTENING host:port``: the shard accepts calls at that address."""

METRICS_PREFIX = "PERSIA_PS_METRICS"
"""``PERSIA_PS_METRICS <url>``: the line before :data:`LISTENING_PREFIX`'s when the shard serves metrics."""

# ---- environment variables -----------------------------------------------------------------------------

TOKEN_ENV = "PERSIA_PS_TOKEN"
"""The shards' token, read by ``ps serve``, ``serve`` and the strategy when none is given."""

ADDRESSES_ENV = "PERSIA_PS_ADDRESSES"
"""Comma-separated ``host:port`` of the shards, in shard order, read by the strategy when none are given."""

SHARD_PROCESS_ENV = "LIGHTNING_PERSIA_SHARD_PROCESS"
"""``1`` in a shard process or an embedding worker: ``import lightning_persia`` then leaves the strategy, and Lightning
with it, out (the launcher of local shards, the trainer starting its embedding workers and the Kubernetes manifests set
it; a process without it works, with Lightning loaded)."""

# ---- checkpoints ---------------------------------------------------------------------------------------

COMMIT_MARKER = "COMMITTED"
"""A file that a trainer writes into a checkpoint folder once the rest of its checkpoint (the dense ``.ckpt``)
is written too. Where some candidates carry it, a restarting shard restores only from those: a PS checkpoint
whose trainer died before its ``.ckpt`` was written is complete but belongs to no checkpoint."""
