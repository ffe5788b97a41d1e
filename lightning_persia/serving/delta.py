"""Versioned deltas for serving: the folders :class:`~lightning_persia.serving.PublishDeltas` writes, read in order.

Layout (one folder per model version, renamed into place once complete)::

    DELTAS/v00000002/manifest.json       format, version, base_version, the training step, checksum of every file
    DELTAS/v00000002/dense.safetensors   the LightningModule's state dict at that step (whole: dense nets are small)
    DELTAS/v00000002/tables/shard-*/...  per training shard, the rows written and the ids evicted since the base
                                         version (whole tables in the first delta of a training process)

Version ``v + 1`` applies on top of version ``v`` only (its ``base_version``). The bundle exported from a
checkpoint is the first version; the bundle plus the deltas up to ``v`` is version ``v``. A reader
(:func:`next_delta`) takes the folder of the next version only: a missing version with later ones present (a
gap), a manifest that names another base, or a file that is missing, truncated or corrupted is refused with a
:class:`DeltaError` naming the file, and the reader stays where it is.

:class:`DeltaWatcher` applies the deltas of a folder as they appear (the serving ``Predictor``, or an inference
shard started with ``--watch-deltas``).

This module imports neither Lightning nor torch: parameter-server shards read deltas too.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from lightning_persia.serving.bundle import DENSE_FILE, MANIFEST, BundleError, ChecksummedFolder

log = logging.getLogger(__name__)

DELTA_FORMAT = "lightning-persia-delta"
DELTA_FORMAT_VERSION = 2
"""Version 2 checksums files with XXH3-128 (:mod:`lightning_persia.checksum`); version 1 (sha256) still reads."""
READABLE_DELTA_VERSIONS = (1, 2)
_FOLDER = re.compile(r"^v(\d{8})$")


class DeltaError(BundleError):
    """A delta refused: missing, incomplete, damaged or out of order; the message names the file."""


@dataclass(frozen=True)
class Delta(ChecksummedFolder):
    """One published version (see the module docstring for the layout).

    Example::

        delta = Delta.open("runs/dlrm/deltas/v00000002")
        print(delta.version, delta.base_version, delta.global_step)
    """

    kind = "delta"

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Delta":
        """Reads the manifest of the delta at ``path``; :class:`DeltaError` if there is none or it is not one."""
        try:
            return cls._open(path, DELTA_FORMAT, READABLE_DELTA_VERSIONS, ("version", "base_version", "num_shards", "files"),
                             "a serving delta", "PublishDeltas writes them")
        except BundleError as err:
            raise DeltaError(str(err)) from None

    @property
    def base_version(self) -> int:
        """The version this delta applies to."""
        return int(self.manifest["base_version"])

    @property
    def global_step(self) -> Optional[int]:
        """The training step whose model this version is."""
        return self.manifest.get("global_step")

    @property
    def step_time(self) -> Optional[float]:
        """When that training step ended (seconds since the epoch): the freshness of the version starts here."""
        return self.manifest.get("step_time")

    def verify_all(self) -> None:
        """Sizes of every file, checksums of the dense weights and of each shard's manifest (which holds the
        checksums of that shard's files, checked by the shard that stages them). :class:`DeltaError` names the file."""
        try:
            self.verify([DENSE_FILE, *self.table_manifests()])
        except DeltaError:
            raise
        except BundleError as err:
            raise DeltaError(str(err)) from None


def delta_path(root: str | os.PathLike, version: int) -> Path:
    """The folder of ``version`` under ``root``."""
    return Path(root).absolute() / f"v{version:08d}"


def published_versions(root: str | os.PathLike) -> dict[int, Path]:
    """``{version: folder}`` of the deltas under ``root`` (none when it does not exist yet); temporary folders
    of a delta being written start with a dot and are not listed."""
    try:
        children = list(Path(root).absolute().iterdir())
    except FileNotFoundError:
        return {}
    found = {}
    for child in children:
        match = _FOLDER.match(child.name)
        if match and child.is_dir():
            found[int(match.group(1))] = child
    return dict(sorted(found.items()))


