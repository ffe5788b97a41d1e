"""The embedded parameter server: shard processes on this machine, owned by global rank 0.

The shards outlive a single ``fit``/``test`` call so that ``trainer.fit(); trainer.test()`` sees the trained
tables; they stop when the strategy closes, when the trainer raises, at interpreter exit, and (through
``--parent-pid``) when the trainer process is killed.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future
from typing import Optional

from omegaconf import OmegaConf

from lightning_persia.remote_ps.config import load_ps_config
from lightning_persia.remote_ps.client.scaling import ScaleReport, rescale_apart
from lightning_persia.remote_ps.launcher import LocalShards

EMBEDDED_NICE = 10
EMBEDDED_SCHEDULING = "idle" if hasattr(os, "SCHED_IDLE") else "normal"
"""The embedded shards' priority (``PSConfig.nice`` and ``PSConfig.scheduling``) unless the PS config sets either.
They share the trainers' cores: a trainer's parallel regions (two intra-op threads on a 2-core machine) stall on
any core a shard takes from them, while a prefetched lookup has steps to come back. ``train_bench.py --ranks 1
--staleness 4 --steps 150`` on 2 cores: hybrid at 0.91-0.96x local's samples/s at nice 0 (median
of 4 runs 0.935), 0.88-1.00x at nice 10 (median of 7 runs 0.96), and with ``SCHED_IDLE`` (where the platform has
it; nice then does not matter) 1.00-1.08x (median of 5 runs 1.06) against 0.95-1.02x at nice 10 in the same rounds."""


EMBEDDED_DURABILITY = "log"
"""The embedded shards' ``PSConfig.durability`` unless the PS config sets it: a shard that dies is restarted by the
launcher and replays its log, and the trainers go on without a rollback. ``train_bench.py --durability none log
fsync`` (DLRM τ=4, 1 rank, 2 cores shared with other jobs): ``log`` at 0.96x
of ``none``'s samples/s, ``fsync`` at 0.93x (medians of 3 rounds; 0.99x and 0.89x in a run under heavy load). ``log`` rather than ``fsync``: the embedded
shards, and their log folder, end with their trainer's machine, so surviving the machine buys nothing here."""


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
        overrides = [f"seed={seed}"]
        settings = _settings(config_path)
        if "nice" not in settings and "scheduling" not in settings:
            overrides += [f"nice={EMBEDDED_NICE}", f"scheduling={EMBEDDED_SCHEDULING}"]
        if "durability" not in settings:
            overrides.append(f"durability={EMBEDDED_DURABILITY}")
        # The logs live as long as the cluster: a shard the launcher restarts replays its own.
        self._wal_dir = None if settings.get("wal_dir") or settings.get("durability") == "none" else tempfile.mkdtemp(prefix="persia-wal-")
        if self._wal_dir is not None:
            overrides.append(f"wal_dir={self._wal_dir}")
        try:
            if config_path is not None:
                load_ps_config(config_path, overrides)  # a bad setting is named here, as the shards would name it
            self._shards = LocalShards(num_shards, config_path=config_path, overrides=overrides, restart=restart, max_restarts=max_restarts)
        except BaseException:
            self._remove_logs()
            raise
        self.addresses = list(self._shards.addresses)
        self._moving: Optional[Future[ScaleReport]] = None  # the move start_rescale began, until it ends
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

    def rescale(self, num_shards: int, token: Optional[str] = None) -> ScaleReport:
        """Starts shards up to ``num_shards``, or drains those past it, and moves their slots live, from a process of
        its own (``ps scale``: the rows never pass through the caller's interpreter); drained shards stop once their
        clients have followed the new map."""
        if self._moving is not None and not self._moving.done():
            raise RuntimeError("the embedded shards are being rescaled already: wait for that move to end first")
        return self._rescale(num_shards, token)

    def start_rescale(self, num_shards: int, token: Optional[str] = None) -> "Future[ScaleReport]":
        """:meth:`rescale` on a thread of its own, for a caller that goes on training during the move (its clients
        follow the new map when the shards answer with it). One move at a time."""
        if num_shards < 1:
            raise ValueError(f"scale to {num_shards} shards: at least one is needed")
        if self._moving is not None and not self._moving.done():
            raise RuntimeError("the embedded shards are being rescaled already: wait for that move to end first")
        moving: Future[ScaleReport] = Future()
        moving.set_running_or_notify_cancel()

        def move() -> None:
            try:
                moving.set_result(self._rescale(num_shards, token))
            except BaseException as err:  # noqa: BLE001 - the caller reads it from the future
                moving.set_exception(err)

        self._moving = moving
        threading.Thread(target=move, name="persia-rescale", daemon=True).start()
        return moving

    def _rescale(self, num_shards: int, token: Optional[str]) -> ScaleReport:
        before = len(self.addresses)
        if num_shards < 1:
            raise ValueError(f"scale to {num_shards} shards: at least one is needed")
        addresses = self._shards.grow(num_shards) if num_shards > before else self.addresses[:num_shards]
        report = rescale_apart(self.addresses, addresses, token=token)
        if num_shards < before:
            self._shards.shrink(num_shards)
        self.addresses = list(addresses)
        return report

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._shards.stop()
        self._remove_logs()

    def _remove_logs(self) -> None:
        if self._wal_dir is not None:
            shutil.rmtree(self._wal_dir, ignore_errors=True)


def _settings(config_path: Optional[str]) -> dict:
    """What the PS config at ``config_path`` sets (a file that cannot be read or holds a bad value raises the
    :class:`~lightning_persia.remote_ps.config.ConfigError` naming it, as the shards would)."""
    if config_path is None:
        return {}
    try:
        settings = OmegaConf.to_container(OmegaConf.load(config_path))
    except Exception:
        load_ps_config(config_path)  # raises the ConfigError naming the file and the problem
        raise
    if not isinstance(settings, dict):
        load_ps_config(config_path)
        raise ValueError(f"PS config {config_path} is not a mapping")
    return settings
