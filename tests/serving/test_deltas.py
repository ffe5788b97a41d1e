"""Versioned deltas: the bundle plus the deltas up to v is the trainer's model at v, on any shard count; refusals."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from lightning_persia import PublishDeltas, cli
from lightning_persia.remote_ps.client import PSClient, PSRequestError, RetryPolicy
from lightning_persia.serving import BundleError, DeltaError, Predictor
from lightning_persia.serving.delta import Delta, DeltaWatcher, delta_path, next_delta
from tiny_dlrm import ROOT, serving_env


def _check(predictor: Predictor, batches: list, scores: list, version: int) -> None:
    for batch, reference in zip(batches, scores):
        prediction = predictor.predict(batch)
        assert prediction.version == version
        torch.testing.assert_close(prediction.output, reference, atol=1e-6, rtol=0)


def _copy(online, versions, target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for version in versions:
        shutil.copytree(delta_path(online.deltas, version), delta_path(target, version))
    return target


@pytest.mark.parametrize("num_shards", [1, 3])
def test_the_bundle_plus_the_deltas_up_to_v_is_the_trainers_model_at_v_on_any_shard_count(trained, bundle, online, start_ps_cluster, num_shards):
    """A 2-shard run's bundle and deltas, on 1 or 3 inference shards: a rollback to version 2, then on to version 4."""
    batches = trained.expected["batches"]
    shards = start_ps_cluster(num_shards, extra_args=["--read-only", "--restore-from", str(bundle.path)])
    with Predictor.from_bundle(bundle.path, shards.addresses, deltas=online.deltas, version=2) as predictor:
        _check(predictor, batches, online.scores[2], 2)
        assert not torch.equal(online.scores[2][1], online.scores[1][1])  # the version changed the scores
    with pytest.raises(BundleError, match="serve version 2, later than version 1: restart them from the bundle"):
        Predictor.from_bundle(bundle.path, shards.addresses, deltas=online.deltas, version=1)
    # a new endpoint on the same shards takes their version's dense weights, then goes on
    with Predictor.from_bundle(bundle.path, shards.addresses, deltas=online.deltas, watch_interval_s=None) as predictor:
        _check(predictor, batches, online.scores[4], 4)
        with PSClient(shards.addresses) as client:
            assert {shard["server"]["model_version"] for shard in client.stats()} == {4}


def test_a_delta_is_refused_when_out_of_order_or_damaged_naming_the_file(online, tmp_path):
    root = _copy(online, [2, 3, 4], tmp_path / "deltas")
    assert next_delta(root, 1).version == 2 and next_delta(root, 4) is None and next_delta(root, 2, up_to=2) is None

    shutil.rmtree(delta_path(root, 3))
    with pytest.raises(DeltaError, match=rf"version gap: {delta_path(root, 3)} is missing, but {delta_path(root, 4)} is there"):
        next_delta(root, 2)
    manifest_path = delta_path(root, 4) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "base_version": 2}))
    with pytest.raises(DeltaError, match=rf"{manifest_path} makes version 4 from version 2, not from version 3: out of order"):
        next_delta(root, 3)
    manifest_path.write_text(json.dumps(manifest))

    dense = delta_path(root, 4) / "dense.safetensors"
    data = bytearray(dense.read_bytes())
    data[-1] ^= 0xFF
    dense.write_bytes(bytes(data))
    with pytest.raises(DeltaError, match=rf"delta file {dense} is corrupted"):
        next_delta(root, 3)
    table_file = next(delta_path(root, 2).glob("tables/shard-00000-of-00002/*.weights.npy"))
    table_file.write_bytes(table_file.read_bytes()[:-4])
    with pytest.raises(DeltaError, match=rf"delta file {table_file} is truncated"):
        next_delta(root, 1)


