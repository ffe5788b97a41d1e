"""A shard's checkpoint on disk: one folder per shard, ``.npy`` arrays streamed chunk by chunk, a checksummed manifest.

Layout of a checkpoint written by N shards::

    DIR/shard-00000-of-00002/manifest.json      tables, configs, row counts, the checksum of every file
    DIR/shard-00000-of-00002/<table>.<array>.npy ids, weights, state, access (live rows only)

Saving streams: each table hands out its rows one chunk at a time (``Table.begin_snapshot``: one consistent
point for the whole shard, taken before the first chunk), each chunk is appended to the table's ``.npy`` files
and to their running checksums (:mod:`lightning_persia.checksum`), then dropped; the extra memory is a chunk,
not the table. Loading streams too: the files are checked against the manifest (size and checksum) before any
table is replaced, then read a block of rows at a time, the next block's bytes asked of the disk while the
current one is stored. A shard that holds no table has nothing a damaged checkpoint could cost it: it checks the
checksums while it reads the rows, in one pass over the disk instead of two. Weights are stored in the table's
``storage_dtype`` (fp16 or fp32); format version 1 (always fp32, written before chunked tables) still loads.

A shard writes into a temporary folder and renames it into place, so a folder with the final name is
always complete. Every manifest carries the ``save_id`` of the save that wrote it: a checkpoint whose shard
folders come from different saves (a save into the same directory interrupted after some shards had
renamed theirs) is refused, never loaded as a mix. To keep the previous checkpoint loadable while a new one
is written, save into a new directory (PersiaStrategy does: ``<ckpt>.ps/<save_id>/``).
Arrays are read with their header parsed by numpy and never unpickled: loading never runs code from the file.
Loading into M shards reads every folder of the checkpoint and keeps the ids that hash to the shard; into the
same number of shards, each shard reads only its own folder.

The writer and the reader of the format are this one module, so that a change to one is read beside the other.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from lightning_persia import checksum
from lightning_persia.durable import fsync_path
from lightning_persia.ops.hashing import shard_of
from lightning_persia.remote_ps.protocol import COMMIT_MARKER
from lightning_persia.remote_ps.store.disk import checkpoint as disk_checkpoint
from lightning_persia.remote_ps.store.errors import CheckpointError, StoreError
from lightning_persia.remote_ps.store.progress import Progress, begin
from lightning_persia.remote_ps.store.table_snapshot import SAVED_FIELDS, TableSnapshot
from lightning_persia.remote_ps.table_config import ConfigError, TableConfig

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
"""3: files checksummed with XXH3-128 (:mod:`lightning_persia.checksum`); 1 and 2 (sha256) still load."""
BLOCK_ROWS = 1 << 20
"""Rows read at a time when loading (a block of every array of a table)."""
_SPOOL_BLOCK = 1 << 24
_FOLDER = re.compile(r"^shard-(\d{5})-of-(\d{5})$")
_DTYPES = {"ids": ("<i8",), "access": ("<i4",), "state": ("<f4",), "weights": ("<f2", "<f4")}


def shard_folder(directory: str | os.PathLike, shard_index: int, num_shards: int) -> Path:
    return Path(directory) / f"shard-{shard_index:05d}-of-{num_shards:05d}"


# ---- writing -------------------------------------------------------------------------------------------


def write_shard(
    directory: str | os.PathLike, shard_index: int, num_shards: int, snapshots: list[TableSnapshot], save_id: str = "",
    pause_s: float = 0.0, progress: Optional[Progress] = None,
) -> Path:
    """Writes one shard's tables under ``directory`` atomically, a chunk of rows at a time; returns the folder.

    ``progress`` follows each table's save (a "save" job per table). ``pause_s`` (testing only) sleeps after each
    chunk, so that a test can kill the writer or change the table half-way.
    Raises :class:`CheckpointError` (naming the path) when the files cannot be written; nothing is left behind.
    """
    final = shard_folder(directory, shard_index, num_shards)
    temporary = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        return _write_shard(final, temporary, shard_index, num_shards, snapshots, save_id, pause_s, progress)
    except OSError as err:
        raise CheckpointError(f"cannot write the checkpoint of shard {shard_index} under {directory}: {err}") from None
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _write_shard(final: Path, temporary: Path, shard_index: int, num_shards: int, snapshots: list[TableSnapshot],
                 save_id: str, pause_s: float, progress: Optional[Progress]) -> Path:
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    tables = {}
    for position, snapshot in enumerate(snapshots):
        writers = {name: _ArrayWriter(temporary / f"t{position:04d}.{name}.npy", spec.dtype, spec.shape(0)[1:], snapshot.rows)
                   for name, spec in snapshot.field_specs.items()}
        written = 0
        job = begin(progress, "save", snapshot.config.name, snapshot.rows)
        try:
            # One thread per file writes and hashes chunk i while the table copies chunk i + 1 (file writes,
            # the checksum and the copy's tensor ops all release the GIL): at most two chunks in memory.
            with ThreadPoolExecutor(len(writers), thread_name_prefix="persia-ps-save") as pool:
                pending: list[Future] = []
                for chunk in snapshot.chunks():
                    for future in pending:
                        future.result()
                    pending = [pool.submit(writer.append, chunk[name]) for name, writer in writers.items()]
                    written += chunk["ids"].numel()
                    job.advance(chunk["ids"].numel())
                    if pause_s:
                        time.sleep(pause_s)
                for future in pending:
                    future.result()
            job.finish()
        finally:
            for writer in writers.values():
                writer.close()
        if snapshot.rows is not None and written != snapshot.rows:
            raise StoreError(f"table {snapshot.config.name!r}: {written} rows written for the {snapshot.rows} of its snapshot")
        files = {name: writer.entry() for name, writer in writers.items()}
        entry = {"config": snapshot.config.to_dict(), "step": snapshot.step, "rows": written, "point": snapshot.point,
                 "since": snapshot.since, "files": files}
        if snapshot.disk is not None:  # linked, not copied
            entry["disk"] = disk_checkpoint.write(snapshot.disk, temporary / f"t{position:04d}.disk", snapshot.disk_record_bytes)
        if snapshot.since:
            removed = _ArrayWriter(temporary / f"t{position:04d}.removed.npy", torch.int64, (), snapshot.removed.numel())
            removed.append(snapshot.removed)
            removed.close()
            entry["removed"] = {"rows": snapshot.removed.numel(), **removed.entry()}
        tables[snapshot.config.name] = entry
    manifest = {"format_version": FORMAT_VERSION, "shard_index": shard_index, "num_shards": num_shards,
                "save_id": save_id, "tables": tables}
    with open(temporary / "manifest.json", "w") as f:
        f.write(json.dumps(manifest, indent=1))
        f.flush()
        os.fsync(f.fileno())
    previous = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(previous)
    temporary.rename(final)
    fsync_path(final.parent, best_effort=True)
    shutil.rmtree(previous, ignore_errors=True)
    return final


class _ArrayWriter:
    """One ``.npy`` file appended a block of rows at a time and hashed on the way.

    With ``rows`` known the header comes first; otherwise (a delta, whose row count is known once written) the
    rows go to a spool file and the ``.npy`` is assembled from it when closed.
    """

    def __init__(self, path: Path, dtype: torch.dtype, row_shape: tuple[int, ...], rows: Optional[int]) -> None:
        self.path = path
        self.rows = 0
        self._dtype = torch.empty(0, dtype=dtype).numpy().dtype.newbyteorder("<")
        self._row_shape = row_shape
        self._digest = checksum.Digest()
        self._spool = path.with_name(path.name + ".rows") if rows is None else None
        self._file = open(self._spool or path, "wb")
        if rows is not None:
            self._write(self._header(rows))

    def _header(self, rows: int) -> memoryview:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(self._dtype),
                                                      "fortran_order": False, "shape": (rows, *self._row_shape)})
        return header.getbuffer()

    def _write(self, data: memoryview) -> None:
        self._file.write(data)
        if self._spool is None:
            self._digest.update(data)

    def append(self, values: torch.Tensor) -> None:
        array = np.ascontiguousarray(values.numpy(), dtype=self._dtype)
        self.rows += array.shape[0]
        if array.size:
            self._write(memoryview(array.reshape(-1)).cast("B"))

    def close(self) -> None:
        if self._file.closed:
            return
        if self._spool is not None:
            self._file.close()
            self._file = open(self.path, "wb")
            self._digest.update(header := self._header(self.rows))
            self._file.write(header)
            with open(self._spool, "rb") as spooled:
                for block in iter(lambda: spooled.read(_SPOOL_BLOCK), b""):
                    self._file.write(block)
                    self._digest.update(block)
            self._spool.unlink()
            self._spool = None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def entry(self) -> dict:
        return {"file": self.path.name, **self._digest.entry(), "bytes": self.path.stat().st_size}


def is_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds shard folders (complete or not)."""
    path = Path(directory)
    return path.is_dir() and any(_FOLDER.match(child.name) for child in path.iterdir())


