"""The disk tier of a table in a checkpoint: its immutable segments hard-linked, not copied, and the live slots.

Layout, next to the table's ``.npy`` arrays (which hold the rows it had in memory at the checkpoint's point)::

    shard-.../t0000.disk/segment-000000.rows   records, linked from the tier (same inode: no byte copied)
    shard-.../t0000.disk/segment-000000.ids    the ids of the records, in slot order
    shard-.../t0000.disk/live.bits             which slots held a live row at the point (a bit each, checksummed)
    shard-.../t0000.disk/idmap.bin             the id map at the point (id_map_file.py): what a restart maps

A segment is never written once sealed (:meth:`DiskTier.freeze` seals the open one at the point), so the linked
files keep the bytes of the point while the tier goes on writing new segments. Promotions after the point only
clear live bits in the tier's memory; the checkpoint's ``live.bits`` were copied at the point.
A load into as many shards as saved links the segments into the new tier and maps the saved id map (a checkpoint
saved without one: indexes their live ids from the ids files); a load into

another shard count reads the live records and keeps the ids of the shard (re-sharding), as for the arrays.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from lightning_persia import checksum
from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.store.chunked_rows import FieldSpec
from lightning_persia.remote_ps.store.disk import id_map_file
from lightning_persia.remote_ps.store.disk.records import link, live_records, unpack
from lightning_persia.remote_ps.store.disk.frozen_tier import FrozenTier, segment_files
from lightning_persia.remote_ps.store.errors import CheckpointError
from lightning_persia.remote_ps.store.native.disk_map import DiskMap

_LIVE = "live.bits"
_BLOCK_ROWS = 1 << 20


def write(frozen: FrozenTier, folder: Path, record_bytes: int) -> dict:
    """Links the frozen tier's segments into ``folder`` (created) and writes its live bits; returns the manifest entry."""
    folder.mkdir()
    segments = []
    for (segment, rows), live in zip(frozen.segments, frozen.live):
        for path in segment_files(frozen.directory, segment):
            link(path, folder / path.name)
        segments.append([segment, rows])
    bits = torch.cat(frozen.live).numpy() if frozen.live else np.zeros(0, dtype=np.uint8)
    with open(folder / _LIVE, "wb") as f:
        f.write(memoryview(bits))
        f.flush()
        os.fsync(f.fileno())
    entry = {"folder": folder.name, "record_bytes": record_bytes, "segments": segments,
             "live": {"file": _LIVE, "bytes": int(bits.nbytes), **checksum.of_file(folder / _LIVE)}}
    if frozen.id_map is not None:
        entry["idmap"] = id_map_file.write(frozen.id_map, folder / id_map_file.FILE, frozen.lock)
    return entry


def verify(shard_folder: Path, entry: dict) -> None:
    """Raises :class:`CheckpointError` naming the file when a segment is missing or shorter than its rows, or the
    live bits are damaged."""
    folder = _folder(shard_folder, entry)
    live = folder / entry["live"]["file"]
    if not live.is_file() or live.stat().st_size != entry["live"]["bytes"] or not checksum.matches(entry["live"], live):
        raise CheckpointError(f"checkpoint file {live} is missing, truncated or corrupted")
    if "idmap" in entry:
        path = folder / entry["idmap"]["file"]
        if not path.is_file() or path.stat().st_size != entry["idmap"]["bytes"]:
            raise CheckpointError(f"checkpoint file {path} (the disk tier's id map) is missing or truncated")
    for segment, rows in entry["segments"]:
        records, ids = segment_files(folder, segment)
        for path, size in ((records, rows * entry["record_bytes"]), (ids, rows * 8)):
            if not path.is_file():
                raise CheckpointError(f"disk segment {path} of the checkpoint is missing")
            if path.stat().st_size < size:
                raise CheckpointError(f"disk segment {path} of the checkpoint is truncated ({path.stat().st_size} of {size} bytes)")


def segments(shard_folder: Path, entry: dict) -> Iterator[tuple[int, int, Path, Path, torch.Tensor]]:
    """``(number, rows, records file, ids file, live bits)`` of each segment (for :meth:`DiskTier.attach`)."""
    folder = _folder(shard_folder, entry)
    bits = torch.from_numpy(np.fromfile(folder / entry["live"]["file"], dtype=np.uint8))
    start = 0
    for segment, rows in entry["segments"]:
        records, ids = segment_files(folder, segment)
        yield segment, rows, records, ids, bits[start : start + ((rows + 7) >> 3)]
        start += (rows + 7) >> 3


def id_map(shard_folder: Path, entry: dict) -> Optional[Callable[[DiskMap], None]]:
    """What maps the checkpoint's saved id map into a tier's empty map (for :meth:`DiskTier.attach`); ``None`` for
    a checkpoint saved without one (its ids are then indexed from the ids files)."""
    if "idmap" not in entry:
        return None
    path = _folder(shard_folder, entry) / entry["idmap"]["file"]
    return lambda disk_map: id_map_file.adopt(disk_map, path, entry["idmap"])


def rows(shard_folder: Path, entry: dict, specs: dict[str, FieldSpec], shard_index: int, shard_map: ShardMap) -> Iterator[dict[str, torch.Tensor]]:
    """``{field: values}`` of the live rows that ``shard_map`` puts on shard ``shard_index``, a block at a time."""
    try:
        for block in live_records(segments(shard_folder, entry), entry["record_bytes"], _BLOCK_ROWS):
            values = unpack(block, specs)
            keep = shard_map.shard_of(values["ids"]) == shard_index
            yield {name: array[keep] for name, array in values.items()}
    except OSError as err:
        raise CheckpointError(f"the checkpoint is truncated: {err.strerror or err}") from None


def _folder(shard_folder: Path, entry: dict) -> Path:
    folder = shard_folder / entry["folder"]
    if folder.resolve().parent != shard_folder.resolve():
        raise CheckpointError(f"{shard_folder / 'manifest.json'} names a disk folder outside its folder: {entry['folder']!r}")
    return folder
