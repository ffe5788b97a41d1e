"""Making a file's or a folder's entries durable: what a checkpoint, a serving bundle and the write-ahead log share.

A rename or a new file is on the disk only once its folder is synced too; a folder whose file system cannot sync
folders (some network file systems refuse ``fsync`` on one) is synced ``best_effort``.
"""
from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike, best_effort: bool = False) -> None:
    """``fsync`` of a file or a folder; ``best_effort``: an error opening or syncing it is ignored."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if best_effort:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not best_effort:
            raise
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` entirely or keeps what it held: written beside it, synced, renamed, folder synced."""
    temporary = path.with_suffix(".tmp")
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync_path(path.parent)