def candidate_checkpoints(root: str | os.PathLike, max_depth: int = 3) -> list[Path]:
    """Folders at or under ``root`` that hold shard folders, newest first (by their newest manifest).

    ``root`` may be a checkpoint itself, the ``<ckpt>.ps`` folder of PersiaStrategy, or a folder of many
    checkpoints. Completeness is not checked here: :func:`read_for_shard` does that when loading. If any
    candidate carries :data:`COMMIT_MARKER`, only the committed ones are returned.
    """
    found: list[tuple[float, Path]] = []

    def visit(path: Path, depth: int) -> None:
        try:
            children = [c for c in path.iterdir() if c.is_dir()]
        except OSError:
            return
        shard_dirs = [c for c in children if _FOLDER.match(c.name)]
        if shard_dirs:
            stamps = [(c / "manifest.json").stat().st_mtime for c in shard_dirs if (c / "manifest.json").is_file()]
            found.append((max(stamps, default=0.0), path))
            return
        if depth < max_depth:
            for child in children:
                if not child.name.startswith("."):
                    visit(child, depth + 1)

    visit(Path(root), 0)
    ordered = [path for _, path in sorted(found, key=lambda item: item[0], reverse=True)]
    committed = [path for path in ordered if (path / COMMIT_MARKER).is_file()]
    return committed or ordered