def next_delta(root: str | os.PathLike, version: int, up_to: Optional[int] = None) -> Optional[Delta]:
    """The delta under ``root`` that makes version ``version + 1``, opened and verified; ``None`` while there is
    none yet, or when ``version`` is ``up_to`` already.

    Raises :class:`DeltaError` naming the file when the next version is missing but a later one exists (a gap),
    when its manifest names another version or base, or when a file is missing, truncated or corrupted.
    """
    if up_to is not None and version >= up_to:
        return None
    folders = published_versions(root)
    path = folders.get(version + 1)
    if path is None:
        later = [v for v in folders if v > version + 1]
        if later:
            raise DeltaError(
                f"version gap: {delta_path(root, version + 1)} is missing, but {folders[later[0]]} is there; version "
                f"{later[0]} cannot apply before version {version + 1}"
            )
        return None
    delta = Delta.open(path)
    if delta.version != version + 1:
        raise DeltaError(f"{path / MANIFEST} says version {delta.version}, its folder is version {version + 1}")
    if delta.base_version != version:
        raise DeltaError(
            f"{path / MANIFEST} makes version {delta.version} from version {delta.base_version}, not from version "
            f"{version}: out of order"
        )
    delta.verify_all()
    return delta


class DeltaWatcher:
    """Applies the deltas published under ``root`` one after the other, as they appear.

    ``current()`` is the version served; ``apply(delta)`` moves it to ``delta.version`` (all or nothing, raising
    when it cannot). A delta that is refused (by :func:`next_delta` or by ``apply``) is logged once, naming the
    file, and the version served stays; it is tried again at every poll, so a delta published again (fixed) is
    then applied. With ``up_to`` the watcher stops at that version (a rollback: the bundle plus the deltas up to it).

    Example::

        watcher = DeltaWatcher("runs/dlrm/deltas", lambda: served.version, apply, interval_s=1.0)
        watcher.catch_up()          # everything published so far
        watcher.start()             # then, on a thread of its own, what comes next
    """

    def __init__(
        self,
        root: str | os.PathLike,
        current: Callable[[], int],
        apply: Callable[[Delta], Any],
        *,
        up_to: Optional[int] = None,
        interval_s: float = 1.0,
        name: str = "serving",
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"the deltas' polling interval must be > 0 seconds, got {interval_s}")
        self.root = Path(root).absolute()
        self.up_to = up_to
        self.interval_s = interval_s
        self.name = name
        self._current = current
        self._apply = apply
        self._last_refusal: Optional[str] = None
        self._catching_up = threading.Lock()  # the watcher's thread and a caller of catch_up take turns
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def catch_up(self, strict: bool = False) -> int:
        """Applies every delta that follows the version served, in order; returns the version then served.

        ``strict``: a refused delta, or ``up_to`` not published yet, raises :class:`DeltaError` (at start-up, when a
        rollback must reach its version); otherwise the refusal is logged and the version served stays.
        """
        with self._catching_up:
            return self._catch_up(strict)

    def _catch_up(self, strict: bool) -> int:
        while True:
            version = self._current()
            try:
                delta = next_delta(self.root, version, self.up_to)
                if delta is None:
                    if strict and self.up_to is not None and version < self.up_to:
                        newest = max(published_versions(self.root), default=None)
                        raise DeltaError(f"version {self.up_to} is not published under {self.root} (the newest there is "
                                         f"{newest if newest is not None else 'none'})")
                    return version
                self._apply(delta)
                if self._current() != delta.version:
                    raise DeltaError(f"{delta.path} was applied, but the version served is {self._current()}, not {delta.version}")
            except Exception as err:  # a refused delta never stops serving; it is tried again at the next poll
                if strict:
                    raise err if isinstance(err, DeltaError) else DeltaError(f"{delta_path(self.root, version + 1)}: {err}") from None
                self._refused(err, version)
                return version
            self._last_refusal = None
            log.info("%s: serving version %d (%s, training step %s)", self.name, delta.version, delta.path, delta.global_step)

    def start(self, stop: Optional[threading.Event] = None) -> None:
        """Polls ``root`` every ``interval_s`` seconds on a daemon thread until :meth:`stop` (or ``stop`` is set)."""
        stop_event = stop or self._stop
        self._stop = stop_event

        def loop() -> None:
            while not stop_event.wait(self.interval_s):
                self.catch_up()

        self._thread = threading.Thread(target=loop, name=f"persia-deltas-{self.name}", daemon=True)
        self._thread.start()
        # Stopped before the interpreter finalizes: a daemon thread inside a torch op then (applying a delta) is
        # ended by pthread_exit, which aborts the process (see docs/reliability.md, the exit-time abort).
        atexit.register(self.stop)

    def stop(self) -> None:
        """Ends the polling thread after the delta it is applying, if any (also run at interpreter exit)."""
        atexit.unregister(self.stop)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _refused(self, err: Exception, version: int) -> None:
        reason = str(err) if isinstance(err, BundleError) else f"{type(err).__name__}: {err}"
        if reason == self._last_refusal:
            return
        self._last_refusal = reason
        log.error("%s: delta %s refused, still serving version %d: %s", self.name, delta_path(self.root, version + 1), version, reason)
