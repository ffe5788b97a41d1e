"""Where a PersiaStrategy checkpoint keeps its tables, for paths and ``fsspec`` URLs alike.

A checkpoint ``<file>`` (a path or a URL such as ``s3://bucket/run/epoch=1.ckpt``, as ``ModelCheckpoint(dirpath=...)``
names it) has its tables in ``<file>.ps/<save id>/``, one folder per shard, written by the shards themselves
(``remote_ps/remote_folder.py`` says how a shard writes to a URL). Its ``.ckpt`` names the folder relative to its own.

The ``.ckpt``'s ``state_dict`` holds the dense weights only. So that ``LightningModule.load_from_checkpoint`` (which
cannot reach the shards' folder) fails saying where the tables are, instead of only listing the missing keys, the
state dict carries :data:`TABLES_ELSEWHERE_KEY`, which torch reports among the unexpected keys; the strategy drops it
when it loads its own checkpoints.
"""
from __future__ import annotations

import logging
import posixpath
from pathlib import Path
from typing import Any

import fsspec
import torch

from lightning_persia.remote_ps.protocol import COMMIT_MARKER
from lightning_persia.remote_ps.remote_folder import is_remote

log = logging.getLogger(__name__)

TABLES_ELSEWHERE_KEY = (
    "lightning_persia: this checkpoint's embedding tables are in its parameter-server folder (<file>.ps/), not in "
    "state_dict. Resume it with Trainer(strategy=PersiaStrategy(...)).fit(ckpt_path=...); serve it with "
    "lightning_persia.serving.Predictor after `lightning-persia export` (docs/serving.md)"
)


def tables_elsewhere_marker() -> torch.Tensor:
    """The value stored under :data:`TABLES_ELSEWHERE_KEY` (an empty tensor: checkpoints load ``weights_only``)."""
    return torch.zeros(0)


def folder_of(filepath: Any, save_id: str) -> str:
    """The tables' folder of a save of checkpoint ``filepath``."""
    return f"{filepath}.ps/{save_id}"


def relative_name(folder: str) -> str:
    """``folder`` as the ``.ckpt`` records it: ``<file>.ps/<save id>``, relative to the ``.ckpt``'s own folder."""
    parent, save_id = folder.rstrip("/").rsplit("/", 1)
    return f"{posixpath.basename(parent)}/{save_id}"


def folder_named_by(checkpoint_path: Any, relative: str) -> str:
    """The tables' folder that checkpoint ``checkpoint_path`` records as ``relative``."""
    path = str(checkpoint_path)
    if is_remote(path):
        return f"{path.rsplit('/', 1)[0]}/{relative}"
    return str(Path(path).parent / relative)


def remove(folder: str) -> None:
    """Removes ``folder`` and everything under it, if it exists."""
    fs, path = fsspec.core.url_to_fs(folder)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def remove_other_saves(folder: str) -> None:
    """Removes the other saves' folders beside ``folder`` (earlier saves of the same checkpoint file)."""
    fs, path = fsspec.core.url_to_fs(folder)
    path = path.rstrip("/")
    try:
        others = fs.ls(path.rsplit("/", 1)[0], detail=False)
    except FileNotFoundError:  # the shards' file system is not this rank's
        return
    for other in others:
        if other.rstrip("/") != path:
            fs.rm(other, recursive=True)


def mark_committed(folder: str, checkpoint_name: str) -> None:
    """Marks ``folder`` as the tables of a ``.ckpt`` that was written (a shard restoring from a folder of saves
    prefers such a folder); a folder this rank cannot write is left unmarked, as nothing else depends on it."""
    fs, path = fsspec.core.url_to_fs(folder)
    try:
        fs.pipe_file(f"{path.rstrip('/')}/{COMMIT_MARKER}", f"{checkpoint_name}\n".encode())
    except OSError as err:
        log.debug("cannot mark %s committed: %s", folder, err)
