"""A shard's checkpoint on disk: one folder per shard, plain ``.npy`` arrays and a checksummed manifest.

Layout of a checkpoint written by N shards::

    DIR/shard-00000-of-00002/manifest.json      tables, configs, row counts, sha256 of every file
    DIR/shard-00000-of-00002/<table>.<array>.npy ids, weights, state, access (live rows only)

A shard writes into a temporary folder and renames it into place, so a folder with the final name is
always complete. Every manifest carries the ``save_id`` of the save that wrote it: a checkpoint whose shard
folders come from different saves (a save into the same directory interrupted after some shards had
renamed theirs) is refused, never loaded as a mix. To keep the previous checkpoint loadable while a new one
is written, save into a new directory (PersiaStrategy does: ``<ckpt>.ps/<save_id>/``).
Arrays are read with ``allow_pickle=False``: loading never runs code from the file.
Loading into M shards reads every folder of the checkpoint and keeps the ids that hash to the shard.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
import numpy as np
import torch

from lightning_persia.ops.hashing import shard_of
from lightning_persia.remote_ps.store.errors import CheckpointError
from lightning_persia.remote_ps.store.table import TableSnapshot
from lightning_persia.remote_ps.table_config import ConfigError, TableConfig

FORMAT_VERSION = 1
_ARRAYS = ("ids", "weights", "state", "access")
_FOLDER = re.compile(r"^shard-(\d{5})-of-(\d{5})$")


def shard_folder(directory: str | os.PathLike, shard_index: int, num_shards: int) -> Path:
    return Path(directory) / f"shard-{shard_index:05d}-of-{num_shards:05d}"


def write_shard(
    directory: str | os.PathLike, shard_index: int, num_shards: int, snapshots: list[TableSnapshot], save_id: str = "",
    pause_s: float = 0.0,
) -> Path:
    """Writes one shard's tables under ``directory`` atomically; returns the shard's folder.

    ``pause_s`` (testing only) sleeps after each file, so that a test can kill the writer half-way.
    Raises :class:`CheckpointError` (naming the path) when the files cannot be written; nothing is left behind.
    """
    try:
        return _write_shard(directory, shard_index, num_shards, snapshots, save_id, pause_s)
    except OSError as err:
        final = shard_folder(directory, shard_index, num_shards)
        shutil.rmtree(final.with_name(f".{final.name}.tmp-{os.getpid()}"), ignore_errors=True)
        raise CheckpointError(f"cannot write the checkpoint of shard {shard_index} under {directory}: {err}") from None


def _write_shard(directory, shard_index: int, num_shards: int, snapshots: list[TableSnapshot], save_id: str, pause_s: float) -> Path:
    final = shard_folder(directory, shard_index, num_shards)
    temporary = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    tables = {}
    for position, snapshot in enumerate(snapshots):
        files = {}
        for array in _ARRAYS:
            name = f"t{position:04d}.{array}.npy"
            data = getattr(snapshot, array).numpy()
            with open(temporary / name, "wb") as f:
                np.save(f, data, allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
            files[array] = {"file": name, "sha256": _sha256(temporary / name), "bytes": (temporary / name).stat().st_size}
            if pause_s:
                time.sleep(pause_s)
        tables[snapshot.config.name] = {"config": snapshot.config.to_dict(), "step": snapshot.step, "rows": snapshot.ids.numel(), "files": files}
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
    _fsync_directory(final.parent)
    shutil.rmtree(previous, ignore_errors=True)
    return final


def _fsync_directory(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


COMMIT_MARKER = "COMMITTED"
"""A file that a trainer writes into a checkpoint folder once the rest of its checkpoint (the dense ``.ckpt``)
is written too. Where some candidates carry it, :func:`candidate_checkpoints` offers only those: a PS
checkpoint whose trainer died before its ``.ckpt`` was written is complete but belongs to no checkpoint."""


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


def read_for_shard(directory: str | os.PathLike, shard_index: int, num_shards: int) -> list[TableSnapshot]:
    """The rows of every table in the checkpoint at ``directory`` that belong to shard ``shard_index`` of ``num_shards``.

    Raises :class:`CheckpointError` naming the file when the checkpoint is incomplete or corrupted.
    """
    manifests = _manifests(Path(directory))
    merged: dict[str, list[TableSnapshot]] = {}
    for folder, manifest in manifests:
        try:
            for name, entry in manifest["tables"].items():
                merged.setdefault(name, []).append(_read_table(folder, name, entry, shard_index, num_shards))
        except OSError as err:
            raise CheckpointError(f"cannot read the checkpoint files in {folder}: {err}") from None
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise CheckpointError(f"{folder / 'manifest.json'} is malformed: {type(err).__name__}: {err}") from None
    return [_concat(parts) for parts in merged.values()]


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
    out = []
    for index in range(total):
        path = found[index] / "manifest.json"
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot read {path}: {err}") from None
        if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION or manifest.get("shard_index") != index:
            raise CheckpointError(f"{path} is not a version-{FORMAT_VERSION} manifest of shard {index}")
        out.append((found[index], manifest))
    save_ids = {manifest.get("save_id", "") for _, manifest in out}
    if len(save_ids) > 1:
        raise CheckpointError(
            f"{directory} mixes shard folders of different saves (save ids {sorted(save_ids)}): a save into this "
            "directory was interrupted after some shards had written theirs; it is refused rather than loaded as a mix"
        )
    return out


def _read_table(folder: Path, name: str, entry: dict, shard_index: int, num_shards: int) -> TableSnapshot:
    try:
        config = TableConfig.from_dict(entry["config"])
    except (ConfigError, KeyError) as err:
        raise CheckpointError(f"{folder / 'manifest.json'}: bad config for table {name!r}: {err}") from None
    arrays = {array: _load_array(folder, entry["files"][array]) for array in _ARRAYS}
    rows = entry["rows"]
    for array, data in arrays.items():
        if data.shape[0] != rows:
            raise CheckpointError(f"{folder / entry['files'][array]['file']}: {data.shape[0]} rows, manifest says {rows}")
    ids = torch.from_numpy(arrays["ids"])
    keep = torch.nonzero(shard_of(ids, num_shards) == shard_index).squeeze(1)
    return TableSnapshot(
        config=config,
        step=int(entry["step"]),
        ids=ids[keep],
        **{array: torch.from_numpy(arrays[array])[keep] for array in ("weights", "state", "access")},
    )


def _load_array(folder: Path, spec: dict) -> np.ndarray:
    path = folder / spec["file"]
    if path.resolve().parent != folder.resolve():
        raise CheckpointError(f"{folder / 'manifest.json'} names a file outside its folder: {spec['file']!r}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    if path.stat().st_size != spec["bytes"] or _sha256(path) != spec["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is truncated or corrupted (size or sha256 differs from the manifest)")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {err}") from None


def _concat(parts: list[TableSnapshot]) -> TableSnapshot:
    first = parts[0]
    return TableSnapshot(
        config=first.config,
        step=max(p.step for p in parts),
        **{array: torch.cat([getattr(p, array) for p in parts]) for array in _ARRAYS},
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()