def test_the_watcher_logs_a_refusal_once_keeps_its_version_and_applies_the_delta_once_fixed(online, tmp_path, caplog):
    root = _copy(online, [2], tmp_path / "deltas")
    (root / "v00000004").mkdir()  # a gap: version 3 is not there
    served = []
    watcher = DeltaWatcher(root, lambda: served[-1] if served else 1, lambda delta: served.append(delta.version), name="test")
    assert watcher.catch_up() == 2 and watcher.catch_up() == 2
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and f"delta {delta_path(root, 3)} refused, still serving version 2: version gap" in refusals[0]
    with pytest.raises(DeltaError, match="version gap"):
        watcher.catch_up(strict=True)
    shutil.rmtree(root / "v00000004")
    _copy(online, [3, 4], root)
    assert watcher.catch_up() == 4 and served == [2, 3, 4]
    with pytest.raises(DeltaError, match=rf"version 9 is not published under {root} \(the newest there is 4\)"):
        DeltaWatcher(root, lambda: served[-1], served.append, up_to=9).catch_up(strict=True)
    with pytest.raises(DeltaError, match=rf"{delta_path(root, 2)} was applied, but the version served is 1, not 2"):
        DeltaWatcher(root, lambda: 1, lambda delta: None).catch_up(strict=True)


def test_inference_shards_stage_and_commit_versions_in_order_and_training_shards_refuse_to(bundle, online, start_ps_cluster, ps_cluster):
    shards = start_ps_cluster(1, extra_args=["--read-only", "--restore-from", str(bundle.path)])
    delta = Delta.open(delta_path(online.deltas, 3))
    with PSClient(shards.addresses, retry=RetryPolicy(max_retries=0)) as client:
        with pytest.raises(PSRequestError, match="makes version 3 from version 2, but this shard serves version 1") as caught:
            client.stage_delta(delta.tables_path, 3, 2)
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(PSRequestError, match="cannot commit version 2: nothing is staged"):
            client.commit_delta(2)
        assert client.stage_delta(delta_path(online.deltas, 2) / "tables", 2, 1) > 0
        assert client.stats()[0]["server"]["staged_version"] == 2
        client.commit_delta(2)
        client.commit_delta(2)  # a retried commit changes nothing
        assert client.stats()[0]["server"]["model_version"] == 2
        with pytest.raises(PSRequestError, match="refused: this shard serves in read-only mode"):
            client.save_delta(online.deltas.parent / "nope", "x")
    with PSClient(ps_cluster.addresses, retry=RetryPolicy(max_retries=0)) as client:
        with pytest.raises(PSRequestError, match="only read-only \\(inference\\) shards apply deltas"):
            client.stage_delta(delta.tables_path, 3, 2)
        with pytest.raises(PSRequestError, match="a delta needs a save_id"):
            client.save_delta(online.deltas.parent / "nope", "")


def _model_version(client: PSClient) -> int:
    return client.stats()[0]["server"]["model_version"]


def test_a_shard_watching_deltas_applies_them_on_its_own_refusing_a_damaged_one(bundle, online, start_ps_cluster, tmp_path):
    root = _copy(online, [2], tmp_path / "deltas")
    shards = start_ps_cluster(1, extra_args=["--read-only", "--restore-from", str(bundle.path), "--watch-deltas", str(root),
                                             "--watch-interval", "0.1"])
    driven = start_ps_cluster(1, extra_args=["--read-only", "--restore-from", str(bundle.path)])
    ids = {name: torch.arange(60) for name in bundle.remote_tables}  # 50 trained ids and 10 unseen
    with PSClient(shards.addresses) as watching, PSClient(driven.addresses) as reference:
        assert _model_version(watching) == 2  # applied before the shard served its first lookup
        damaged = _copy(online, [3], tmp_path / "staging")
        table_file = next(delta_path(damaged, 3).glob("tables/shard-00001-of-00002/*.weights.npy"))
        data = bytearray(table_file.read_bytes())
        data[-1] ^= 0xFF
        table_file.write_bytes(bytes(data))
        delta_path(damaged, 3).rename(delta_path(root, 3))
        deadline = time.monotonic() + 30
        while "refused" not in shards.output(0) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _model_version(watching) == 2
        assert f"delta {delta_path(root, 3)} refused, still serving version 2" in shards.output(0)
        assert f"checkpoint file {delta_path(root, 3) / 'tables' / 'shard-00001-of-00002' / table_file.name} is truncated or corrupted" in shards.output(0)
        shutil.rmtree(delta_path(root, 3))
        _copy(online, [3, 4], root)
        deadline = time.monotonic() + 30
        while _model_version(watching) != 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        for version in (2, 3, 4):
            reference.stage_delta(delta_path(root, version) / "tables", version, version - 1)
            reference.commit_delta(version)
        assert _model_version(watching) == _model_version(reference) == 4
        for wire in ("fp32", "fp16"):
            got, expected = watching.lookup(ids, train=False, wire_dtype=wire), reference.lookup(ids, train=False, wire_dtype=wire)
            assert all(torch.equal(got[name], expected[name]) for name in ids)
        with pytest.raises(PSRequestError, match="applies the deltas of .* on its own"):
            watching.stage_delta(delta_path(root, 4) / "tables", 5, 4)
    with pytest.raises(BundleError, match="apply deltas on their own \\(--watch-deltas\\)"):
        Predictor.from_bundle(bundle.path, shards.addresses, deltas=root)