# ---- reading -------------------------------------------------------------------------------------------


@dataclass
class _Part:
    """One table's arrays in one shard folder of a checkpoint."""

    folder: Path
    entry: dict


@dataclass
class TableSource:
    """One table of a checkpoint as a shard reloads it: its config, step, and the folders holding its rows.

    ``since`` is 0 for a whole table; a delta (``ShardStore.save_delta``) holds the rows written after the point
    ``since`` and the ids evicted after it (:meth:`removed`).
    """

    name: str
    config: TableConfig
    step: int
    parts: list[_Part]
    since: int = 0
    checked: bool = True  # the files' checksums were checked when opened; else :meth:`blocks` checks them

    def removed(self, shard_index: int, num_shards: int) -> torch.Tensor:
        """The ids of this shard that the delta removes (none for a whole table)."""
        found = []
        for part in self.parts:
            spec = part.entry.get("removed")
            if spec is None:
                continue
            reader = _ArrayReader(part.folder, {"rows": spec["rows"], "files": {"ids": spec}}, "ids")
            try:
                ids = reader.read(spec["rows"])
            finally:
                reader.close()
            found.append(ids[shard_of(ids, num_shards) == shard_index])
        return torch.cat(found) if found else torch.empty(0, dtype=torch.int64)

    def own_folder(self, num_shards: int) -> Optional[Path]:
        """The one folder this table is read from when the checkpoint was saved by ``num_shards`` shards, else None."""
        return self.parts[0].folder if len(self.parts) == 1 and num_shards == _saved_shards(self.parts[0]) else None

    def disk_parts(self) -> list[tuple[Path, dict]]:
        """``(shard folder, disk entry)`` of each part that holds a disk tier."""
        return [(part.folder, part.entry["disk"]) for part in self.parts if "disk" in part.entry]

    def rows_for(self, num_shards: int) -> int:
        """About how many rows one of ``num_shards`` shards gets (the ids spread evenly over the shards)."""
        total = sum(part.entry["rows"] for part in self.parts)
        return total if len(self.parts) == 1 and num_shards == _saved_shards(self.parts[0]) else total // num_shards + 1

    def blocks(self, shard_index: int, num_shards: int, block_rows: Optional[int] = None,
               progress: Optional[Progress] = None) -> Iterator[dict[str, torch.Tensor]]:
        """``{field: rows}`` of the rows that belong to shard ``shard_index`` of ``num_shards``, block by block; a
        block's tensors are valid until the block after the next one is asked for (two sets of read buffers are
        used in turn: a block can be indexed while the next one is read).

        Raises :class:`CheckpointError` naming the file when one cannot be read as the manifest describes it,
        or, for files not :attr:`checked` when opened, once their last block is read and their checksum differs:
        the blocks before it were damaged too, so whoever stored them must drop them. ``progress`` follows the rows
        read (a "load" job, or "re-shard" when the rows come from another shard count and are sifted).
        """
        block_rows = block_rows or BLOCK_ROWS
        resharding = not (len(self.parts) == 1 and num_shards == _saved_shards(self.parts[0]))
        job = begin(progress, "re-shard" if resharding else "load", self.name, sum(part.entry["rows"] for part in self.parts))
        for part in self.parts:
            # a folder that only this shard reads leaves the page cache as it is read: a table's own memory then
            # does not compete with a copy of its checkpoint, and the next block reuses the pages just freed
            own = len(self.parts) == 1 and num_shards == _saved_shards(part)
            readers = {name: _ArrayReader(part.folder, part.entry, name, check=not self.checked, drop_behind=own)
                       for name in SAVED_FIELDS}
            try:
                for start in range(0, part.entry["rows"], block_rows):
                    count = min(block_rows, part.entry["rows"] - start)
                    block = {name: reader.read(count) for name, reader in readers.items()}
                    job.advance(count)
                    if not own:
                        keep = torch.nonzero(shard_of(block["ids"], num_shards) == shard_index).squeeze(1)
                        block = {name: values[keep] for name, values in block.items()}
                    yield block
                for reader in readers.values():
                    reader.check()
            finally:
                for reader in readers.values():
                    reader.close()
        job.finish()


