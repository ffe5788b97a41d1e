"""Smoke test of benchmarks/trainer/pipeline_bench.py: a tiny run end to end reports every figure."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MODULE = "benchmarks.trainer.pipeline_bench"

REQUIRED = ("local_samples_per_s", "sync_samples_per_s", "hybrid_samples_per_s", "local_cpu_ms", "sync_cpu_ms", "hybrid_cpu_ms")


@pytest.mark.scenario  # minutes of processes: CI's scenario step (`make scenarios`), not `make test`
def test_tiny_run_reports_every_figure(tmp_path):
    """Batch 256, 8 steps of local, sync and hybrid (τ=2) on tiny tables, the batches made (and PersiaStrategy's
    lookups planned) in a DataLoader worker, with the profile: the JSON has every figure, the profile its spans."""
    command = [
        sys.executable, "-m", MODULE, "--json", "--profile", "--steps", "8", "--warmup", "2", "--window", "2", "--batch-sizes", "256",
        "--ranks", "1", "--staleness", "2", "--repeat", "1", "--cardinality-scale", "0.001", "--loader-workers", "1",
        "--cache-dir", str(tmp_path / "cache"), "--timeout", "120",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    for key in REQUIRED:
        assert isinstance(summary[key], float) and summary[key] > 0, (key, summary[key])
    assert summary["headline_batch_size"] == 256 and summary["loader_workers"] == 1
    runs = {r["name"]: r for r in summary["runs"]}
    assert set(runs) == {"local b256", "sync b256", "hybrid-2 b256"}
    assert runs["sync b256"]["shards_cpu_ms"] > 0 and runs["local b256"]["shards_cpu_ms"] == 0
    profile = runs["hybrid-2 b256"]["profile"]
    assert profile["pooled"] > 0 and profile["push"] > 0 and profile["cpu_total"] > 0
    assert "trainer CPU" in done.stdout and "where a step's time goes" in done.stdout


@pytest.mark.parametrize("argv,message", [
    (["--repeat", "0"], "--repeat and --staleness must be >= 1"),
    (["--steps", "10", "--warmup", "5", "--window", "10"], "must cover --warmup"),
    (["--batch-sizes", "4095", "--ranks", "2"], "must be divisible by every --ranks value"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    from benchmarks.trainer import pipeline_bench

    with pytest.raises(SystemExit):
        pipeline_bench.parse_args(argv)
    assert message in capsys.readouterr().err
