"""``export_bundle``: a PersiaStrategy checkpoint (``.ckpt`` + its ``.ckpt.ps/`` tables) -> a serving bundle."""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from safetensors.torch import save_file
from tqdm import tqdm

from lightning_persia import checksum
from lightning_persia.data.transform import DataTransform, recorded_transform
from lightning_persia.serving.bundle import (DENSE_FILE, FORMAT, FORMAT_VERSION, MANIFEST, TABLES_DIR, Bundle, BundleError,
                                             file_references)
from lightning_persia.strategy.table_saves import CHECKPOINT_KEY
from lightning_persia.strategy.ps_checkpoint import TABLES_ELSEWHERE_KEY

_SHARD_FOLDER = re.compile(r"^shard-(\d+)-of-(\d+)$")


def export_bundle(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config: Optional[str | os.PathLike] = None,
    model_class: Optional[str] = None,
    version: int = 1,
    ps_seed: Optional[int] = None,
    data_transform: Optional[DataTransform] = None,
    progress: bool = False,
) -> Bundle:
    """Writes the serving bundle of checkpoint ``ckpt`` into the new folder ``out`` and returns it.

    The module is rebuilt from the ``model`` section of the LightningCLI ``config`` when given, else from the
    hyper-parameters saved in the checkpoint (``save_hyperparameters()``) and their class path (recorded by
    LightningCLI, or ``model_class``, e.g. ``"examples.dlrm.model.DLRM"``). The tables are hard-linked from
    the checkpoint's parameter-server folder when on the same file system, else copied; every file is
    checksummed, and the tables' files are checked against their shards' manifests on the way.

    Args:
        version: the model version the bundle's answers carry.
        ps_seed: seed of the shards that trained the tables (their unseen ids' rows); default the strategy's
            ``ps.seed`` recorded in the checkpoint. Give it when the tables lived on shards started by hand
            with another ``seed``.
        data_transform: how the training data module made its batches from its files' values (what the endpoint
            applies to raw requests, and which features index kept tables with raw ids); default: the one the
            checkpoint records (its data module's ``state_dict``), if any.
        progress: show a progress bar (tqdm, on stderr) of the bytes copied and checksummed.

    Raises:
        BundleError: the checkpoint is missing, damaged or has no parameter-server state, the module cannot be
            described, or ``out`` exists already. Nothing is left at ``out`` then.
    """
    ckpt, out = Path(ckpt).absolute(), Path(out).absolute()
    if out.exists():
        raise BundleError(f"{out} exists already; export into a new folder")
    checkpoint = _load_checkpoint(ckpt)
    entry = checkpoint.get(CHECKPOINT_KEY)
    if not isinstance(entry, dict) or "ps_dir" not in entry:
        raise BundleError(
            f"{ckpt} holds no parameter-server state: it was not written by PersiaStrategy with remote tables "
            "(a checkpoint of a model whose tables are all local needs no bundle: load it with Lightning)"
        )
    if "interception" not in entry:
        raise BundleError(f"{ckpt} does not record how its embedding modules were swapped; save it again with this lightning-persia")
    ps_dir = ckpt.parent / entry["ps_dir"]
    num_shards = _check_ps_folder(ps_dir, ckpt)
    module = _module_spec(checkpoint, ckpt, config, model_class)
    interception = entry["interception"]
    transform = data_transform if data_transform is not None else recorded_transform(checkpoint)

    temporary = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        temporary.mkdir(parents=True)
        state = {name: tensor for name, tensor in (checkpoint.get("state_dict") or {}).items() if name != TABLES_ELSEWHERE_KEY}
        # safetensors refuses tensors that share memory; a copy of each costs the dense weights once more
        save_file({name: tensor.detach().clone().contiguous() for name, tensor in state.items()}, str(temporary / DENSE_FILE))
        _link_tree(ps_dir, temporary / TABLES_DIR, progress)
        files = _checksums(temporary, progress)
        _check_table_files(temporary / TABLES_DIR, files, ps_dir)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version": int(version),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source": {"checkpoint": str(ckpt), "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")},
            "module": module,
            "interception": interception,
            "ps_seed": int(interception["seed"] if ps_seed is None else ps_seed),
            "num_shards": num_shards,
            "remote_tables": list(entry["tables"]),
            "data_transform": None if transform is None else transform.as_dict(),
            "files": files,
        }
        with open(temporary / MANIFEST, "w") as f:
            f.write(json.dumps(manifest, indent=1))
            f.flush()
            os.fsync(f.fileno())
        temporary.rename(out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return Bundle.open(out)


def _load_checkpoint(ckpt: Path) -> dict[str, Any]:
    if not ckpt.is_file():
        raise BundleError(f"checkpoint {ckpt} does not exist")
    try:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several kinds for a truncated or foreign file
        raise BundleError(f"cannot read checkpoint {ckpt} (damaged or not a Lightning checkpoint): {type(err).__name__}: {err}") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise BundleError(f"{ckpt} is not a Lightning checkpoint (no state_dict)")
    return checkpoint


def _check_ps_folder(ps_dir: Path, ckpt: Path) -> int:
    """The shard count of the parameter-server checkpoint at ``ps_dir``; :class:`BundleError` if it is incomplete."""
    if not ps_dir.is_dir():
        raise BundleError(f"the parameter-server state of {ckpt} is missing: no folder {ps_dir}")
    found: dict[int, set[int]] = {}
    for child in ps_dir.iterdir():
        match = _SHARD_FOLDER.match(child.name)
        if match and child.is_dir():
            found.setdefault(int(match.group(2)), set()).add(int(match.group(1)))
    if len(found) != 1:
        raise BundleError(f"{ps_dir} holds no complete parameter-server checkpoint (shard folders for counts {sorted(found)})")
    (total, indices), = found.items()
    missing = sorted(set(range(total)) - indices)
    if missing:
        raise BundleError(f"the parameter-server checkpoint {ps_dir} is incomplete: shard folders {missing} of {total} are missing")
    return total


def _module_spec(checkpoint: dict, ckpt: Path, config: Optional[str | os.PathLike], model_class: Optional[str]) -> dict[str, Any]:
    """``{"class_path", "init_args"}`` of the LightningModule, from the CLI config or the saved hyper-parameters."""
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    class_path = model_class or hparams.get("_class_path")
    init_args = {k: v for k, v in hparams.items() if not k.startswith("_")}
    if config is not None:
        section = _config_model_section(Path(config))
        if isinstance(section, str):
            class_path, init_args = section, {}
        elif "class_path" in section:
            class_path, init_args = section["class_path"], dict(section.get("init_args") or {})
        else:  # LightningCLI(ModelClass): the section holds the arguments themselves
            init_args = dict(section)
    if not class_path:
        raise BundleError(
            f"cannot tell which LightningModule {ckpt} belongs to: its hyper-parameters carry no class path (the "
            "model was not built by LightningCLI). Pass the training config (--config) or the class (--model-class "
            "package.module.Class)"
        )
    try:
        init_args = json.loads(json.dumps(init_args))
    except (TypeError, ValueError) as err:
        raise BundleError(f"the module's arguments cannot be written as JSON ({err}); pass the training config (--config)") from None
    return {"class_path": class_path, "init_args": init_args}


def _config_model_section(path: Path) -> Any:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise BundleError(f"cannot read the config {path}: {err}") from None
    section = data.get("model") if isinstance(data, dict) else None
    if not isinstance(section, (dict, str)):
        raise BundleError(f"the config {path} has no model section (model: {{class_path: ..., init_args: ...}})")
    return section


def _link_tree(source: Path, target: Path, progress: bool = False) -> None:
    """``target`` as a copy of ``source`` made of hard links where the file system allows, else of copies (a progress
    bar of the bytes copied, if any)."""
    with tqdm(desc="export: copying tables", unit="B", unit_scale=True, disable=not progress, delay=1.0) as bar:
        for folder, dirs, names in os.walk(source):
            dirs[:] = [d for d in dirs if not d.startswith(".")]  # a save's temporary folders
            relative = Path(folder).relative_to(source)
            (target / relative).mkdir(parents=True, exist_ok=True)
            for name in names:
                try:
                    os.link(Path(folder) / name, target / relative / name)
                except OSError:  # another file system, or links not allowed there
                    shutil.copy2(Path(folder) / name, target / relative / name)
                    bar.update((target / relative / name).stat().st_size)


def _checksums(root: Path, progress: bool) -> dict[str, dict]:
    """``{name: {checksum, bytes}}`` of every file under ``root``, with a progress bar of the bytes read."""
    sizes = {name: (root / name).stat().st_size for name in _files_under(root)}
    with tqdm(total=sum(sizes.values()), desc="export: checksums", unit="B", unit_scale=True, disable=not progress) as bar:
        return {name: {**checksum.of_file(root / name, on_bytes=bar.update), "bytes": size} for name, size in sizes.items()}


def _files_under(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


def _check_table_files(tables: Path, files: dict[str, dict], ps_dir: Path) -> None:
    """Every file a shard manifest checksums must have that checksum (a damaged checkpoint is not exported)."""
    for manifest_path in sorted(tables.glob(f"*/{MANIFEST}")):
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as err:
            raise BundleError(f"cannot read {ps_dir / manifest_path.relative_to(tables)}: {err}") from None
        for reference in file_references(manifest):
            name = f"{TABLES_DIR}/{manifest_path.parent.name}/{reference['file']}"
            original = ps_dir / manifest_path.parent.name / reference["file"]
            if name not in files:
                raise BundleError(f"checkpoint file {original} is missing")
            algorithm = checksum.algorithm_of(reference)
            if algorithm in files[name]:
                whole = files[name][algorithm] == reference[algorithm]
            else:  # a checkpoint of an older version: its own algorithm, once more
                whole = checksum.matches(reference, tables / manifest_path.parent.name / reference["file"])
            if not whole:
                raise BundleError(f"checkpoint file {original} is truncated or corrupted (its checksum differs from its shard's manifest)")
