"""The errors of a parameter-server call, as :class:`~lightning_persia.remote_ps.client.PSClient` raises them."""
from __future__ import annotations

import grpc


class PSError(RuntimeError):
    """Base of the errors of a parameter-server call."""


class PSRequestError(PSError):
    """A shard refused or failed a request; carries the shard, its address, the status code and its message."""

    def __init__(self, shard: int, address: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"shard {shard} at {address} answered {code.name}: {details}")
        self.shard, self.address, self.code, self.details = shard, address, code, details

    def __reduce__(self):  # pickled by its fields: an embedding worker's error reaches the trainer as the same error
        return type(self), (self.shard, self.address, self.code, self.details)


class ShardRestartedError(PSRequestError):
    """A shard restarted since this client learnt its incarnation (``ABORTED``): rows written since the last
    checkpoint may be lost on it, so the call was refused. Roll back to a checkpoint, then call
    :meth:`PSClient.wait_healthy` (or :meth:`PSClient.refresh_incarnations`) to talk to the new incarnation."""


class ShardMapMovedError(PSRequestError):
    """A shard's map (``version``) is newer than the one the request was routed by, and gives some of its ids to
    another shard: the client fetches the map and routes them again (``PSClient`` does so on its own)."""

    def __init__(self, shard: int, address: str, code: grpc.StatusCode, details: str, version: int) -> None:
        super().__init__(shard, address, code, details)
        self.version = version

    def __reduce__(self):
        return type(self), (self.shard, self.address, self.code, self.details, self.version)


class ShardUnavailableError(PSError):
    """A shard did not answer after every retry."""

    def __init__(self, shard: int, address: str, tries: int, elapsed_s: float, last_error: str) -> None:
        super().__init__(
            f"shard {shard} at {address} did not answer after {tries} tries over {elapsed_s:.1f} s: {last_error}"
        )
        self.shard, self.address, self.tries, self.elapsed_s, self.last_error = shard, address, tries, elapsed_s, last_error

    def __reduce__(self):
        return type(self), (self.shard, self.address, self.tries, self.elapsed_s, self.last_error)
