"""A serving bundle on disk: what a trained model needs to answer requests elsewhere, checksummed.

Layout (written by :func:`lightning_persia.serving.export_bundle`)::

    BUNDLE/manifest.json        format, version, the module to rebuild, the twins' settings, checksum of every file
    BUNDLE/dense.safetensors    the LightningModule's state dict (dense weights, tables kept on the trainers)
    BUNDLE/tables/shard-*/...   the parameter-server checkpoint of the tables (any shard count can load it)

A bundle refers to nothing outside its folder, so it can be copied to another machine. Its ``version`` is
the number every answer served from it carries.

This module imports neither Lightning nor torch: parameter-server shards read bundles too
(``lightning-persia ps serve --restore-from BUNDLE``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Iterator, Optional

from lightning_persia import checksum

if TYPE_CHECKING:
    from lightning_persia.data.transform import DataTransform

MANIFEST = "manifest.json"
DENSE_FILE = "dense.safetensors"
TABLES_DIR = "tables"
FORMAT = "lightning-persia-bundle"
FORMAT_VERSION = 2
"""Version 2 checksums files with XXH3-128 (:mod:`lightning_persia.checksum`); version 1 (sha256) still reads."""
READABLE_VERSIONS = (1, 2)


class BundleError(RuntimeError):
    """A bundle (or the checkpoint it is made from) that is missing, incomplete or damaged; the message names the file."""


@dataclass(frozen=True)
class ChecksummedFolder:
    """A folder whose ``manifest.json`` lists every file with its size and checksum (a bundle, a serving delta):
    ``dense.safetensors``, ``tables/shard-*/`` (the parameter-server files) and a model ``version``."""

    path: Path
    manifest: dict[str, Any]
    kind: ClassVar[str] = "bundle"  # how messages name the folder's files

    @property
    def version(self) -> int:
        """The model version every answer served from this folder's weights names."""
        return int(self.manifest["version"])

    @property
    def dense_path(self) -> Path:
        return self.path / DENSE_FILE

    @property
    def tables_path(self) -> Path:
        return self.path / TABLES_DIR

    @property
    def num_shards(self) -> int:
        """Shards that wrote the tables (inference shards may be more or fewer: the tables re-shard on load)."""
        return int(self.manifest["num_shards"])

    def verify(self, names: Optional[Iterable[str]] = None) -> None:
        """Checks that every file of the manifest is there with its size, and the checksum of ``names`` (all if None).

        Raises :class:`BundleError` naming the first file that is missing, truncated or corrupted.
        """
        files: dict[str, dict] = self.manifest["files"]
        for name, entry in files.items():
            path = self._file(name)
            if not path.is_file():
                raise BundleError(f"{self.kind} file {path} is missing")
            if path.stat().st_size != entry["bytes"]:
                raise BundleError(f"{self.kind} file {path} is truncated or damaged: {path.stat().st_size} bytes, the manifest says {entry['bytes']}")
        for name in files if names is None else names:
            entry = files.get(name)
            if entry is None:
                raise BundleError(f"{self.path / MANIFEST} lists no file {name!r}")
            try:
                whole = checksum.matches(entry, self._file(name))
            except ValueError as err:
                raise BundleError(f"{self.path / MANIFEST}: the entry of {name}: {err}") from None
            if not whole:
                raise BundleError(f"{self.kind} file {self._file(name)} is corrupted: its checksum differs from the manifest's")

    def table_manifests(self) -> list[str]:
        """The manifest files of the tables' shard folders (names relative to the folder)."""
        return sorted(name for name in self.manifest["files"] if name.startswith(f"{TABLES_DIR}/") and name.endswith(f"/{MANIFEST}"))

    @classmethod
    def _open(cls, path: str | os.PathLike, format: str, readable_versions: tuple[int, ...], keys: Iterable[str], what: str,
              advice: str):
        path = Path(path).absolute()
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise BundleError(f"{path} is not {what}: it has no {MANIFEST} ({advice})") from None
        except (OSError, ValueError) as err:
            raise BundleError(f"cannot read {manifest_path}: {err}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != format:
            raise BundleError(f"{manifest_path} is not the manifest of {what} (no \"format\": \"{format}\")")
        if manifest.get("format_version") not in readable_versions:
            raise BundleError(
                f"{manifest_path} has format_version {manifest.get('format_version')!r}; this lightning-persia reads "
                f"versions {readable_versions}"
            )
        for key in keys:
            if key not in manifest:
                raise BundleError(f"{manifest_path} is malformed: it has no {key!r}")
        return cls(path, manifest)

    def _file(self, name: str) -> Path:
        path = (self.path / name).resolve()
        if os.path.commonpath([path, self.path.resolve()]) != str(self.path.resolve()):
            raise BundleError(f"{self.path / MANIFEST} names a file outside the {self.kind}: {name!r}")
        return path


@dataclass(frozen=True)
class Bundle(ChecksummedFolder):
    """An exported model, read from ``path`` (see the module docstring for the layout).

    Example::

        bundle = Bundle.open("runs/dlrm/bundle")
        bundle.verify([DENSE_FILE])        # sizes of every file, checksum of the dense weights
        print(bundle.version, bundle.module_class_path)
    """

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Bundle":
        """Reads the manifest of the bundle at ``path``; :class:`BundleError` if there is none or it is not one."""
        return cls._open(path, FORMAT, READABLE_VERSIONS, ("version", "module", "interception", "files"),
                         "a serving bundle", "make one with lightning-persia export")

    # ---- what the manifest says ------------------------------------------------------------------

    @property
    def module_class_path(self) -> str:
        return self.manifest["module"]["class_path"]

    @property
    def module_init_args(self) -> dict[str, Any]:
        return dict(self.manifest["module"]["init_args"])

    @property
    def interception(self) -> dict[str, Any]:
        """The strategy's swap of the embedding modules: kinds, excluded paths, kept-table bound, table configs."""
        return self.manifest["interception"]

    @property
    def ps_seed(self) -> int:
        """Seed of the rows' deterministic initialisation: an id the tables never saw reads its initial row."""
        return int(self.manifest["ps_seed"])

    @property
    def wire_dtype(self) -> str:
        return self.manifest["interception"]["wire_dtype"]

    @property
    def remote_tables(self) -> list[str]:
        return list(self.manifest["remote_tables"])

    @property
    def data_transform(self) -> Optional["DataTransform"]:
        """How the training data module made its batches from its files' values; ``None`` when the checkpoint
        recorded none. Raises :class:`BundleError` when the record is damaged."""
        record = self.manifest.get("data_transform")
        if record is None:
            return None
        from lightning_persia.data.transform import DataTransform  # here: the shards read bundles without torch

        try:
            return DataTransform.from_dict(record)
        except (ValueError, TypeError) as err:
            raise BundleError(f"{self.path / MANIFEST}: its data_transform is not a DataTransform record: {err}") from None


def is_bundle(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder with a bundle manifest (damaged or not)."""
    return (Path(path) / MANIFEST).is_file()


def file_references(node: Any) -> Iterator[dict]:
    """Every ``{"file": ..., <checksum>: ...}`` entry anywhere in a shard manifest (the files it checksums)."""
    if isinstance(node, dict):
        if isinstance(node.get("file"), str) and checksum.algorithm_of(node) is not None:
            yield node
        for value in node.values():
            yield from file_references(value)
    elif isinstance(node, list):
        for value in node:
            yield from file_references(value)
