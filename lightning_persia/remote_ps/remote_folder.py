"""Checkpoint folders named by ``fsspec`` URLs (``s3://``, ``gs://``, ``memory://``...), as a shard saves and loads them.

A shard's checkpoint writer renames files into place and links its disk tier's immutable files: both need a POSIX
file system. So a shard given a URL works on a local staging folder (under its ``TMPDIR``) and the shard itself
copies it through ``fsspec``: a save writes there, then uploads every file (each shard folder's ``manifest.json``
last, so a half-uploaded folder is refused by loads as incomplete); a load downloads the checkpoint first. Each
shard talks to the object store with its own credentials (the environment of its process, as ``fsspec`` reads it),
so shards on other hosts need no file system shared with the trainers. ``file://`` URLs and plain paths are the
shard's own file system and are used in place.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

_MANIFEST = "manifest.json"


def is_remote(directory: str) -> bool:
    """Whether ``directory`` is a URL of a file system other than this machine's (``file://`` is this machine's)."""
    protocol, _ = fsspec.core.split_protocol(directory)
    return protocol is not None and protocol not in LocalFileSystem.protocol


def local_path(directory: str) -> str:
    """The absolute path on this machine of ``directory``, a path or a ``file://`` URL."""
    _, path = fsspec.core.split_protocol(directory)
    return os.path.abspath(path)


@contextlib.contextmanager
def saved_to(url: str) -> Iterator[str]:
    """A local staging folder to save into; its files are uploaded to ``url`` when the block ends without error."""
    staging = tempfile.mkdtemp(prefix="persia-checkpoint-")
    try:
        yield staging
        fs, root = fsspec.core.url_to_fs(url)
        files = sorted(_files_under(staging), key=lambda rel: (os.path.basename(rel) == _MANIFEST, rel))
        for rel in files:
            target = f"{root.rstrip('/')}/{rel}"
            fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(os.path.join(staging, rel), target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def loaded_from(url: str) -> Iterator[str]:
    """A local copy of the checkpoint folder at ``url``, removed when the block ends."""
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    if not fs.isdir(root):
        raise FileNotFoundError(f"no checkpoint folder at {url}")
    staging = tempfile.mkdtemp(prefix="persia-checkpoint-")
    try:
        for path in fs.find(root):
            rel = path[len(root):].lstrip("/") if path.startswith(root) else path.rsplit("/", 1)[-1]
            local = os.path.join(staging, rel)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            fs.get_file(path, local)
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _files_under(root: str) -> list[str]:
    return [os.path.relpath(os.path.join(folder, name), root) for folder, _, names in os.walk(root) for name in names]