def open_for_shard(directory: str | os.PathLike, shard_index: int, num_shards: int, check_first: bool = True,
                   own_part: bool = False) -> list[TableSource]:
    """The tables of the checkpoint at ``directory``, as shard ``shard_index`` of ``num_shards`` reloads them.

    Every file the shard will read is checked first (size and checksum against the manifest), so a load can replace
    the tables only once the checkpoint is known to be whole. With ``check_first=False`` (a shard that holds no
    table) only the sizes are, and :meth:`TableSource.blocks` checks the checksums while it reads the rows.
    Into as many shards as saved it, a shard reads its own folder (the hash puts no id of it anywhere else);
    otherwise it reads every folder and keeps its ids.
    ``own_part``: where the checkpoint holds this shard's own folder (saved by as many shards), that folder alone is
    read, whatever became of the others: the part of a save a shard's write-ahead log follows, which the shard wrote
    itself, while the other shards may still be writing theirs (or never finish).
    Raises :class:`CheckpointError` naming the file when the checkpoint is incomplete or corrupted.
    """
    own = shard_folder(directory, shard_index, num_shards)
    if own_part and (own / "manifest.json").is_file():
        manifests = [(own, _read_manifest(own / "manifest.json", shard_index))]
    else:
        manifests = _manifests(Path(directory))
    if len(manifests) == num_shards:
        manifests = [manifests[shard_index]]
    sources: dict[str, TableSource] = {}
    files: list[tuple[Path, dict]] = []
    for folder, manifest in manifests:
        try:
            for name, entry in manifest["tables"].items():
                config = _table_config(folder, name, entry)
                files += [(folder, entry["files"][array]) for array in SAVED_FIELDS]
                if "removed" in entry:
                    files.append((folder, entry["removed"]))
                if "disk" in entry:
                    disk_checkpoint.verify(folder, entry["disk"])
                source = sources.setdefault(name, TableSource(name, config, int(entry["step"]), [], int(entry.get("since", 0)),
                                                              checked=check_first))
                source.step = max(source.step, int(entry["step"]))
                source.parts.append(_Part(folder, entry))
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise CheckpointError(f"{folder / 'manifest.json'} is malformed: {type(err).__name__}: {err}") from None
    # the checksum releases the GIL: the files are checked in parallel, at the speed of the disk or of every core
    with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="persia-ps-verify") as pool:
        checks = [pool.submit(_verify, folder, spec, check_first) for folder, spec in files]
        for check in checks:
            try:
                check.result()
            except OSError as err:
                raise CheckpointError(f"cannot read the checkpoint files in {directory}: {err}") from None
    for source in sources.values():  # each array's header: the dtype and rows its manifest says
        for part in source.parts:
            for array in SAVED_FIELDS:
                _ArrayReader(part.folder, part.entry, array).close()
    return list(sources.values())


