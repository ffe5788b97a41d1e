"""The disk tier's id map in a checkpoint: written partition by partition at a save, mapped whole by a load.

A restarted shard that indexed every id of its segments again spent ~0.1 to 0.2 us of CPU an id on disk (a read of
8 bytes and a hash insert, at random places of a map of 12 bytes an id): over a minute for a billion ids. The map
saved with the checkpoint is instead mapped as it is (a copy on write): the load reads its table of partitions, and
the pages of the entries come in as lookups touch them.

Layout (``idmap.bin`` beside the linked segments, little-endian)::

    magic (8 bytes) | version (u32) | partitions (u32) | per partition: byte offset, entries, live (3 x i64)
    then each partition's entries (u64: fingerprint << 32 | slot + 1; 0 empty), at the offsets of the table

The header and the table are checksummed in the manifest; the entries are not (reading them all would be what
mapping them avoids): a damaged entry makes its id look absent (a lookup confirms every match against the id in
the record it reads), never another id's row.
"""
from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import numpy as np

from lightning_persia import checksum
from lightning_persia.remote_ps.store.errors import CheckpointError
from lightning_persia.remote_ps.store.native.disk_map import DiskMap

FILE = "idmap.bin"
MAGIC = b"LPDMAP\0\0"
VERSION = 1
_HEADER = struct.Struct("<8sII")


def write(disk_map: DiskMap, path: Path, lock: threading.Lock) -> dict:
    """Writes ``disk_map`` as at its save's point (:meth:`DiskMap.save_begin`, taken by ``DiskTier.freeze``) to
    ``path``, each partition copied with ``lock`` (its table's) held, written without it; ends the save. Returns the
    manifest entry."""
    parts = DiskMap.PARTS
    table = np.zeros((parts, 3), dtype="<i8")
    offset = _HEADER.size + table.nbytes
    try:
        with open(path, "wb") as f:
            f.seek(offset)
            for part in range(parts):
                with lock:
                    entries, live = disk_map.save_part(part)
                f.write(memoryview(entries.numpy()).cast("B"))
                table[part] = (offset, entries.numel(), live)
                offset += entries.numel() * 8
            head = _HEADER.pack(MAGIC, VERSION, parts) + table.tobytes()
            f.seek(0)
            f.write(head)
            f.flush()
            os.fsync(f.fileno())
    finally:
        with lock:
            disk_map.save_end()
    digest = checksum.Digest()
    digest.update(head)
    return {"file": path.name, "bytes": offset, "head": digest.entry()}


def adopt(disk_map: DiskMap, path: Path, entry: dict) -> None:
    """Maps the id map of a checkpoint's ``entry`` (written by :func:`write`) into ``disk_map`` (empty). Raises
    :class:`CheckpointError` naming the file when it is missing, truncated, of another version or its header is
    damaged."""
    parts = DiskMap.PARTS
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise CheckpointError(f"checkpoint file {path} cannot be opened: {err.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEADER.size + parts * 24, 0)
        digest = checksum.Digest.like(entry["head"])
        digest.update(head)
        if size != entry["bytes"] or len(head) != _HEADER.size + parts * 24 or not digest.matches(entry["head"]):
            raise CheckpointError(f"checkpoint file {path} is truncated or its header is damaged")
        magic, version, count = _HEADER.unpack_from(head)
        if magic != MAGIC or version != VERSION or count != parts:
            raise CheckpointError(f"checkpoint file {path} is an id map of version {version} with {count} partitions; "
                                  f"this version reads version {VERSION} with {parts}")
        table = np.frombuffer(head, dtype="<i8", offset=_HEADER.size).reshape(parts, 3)
        try:
            disk_map.adopt(fd, size, [tuple(int(v) for v in row) for row in table])
        except (ValueError, OSError) as err:
            raise CheckpointError(f"checkpoint file {path}: {err}") from None
    finally:
        os.close(fd)  # the mapping keeps the file's pages
