"""``PublishDeltas``: a training run under PersiaStrategy publishes its model as versioned deltas for serving."""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from safetensors.torch import save_file

from lightning_persia import checksum
from lightning_persia.durable import fsync_path
from lightning_persia.remote_ps.client import PSError
from lightning_persia.serving.bundle import DENSE_FILE, MANIFEST, TABLES_DIR, BundleError, file_references
from lightning_persia.serving.delta import DELTA_FORMAT, DELTA_FORMAT_VERSION, DeltaError, delta_path, published_versions
from lightning_persia.strategy.persia import PersiaStrategy

log = logging.getLogger(__name__)


class PublishDeltas(Callback):
    """Every ``every_n_train_steps`` training steps, writes the next model version under ``dirpath`` for serving.

    Version ``v + 1`` holds the rows the parameter-server shards changed since version ``v`` (ids and rows in
    the tables' storage dtype, fp16 or fp32, with their optimizer state; the ids evicted since), the dense
    weights (the LightningModule's state dict, safetensors) and a manifest with the version, its base version,
    the training step and the checksum of every file. It is written into a temporary folder and renamed into place,
    so a reader never sees half of one. In-flight embedding updates of every rank are drained first, as for a
    checkpoint, so a version is one consistent point of training; rank 0 writes it while the others wait.

    The first version a training process publishes holds the tables whole (the shards know no earlier point;
    the same after a shard restart or a rollback): it applies on top of any earlier version. Its base is
    ``base_version``, by default the newest version under ``dirpath``, or 1 when there is none (the version a
    bundle gets from ``lightning-persia export``). Serve the bundle exported before training goes on, with
    ``lightning-persia serve BUNDLE --deltas DIR``: the endpoint applies each new version between two batches.

    A version that cannot be written (a shard that restarted, a full disk) is logged and skipped: training goes
    on, and the next version carries its changes.

    Example::

        trainer = L.Trainer(strategy=PersiaStrategy(), callbacks=[PublishDeltas("runs/dlrm/deltas", every_n_train_steps=100)])

    or in LightningCLI YAML: ``trainer.callbacks: [{class_path: lightning_persia.PublishDeltas, init_args:
    {dirpath: runs/dlrm/deltas, every_n_train_steps: 100}}]``.

    Args:
        dirpath: the folder of the versions (shared by every shard and rank 0, like checkpoints).
        every_n_train_steps: publish after every this many optimizer steps.
        base_version: the version the first delta of this run applies to (default: see above).
    """

    def __init__(self, dirpath: str | os.PathLike, every_n_train_steps: int = 100, base_version: Optional[int] = None) -> None:
        if every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1, got {every_n_train_steps}")
        if base_version is not None and base_version < 0:
            raise ValueError(f"base_version must be >= 0, got {base_version}")
        self.dirpath = Path(dirpath).absolute()
        self.every_n_train_steps = every_n_train_steps
        self.base_version = base_version
        self._version: Optional[int] = None  # the last version this process published
        self._save_id = ""  # its save id on the shards: the next delta is what changed since
        self._last_step = -1

    @property
    def version(self) -> Optional[int]:
        """The last version this callback published (``None`` before the first)."""
        return self._version

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, PersiaStrategy) or strategy.client is None:
            raise TypeError(f"PublishDeltas publishes the tables of PersiaStrategy's shards; this trainer runs {type(strategy).__name__}")
        if trainer.is_global_zero:
            try:
                self.dirpath.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise OSError(f"PublishDeltas cannot create its folder {self.dirpath}: {err}") from None
            newest = max(published_versions(self.dirpath), default=None)
            if self._version is None and self.base_version is not None and newest is not None and newest > self.base_version:
                raise ValueError(f"PublishDeltas(base_version={self.base_version}): {self.dirpath} holds version {newest} already; "
                                 "publish into another folder, or leave base_version unset to continue from the newest")

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step or step % self.every_n_train_steps:
            return  # not a multiple of N, or a micro-batch of gradient accumulation after its step
        self._last_step = step
        self.publish(trainer, pl_module)

    def publish(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Optional[int]:
        """Publishes the model as it is now as the next version (every rank calls it); rank 0 returns the version
        written, ``None`` when it could not be (the reason is logged)."""
        strategy = trainer.strategy
        assert isinstance(strategy, PersiaStrategy) and strategy.client is not None
        step_time = time.time()
        if strategy.pipeline is not None:
            strategy.pipeline.drain()
        strategy.barrier("persia_publish_delta")  # every rank's updates of this step are on the shards
        version = None
        if trainer.is_global_zero:
            try:
                version = self._write(strategy, trainer, pl_module, step_time)
            except (PSError, OSError, BundleError) as err:
                log.error("PublishDeltas: no version published at step %d (the next one carries its changes): %s", trainer.global_step, err)
        strategy.barrier("persia_publish_delta_done")
        return version

    def _write(self, strategy: PersiaStrategy, trainer: "pl.Trainer", pl_module: "pl.LightningModule", step_time: float) -> int:
        started = time.perf_counter()
        base = self._version if self._version is not None else self._first_base()
        version = base + 1
        final = delta_path(self.dirpath, version)
        if final.exists():
            raise DeltaError(f"{final} exists already: does another run publish into {self.dirpath}?")
        temporary = self.dirpath / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(temporary, ignore_errors=True)
        save_id = f"v{version}-{uuid.uuid4().hex[:12]}"
        try:
            temporary.mkdir(parents=True)
            tables = self._save_tables(strategy, temporary / TABLES_DIR, save_id)
            # safetensors refuses tensors that share memory; a copy of each costs the dense weights once more
            save_file({k: v.detach().cpu().clone().contiguous() for k, v in pl_module.state_dict().items()}, str(temporary / DENSE_FILE))
            files = _files(temporary)
            manifest = {
                "format": DELTA_FORMAT, "format_version": DELTA_FORMAT_VERSION, "version": version, "base_version": base,
                "global_step": trainer.global_step, "epoch": trainer.current_epoch, "step_time": step_time,
                "published_at": time.time(), "seconds": round(time.perf_counter() - started, 6),
                "num_shards": strategy.client.num_shards, "tables": tables, "files": files,
            }
            with open(temporary / MANIFEST, "w") as f:
                f.write(json.dumps(manifest, indent=1))
                f.flush()
                os.fsync(f.fileno())
            temporary.rename(final)
            fsync_path(self.dirpath)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        self._version, self._save_id = version, save_id
        rows = sum(t["rows"] for t in tables.values())
        rank_zero_info(f"PublishDeltas: version {version} (step {trainer.global_step}, {rows} rows) published to {final}")
        return version

    def _first_base(self) -> int:
        if self.base_version is not None:
            return self.base_version
        return max(published_versions(self.dirpath), default=1)

    def _save_tables(self, strategy: PersiaStrategy, directory: Path, save_id: str) -> dict[str, dict]:
        """The shards' part, and per table its rows, removed ids and whether it is whole."""
        client = strategy.client
        client.save_delta(directory, save_id, self._save_id)
        tables = _table_summary(directory)
        mixed = sorted(name for name, entry in tables.items() if entry["whole"] is None)
        if mixed:
            # Some shards know the base, others (restarted) do not: re-sharding could not tell which rows of such a
            # table are whole, so every shard writes its tables whole this time.
            log.warning("PublishDeltas: tables %s are whole on some shards only (a shard restarted); writing them whole", mixed)
            shutil.rmtree(directory)
            client.save_delta(directory, save_id, "")
            tables = _table_summary(directory)
        return tables


def _table_summary(directory: Path) -> dict[str, dict]:
    """``{table: {"rows", "removed", "whole"}}`` over the shards' manifests; ``whole`` is None where they disagree."""
    summary: dict[str, dict] = {}
    for manifest_path in sorted(directory.glob(f"*/{MANIFEST}")):
        for name, entry in json.loads(manifest_path.read_text())["tables"].items():
            whole = not entry.get("since")
            table = summary.setdefault(name, {"rows": 0, "removed": 0, "whole": whole})
            table["rows"] += entry["rows"]
            table["removed"] += entry.get("removed", {}).get("rows", 0)
            if table["whole"] != whole:
                table["whole"] = None
    return summary


def _files(root: Path) -> dict[str, dict]:
    """Size and checksum of every file under ``root``; a table file's checksum is the one its shard computed while
    writing it (its shard manifest's), checked here against the file's size, not hashed twice."""
    known = {}
    for manifest_path in root.glob(f"{TABLES_DIR}/*/{MANIFEST}"):
        for reference in file_references(json.loads(manifest_path.read_text())):
            known[manifest_path.parent / reference["file"]] = reference
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        size = path.stat().st_size
        reference = known.get(path)
        if reference is not None and reference.get("bytes") != size:
            raise DeltaError(f"{path} has {size} bytes, its shard's manifest says {reference.get('bytes')}")
        if reference is not None:
            algorithm = checksum.algorithm_of(reference)
            digest = {algorithm: reference[algorithm]}
        else:
            digest = checksum.of_file(path)
        files[str(path.relative_to(root))] = {**digest, "bytes": size}
    return files