def _read_manifest(path: Path, index: int) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") not in READABLE_VERSIONS or manifest.get("shard_index") != index:
        raise CheckpointError(f"{path} is not a manifest of shard {index} in a format this version reads {READABLE_VERSIONS}")
    return manifest


def _saved_shards(part: _Part) -> int:
    match = _FOLDER.match(part.folder.name)
    return int(match.group(2)) if match else -1


def _table_config(folder: Path, name: str, entry: dict) -> TableConfig:
    try:
        return TableConfig.from_dict(entry["config"])
    except (ConfigError, KeyError) as err:
        raise CheckpointError(f"{folder / 'manifest.json'}: bad config for table {name!r}: {err}") from None


def _manifests(directory: Path) -> list[tuple[Path, dict]]:
    try:
        return _read_manifests(directory)
    except OSError as err:
        raise CheckpointError(f"cannot read the parameter-server checkpoint at {directory}: {err}") from None


def _read_manifests(directory: Path) -> list[tuple[Path, dict]]:
    if not directory.is_dir():
        raise CheckpointError(f"no parameter-server checkpoint at {directory}")
    found: dict[int, Path] = {}
    totals = set()
    for child in directory.iterdir():
        match = _FOLDER.match(child.name)
        if match:
            found[int(match.group(1))] = child
            totals.add(int(match.group(2)))
    if len(totals) != 1:
        raise CheckpointError(f"{directory} holds no complete parameter-server checkpoint (shard folders for counts {sorted(totals)})")
    total = totals.pop()
    missing = sorted(set(range(total)) - set(found))
    if missing:
        raise CheckpointError(f"{directory} is incomplete: shard folders {missing} of {total} are missing")
    out = [(found[index], _read_manifest(found[index] / "manifest.json", index)) for index in range(total)]
    save_ids = {manifest.get("save_id", "") for _, manifest in out}
    if len(save_ids) > 1:
        raise CheckpointError(
            f"{directory} mixes shard folders of different saves (save ids {sorted(save_ids)}): a save into this "
            "directory was interrupted after some shards had written theirs; it is refused rather than loaded as a mix"
        )
    return out


