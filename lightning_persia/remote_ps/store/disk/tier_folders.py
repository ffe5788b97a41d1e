"""Where a shard's disk tiers live: ``<disk_dir>/shard-<i>-of-<n>/``, a folder per table and incarnation.

A shard process claims its folder once, with an exclusive ``flock`` on a lock file in it: a second process that
claims a folder in use is refused, naming it. Whoever claims it first deletes what earlier incarnations left there:
a killed shard's tiers are garbage once it is gone (a restart rebuilds its tables from its checkpoint, whose
segments are hard links of their own, and from its log). Six kills left seven folders (46 MB) before this, and a
shard whose pid repeated (PID 1 in a container) found its old folder and failed to write its demotions. Each tier
is named by a token of its own, never by the pid, so no two tiers ever share a folder.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import threading
import uuid
from pathlib import Path

from lightning_persia.remote_ps.store.errors import StoreError

_LOCK_FILE = ".owner.lock"
_claimed: dict[str, int] = {}  # folders this process holds, and the lock file's descriptor
_claiming = threading.Lock()
_log = logging.getLogger("lightning_persia.ps")


def shard_folder(disk_dir: str | os.PathLike, shard_index: int, num_shards: int) -> Path:
    """The folder of one shard's disk tiers under ``disk_dir``."""
    return Path(disk_dir) / f"shard-{shard_index:05d}-of-{num_shards:05d}"


def claim(folder: Path) -> int:
    """Makes ``folder`` this process's (created if missing), the first time this process asks: deletes what earlier
    incarnations left in it, and returns how many entries that was. Raises :class:`StoreError` when another live
    process holds it."""
    key = str(folder.resolve() if folder.exists() else folder.absolute())
    with _claiming:
        if key in _claimed:
            return 0
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreError(f"the disk folder {folder} is in use by another shard process; give each shard its own "
                                 "disk_dir, or stop the other one") from None
            raise
        _claimed[key] = fd
        left = [entry for entry in folder.iterdir() if entry.name != _LOCK_FILE]
        for entry in left:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        if left:
            _log.info("reclaimed %d disk tier folder(s) that earlier incarnations of the shard left in %s", len(left), folder)
        return len(left)


def tier_folder(folder: Path, table: str) -> Path:
    """A new folder name for a tier of ``table`` in a claimed shard folder, unique to this tier."""
    return folder / f"{table}.{uuid.uuid4().hex[:12]}"
