"""The model version a read-only (inference) shard serves, and the delta staged to become the next one.

A serving cluster moves from version ``v`` to ``v + 1`` in two steps, so that all its shards switch together:
every shard *stages* the delta (reads and checks its files, applies nothing), and only once every shard has
staged it does the driver (the serving ``Predictor``, or the shard's own delta watcher) *commit* it on each.
A delta is accepted only on top of the version it was made from: a shard never skips or repeats one.
"""
from __future__ import annotations

import threading
from typing import Optional

from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.shard_store import StagedDelta


class DeltaOrderError(ValueError):
    """A delta that does not follow the version in force (a gap, a wrong base), or a commit of nothing staged."""


class ServedVersion:
    """The version of one shard's tables, moved forward one staged delta at a time.

    Example::

        served = ServedVersion(store, version=1)              # restored from a bundle of version 1
        served.stage("/deltas/v00000002/tables", version=2, base_version=1)
        served.commit(2)
    """

    def __init__(self, store: ShardStore, version: int = 0) -> None:
        self._store = store
        self._version = version
        self._staged: Optional[tuple[int, StagedDelta]] = None
        self._lock = threading.Lock()  # one stage or commit at a time

    @property
    def version(self) -> int:
        return self._version

    @property
    def staged_version(self) -> Optional[int]:
        staged = self._staged
        return staged[0] if staged is not None else None

    def stage(self, directory: str, version: int, base_version: int) -> int:
        """Reads and checks the delta at ``directory`` for this shard; returns the rows it writes here.

        It replaces any delta staged before. Raises :class:`DeltaOrderError` unless ``base_version`` is the
        version in force and ``version`` the next one, and :class:`~lightning_persia.remote_ps.store.CheckpointError`
        naming the file when a file is missing, truncated or corrupted (nothing is staged then).
        """
        with self._lock:
            if base_version != self._version or version != base_version + 1:
                raise DeltaOrderError(
                    f"delta {directory} makes version {version} from version {base_version}, but this shard serves version "
                    f"{self._version}: deltas apply one after the other, each on the version before it"
                )
            self._staged = None  # a failed stage leaves nothing staged, not an older one
            staged = self._store.stage_delta(directory)
            self._staged = (version, staged)
            return staged.rows

    def apply(self, directory: str, version: int, base_version: int) -> int:
        """:meth:`stage` then :meth:`commit` (a shard that applies deltas on its own); returns the rows written."""
        rows = self.stage(directory, version, base_version)
        self.commit(version)
        return rows

    def commit(self, version: int) -> None:
        """Applies the delta staged for ``version``; a no-op when ``version`` is in force already (a retried commit)."""
        with self._lock:
            if self._staged is None and version == self._version:
                return
            if self._staged is None or self._staged[0] != version:
                staged = f"version {self._staged[0]} is staged" if self._staged is not None else "nothing is staged"
                raise DeltaOrderError(f"cannot commit version {version}: {staged} (this shard serves version {self._version})")
            self._staged[1].commit()
            self._version, self._staged = version, None