def _path(folder: Path, spec: dict) -> Path:
    path = folder / spec["file"]
    if path.resolve().parent != folder.resolve():
        raise CheckpointError(f"{folder / 'manifest.json'} names a file outside its folder: {spec['file']!r}")
    return path


def _verify(folder: Path, spec: dict, with_checksum: bool) -> None:
    path = _path(folder, spec)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        checksum.required_algorithm(spec)
    except ValueError as err:
        raise CheckpointError(f"{folder / 'manifest.json'}: the entry of {path.name}: {err}") from None
    if path.stat().st_size != spec["bytes"] or (with_checksum and not checksum.matches(spec, path)):
        raise _damaged(path)


def _damaged(path: Path) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path} is truncated or corrupted (size or checksum differs from the manifest)")


class _ArrayReader:
    """Rows of one ``.npy`` array of a table, read a block at a time after its header (never unpickled); with
    ``check``, hashed on the way for :meth:`check`; with ``drop_behind``, each block's pages leave the page cache
    once read."""

    def __init__(self, folder: Path, entry: dict, name: str, check: bool = False, drop_behind: bool = False) -> None:
        spec = entry["files"][name]
        self.path = _path(folder, spec)
        self._file = open(self.path, "rb")
        try:
            major, _ = np.lib.format.read_magic(self._file)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(self._file)
        except (ValueError, OSError, EOFError) as err:
            self._file.close()
            raise CheckpointError(f"checkpoint file {self.path} cannot be read: {err}") from None
        rows = entry["rows"]
        if fortran or not shape or shape[0] != rows or dtype.str not in _DTYPES[name]:
            self._file.close()
            raise CheckpointError(f"checkpoint file {self.path} holds {dtype} {shape}, not the {rows} rows of {name} "
                                  f"({' or '.join(_DTYPES[name])}) that its manifest describes")
        self._dtype = dtype
        self._width = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        self._shape = shape[1:]
        self._buffers: list[Optional[np.ndarray]] = [None, None]
        self._reads = 0
        self._spec = spec
        self._drop_behind = drop_behind
        self._digest: Optional[checksum.Digest] = None
        if check:
            self._digest = checksum.Digest.like(spec)  # an algorithm this version knows: _verify saw to it
            self._digest.update(os.pread(self._file.fileno(), self._file.tell(), 0))  # the header

    def read(self, rows: int) -> torch.Tensor:
        """The next ``rows`` rows, in one of two buffers used in turn (no fresh memory per block): valid until the
        read after the next one."""
        count = rows * self._width
        turn = self._reads % 2
        self._reads += 1
        if self._buffers[turn] is None or self._buffers[turn].size < count:
            self._buffers[turn] = np.empty(count, dtype=self._dtype.newbyteorder("="))
        data = self._buffers[turn][:count]
        if self._file.readinto(memoryview(data).cast("B")) != data.nbytes:
            raise CheckpointError(f"checkpoint file {self.path} ends early")
        if hasattr(os, "posix_fadvise"):  # the disk reads the next block while this one is stored
            end = self._file.tell()
            os.posix_fadvise(self._file.fileno(), end, data.nbytes, os.POSIX_FADV_WILLNEED)
            if self._drop_behind:
                os.posix_fadvise(self._file.fileno(), end - data.nbytes, data.nbytes, os.POSIX_FADV_DONTNEED)
        if self._digest is not None:
            self._digest.update(memoryview(data).cast("B"))
        if self._dtype.byteorder == ">" or (self._dtype.byteorder == "=" and sys.byteorder == "big"):
            data.byteswap(inplace=True)
        return torch.from_numpy(data.reshape((rows, *self._shape)))

    def check(self) -> None:
        """Raises :class:`CheckpointError` when the bytes read so far (every row, with ``check``) are not those
        whose checksum the manifest holds."""
        if self._digest is not None and not self._digest.matches(self._spec):
            raise _damaged(self.path)

    def close(self) -> None:
        self._file.close()

