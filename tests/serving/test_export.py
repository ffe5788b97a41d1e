"""export_bundle / `lightning-persia export`: layout, checksums, hard links, module sources, and every refusal."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from lightning_persia import checksum, cli
from lightning_persia.serving import Bundle, BundleError, export_bundle
from lightning_persia.serving.bundle import DENSE_FILE, MANIFEST, file_references
from lightning_persia.strategy.ps_checkpoint import TABLES_ELSEWHERE_KEY
from tiny_dlrm import MODEL_CLASS, serving_env


def _copy_checkpoint(trained, into):
    """A copy of the trained checkpoint and its parameter-server folder under ``into`` (to damage or edit)."""
    into.mkdir(parents=True, exist_ok=True)
    ckpt = into / "model.ckpt"
    shutil.copy(trained.ckpt, ckpt)
    shutil.copytree(str(trained.ckpt) + ".ps", str(ckpt) + ".ps")
    return ckpt


def test_bundle_holds_weights_module_tables_and_checksums_of_every_file(trained, bundle):
    manifest = json.loads((bundle.path / MANIFEST).read_text())
    assert manifest["version"] == 1 and bundle.version == 1
    assert manifest["module"]["class_path"] == MODEL_CLASS
    assert manifest["module"]["init_args"]["num_embeddings"] == [50, 50, 8]
    assert bundle.ps_seed == 3 and bundle.num_shards == 2 and bundle.wire_dtype == "fp32"
    assert sorted(bundle.remote_tables) == ["ebc.cat_0", "ebc.cat_1"]  # cat_2 is kept on the trainer
    files = sorted(str(p.relative_to(bundle.path)) for p in bundle.path.rglob("*") if p.is_file() and p != bundle.path / MANIFEST)
    assert sorted(manifest["files"]) == files
    for name, entry in manifest["files"].items():
        assert checksum.algorithm_of(entry) == "xxh3_128" and checksum.matches(entry, bundle.path / name), name
    checkpoint = torch.load(trained.ckpt, weights_only=True)
    dense = load_file(str(bundle.dense_path))
    state = dict(checkpoint["state_dict"])
    assert state.pop(TABLES_ELSEWHERE_KEY).numel() == 0  # what makes load_from_checkpoint say where the tables are
    assert dense.keys() == state.keys()
    assert all(torch.equal(dense[k], v) for k, v in state.items())
    assert bundle.data_transform is None  # trained from plain loaders: no data module described the features
    assert "ebc.data_parallel.weight" in dense  # the kept table travels with the dense weights


def test_a_bundle_and_a_checkpoint_of_the_sha256_versions_still_verify_and_export(trained, bundle, tmp_path):
    old = tmp_path / "old-bundle"
    shutil.copytree(bundle.path, old)
    manifest = json.loads((old / MANIFEST).read_text())
    manifest["format_version"] = 1
    manifest["files"] = {name: {**checksum.of_file(old / name, "sha256"), "bytes": entry["bytes"]} for name, entry in manifest["files"].items()}
    (old / MANIFEST).write_text(json.dumps(manifest))
    Bundle.open(old).verify()

    ckpt = _copy_checkpoint(trained, tmp_path / "sha256")
    for path in ckpt.parent.glob("model.ckpt.ps/*/shard-*/manifest.json"):
        shard = json.loads(path.read_text())
        shard["format_version"] = 2
        for reference in file_references(shard):
            del reference["xxh3_128"]
            reference.update(checksum.of_file(path.parent / reference["file"], "sha256"))
        path.write_text(json.dumps(shard))
    exported = export_bundle(ckpt, tmp_path / "from-sha256", model_class=MODEL_CLASS)
    exported.verify()
    assert {checksum.algorithm_of(entry) for entry in exported.manifest["files"].values()} == {"xxh3_128"}
    victim = next(ckpt.parent.glob("model.ckpt.ps/*/shard-00000-of-00002/*.state.npy"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    message = _export_error(ckpt, tmp_path / "damaged-sha256", model_class=MODEL_CLASS)
    assert str(victim) in message and "corrupted" in message


def test_tables_are_hard_links_of_the_checkpoint_files(trained, bundle):
    save = next((trained.ckpt.parent / (trained.ckpt.name + ".ps")).iterdir())
    for name in bundle.manifest["files"]:
        if name.startswith("tables/"):
            original = save / name.split("/", 1)[1]
            assert os.stat(original).st_ino == os.stat(bundle.path / name).st_ino, name


def test_module_from_the_cli_config_or_from_the_class_path_the_hyperparameters_carry(trained, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"trainer: {{max_steps: 5}}\nmodel:\n  class_path: {MODEL_CLASS}\n  init_args: {{embedding_dim: 4, num_dense_features: 3}}\n")
    from_config = export_bundle(trained.ckpt, tmp_path / "from-config", config=config)
    assert from_config.manifest["module"] == {"class_path": MODEL_CLASS, "init_args": {"embedding_dim": 4, "num_dense_features": 3}}

    ckpt = _copy_checkpoint(trained, tmp_path / "cli-made")
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["hyper_parameters"].update(_class_path=MODEL_CLASS, _instantiator="lightning.pytorch.cli.instantiate_module")
    torch.save(checkpoint, ckpt)
    from_hparams = export_bundle(ckpt, tmp_path / "from-hparams", version=7)
    assert from_hparams.version == 7
    assert from_hparams.module_class_path == MODEL_CLASS
    assert "_instantiator" not in from_hparams.module_init_args and from_hparams.module_init_args["embedding_dim"] == 4


def test_a_copied_bundle_is_complete(bundle, tmp_path):
    copy = tmp_path / "elsewhere"
    shutil.copytree(bundle.path, copy)
    Bundle.open(copy).verify()


def _export_error(*args, **kwargs) -> str:
    with pytest.raises(BundleError) as caught:
        export_bundle(*args, **kwargs)
    return str(caught.value)


def test_refusals_name_the_problem_and_leave_nothing_behind(trained, tmp_path):
    out = tmp_path / "bundle"
    assert "does not exist" in _export_error(tmp_path / "nope.ckpt", out, model_class=MODEL_CLASS)

    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {}}, plain)
    assert "holds no parameter-server state" in _export_error(plain, out, model_class=MODEL_CLASS)

    truncated = _copy_checkpoint(trained, tmp_path / "truncated")
    truncated.write_bytes(truncated.read_bytes()[:1000])
    assert "cannot read checkpoint" in _export_error(truncated, out, model_class=MODEL_CLASS)

    corrupted = _copy_checkpoint(trained, tmp_path / "corrupted")
    victim = next(corrupted.parent.glob("model.ckpt.ps/*/shard-00001-of-00002/*.weights.npy"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    message = _export_error(corrupted, out, model_class=MODEL_CLASS)
    assert str(victim) in message and "corrupted" in message

    incomplete = _copy_checkpoint(trained, tmp_path / "incomplete")
    shutil.rmtree(next(incomplete.parent.glob("model.ckpt.ps/*/shard-00000-of-00002")))
    assert "shard folders [0] of 2 are missing" in _export_error(incomplete, out, model_class=MODEL_CLASS)

    no_ps = _copy_checkpoint(trained, tmp_path / "no-ps")
    shutil.rmtree(str(no_ps) + ".ps")
    assert "parameter-server state of" in _export_error(no_ps, out, model_class=MODEL_CLASS)

    assert "--model-class" in _export_error(trained.ckpt, out)  # built in Python: no class path in the hparams
    config = tmp_path / "trainer-only.yaml"
    config.write_text("trainer: {max_steps: 5}\n")
    assert "has no model section" in _export_error(trained.ckpt, out, config=config)

    assert not out.exists() and not list(tmp_path.glob(".bundle.tmp-*"))
    out.mkdir()
    assert "exists already" in _export_error(trained.ckpt, out, model_class=MODEL_CLASS)


def test_cli_export_prints_the_bundle_and_reports_errors_with_status_2(trained, tmp_path, capsys):
    assert cli.main(["export", "--ckpt", str(trained.ckpt), "--out", str(tmp_path / "b"), "--model-class", MODEL_CLASS, "--version", "3"]) == 0
    assert f"version 3 (2-shard tables) to {tmp_path / 'b'}" in capsys.readouterr().out
    assert cli.main(["export", "--ckpt", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "c")]) == 2
    assert "lightning-persia export: error: checkpoint" in capsys.readouterr().err


def test_cli_export_shows_a_progress_bar_of_the_bytes_checksummed(trained, tmp_path, capsys):
    assert cli.main(["export", "--ckpt", str(trained.ckpt), "--out", str(tmp_path / "b"), "--model-class", MODEL_CLASS, "--progress"]) == 0
    total = sum(entry["bytes"] for entry in Bundle.open(tmp_path / "b").manifest["files"].values())
    bar = capsys.readouterr().err.rsplit("\r", 1)[-1]
    assert bar.startswith("export: checksums: 100%") and f"{total / 1000:.1f}k/{total / 1000:.1f}k" in bar
    assert cli.main(["export", "--ckpt", str(trained.ckpt), "--out", str(tmp_path / "c"), "--model-class", MODEL_CLASS]) == 0
    assert "export: checksums" not in capsys.readouterr().err  # stderr is no terminal here


def test_damaged_bundle_is_refused_by_the_predictor_and_by_inference_shards(bundle, tmp_path):
    from lightning_persia.serving import Predictor

    damaged = tmp_path / "damaged"
    shutil.copytree(bundle.path, damaged)
    dense = damaged / DENSE_FILE
    data = bytearray(dense.read_bytes())
    data[len(data) // 2] ^= 0xFF
    dense.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="dense.safetensors is corrupted"):
        Predictor.from_bundle(damaged)

    victim = next(damaged.glob("tables/shard-00000-of-00002/*.weights.npy"))
    victim.write_bytes(victim.read_bytes()[:-8])
    shard = subprocess.run(
        [sys.executable, "-m", "lightning_persia.cli", "ps", "serve", "--port", "0", "--shard-index", "0", "--num-shards", "1",
         "--read-only", "--restore-from", str(damaged)],
        capture_output=True, text=True, timeout=120, env=serving_env(),
    )
    assert shard.returncode == 2
    assert "cannot restore" in shard.stderr and victim.name in shard.stderr and "truncated" in shard.stderr