def test_a_shard_pinned_to_a_version_it_cannot_reach_does_not_start(bundle, online):
    command = [sys.executable, "-m", "lightning_persia.cli", "ps", "serve", "--port", "0", "--shard-index", "0", "--num-shards", "1",
               "--read-only", "--restore-from", str(bundle.path), "--watch-deltas", str(online.deltas), "--version", "7"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=serving_env(), cwd=ROOT)
    assert result.returncode == 2
    assert f"cannot restore: version 7 is not published under {online.deltas} (the newest there is 4)" in result.stderr


@pytest.mark.parametrize("argv,message", [
    (["ps", "serve", "--port", "0", "--shard-index", "0", "--num-shards", "1", "--watch-deltas", "d"], "--watch-deltas needs --read-only"),
    (["ps", "serve", "--port", "0", "--shard-index", "0", "--num-shards", "1", "--version", "3"], "--version needs --watch-deltas"),
    (["serve", "bundle", "--version", "3"], "--version needs --deltas"),
    (["serve", "bundle", "--deltas", "d", "--watch-interval", "0"], "--watch-interval must be > 0"),
])
def test_delta_options_that_do_not_fit_together_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_publish_deltas_refuses_bad_settings_and_another_strategy(tmp_path):
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    with pytest.raises(ValueError, match="every_n_train_steps must be >= 1"):
        PublishDeltas(tmp_path, every_n_train_steps=0)
    with pytest.raises(ValueError, match="base_version must be >= 0"):
        PublishDeltas(tmp_path, base_version=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=[PublishDeltas(tmp_path)])
    with pytest.raises(TypeError, match="PublishDeltas publishes the tables of PersiaStrategy's shards; this trainer runs SingleDeviceStrategy"):
        trainer.fit(BoringModel())


_EXIT_WHILE_APPLYING = """
import sys, threading, time
from types import SimpleNamespace
from lightning_persia.serving import delta
served, applying = [1], threading.Event()
delta.next_delta = lambda root, version, up_to=None: SimpleNamespace(version=version + 1, path=root, global_step=0) if version < 2 else None
def apply(found):
    applying.set()
    time.sleep(0.5)
    served.append(found.version)
    print("applied", found.version, flush=True)
watcher = delta.DeltaWatcher(sys.argv[1], lambda: served[-1], apply, interval_s=0.01)
watcher.start()
applying.wait(10)
"""


def test_a_started_watcher_finishes_the_delta_it_applies_before_the_interpreter_exits(tmp_path):
    # A daemon thread still applying a delta (torch ops) when the interpreter finalizes would be ended mid-apply,
    # which can abort the process (docs/reliability.md: the exit-time abort): the watcher is stopped at exit instead.
    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_APPLYING, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["applied", "2"]
