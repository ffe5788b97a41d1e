"""benchmarks/cluster/elastic_bench.py --idle: moves with nothing training report each process's CPU per move."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.scenario
def test_idle_moves_report_every_shards_cpu_and_the_coordinators():
    result = subprocess.run([sys.executable, "-m", "benchmarks.cluster.elastic_bench", "--idle", "--copy-share", "1",
                             "--rows", "20000", "--batch", "512", "--steady-steps", "2", "--json"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["idle"] is True
    for name in ("grow", "shrink"):
        move = summary[name]
        assert 0.2 * 20000 / 3 < move["rows_moved"] < 1.2 * 20000 / 3  # about a third of the rows change owner
        assert len(move["shard_cpu_s"]) == 3 and all(cpu >= 0 for cpu in move["shard_cpu_s"])
        assert move["coordinator_cpu_s"] > 0  # the `ps scale` process ran and was counted


def test_a_moves_throughput_is_rated_against_the_steady_windows_on_either_side():
    from benchmarks.cluster.elastic_bench import _rated
    during = [0.04] * 9 + [0.5]  # one step waited on a fenced wave
    move = {"step_s_during": sum(during) / len(during), "max_step_s": max(during), "during": during}
    rated = _rated(move, before_s=0.04, after_s=0.05, median_s=0.045)
    steady_s = 2 / (1 / 0.04 + 1 / 0.05)  # 22.5 steps/s: the mean of 25 and 20
    assert rated["throughput_ratio_during"] == pytest.approx(steady_s / 0.086)
    assert rated["throughput_ratio_vs_before"] == pytest.approx(0.04 / 0.086)
    assert rated["throughput_ratio_vs_after"] == pytest.approx(0.05 / 0.086)
    assert rated["max_extra_step_s"] == pytest.approx(0.5 - 0.045)
    assert rated["lost_s"] == pytest.approx(10 * (0.086 - steady_s))
    assert rated["stalled_s"] == pytest.approx(0.5 - steady_s)  # the steps over 3x steady alone
    assert "during" not in rated


@pytest.mark.scenario
def test_moves_while_training_report_the_steady_windows_and_lose_no_update():
    result = subprocess.run([sys.executable, "-m", "benchmarks.cluster.elastic_bench", "--rows", "20000", "--batch", "512",
                             "--steady-steps", "5", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["lost_updates"] == 0 and len(summary["steady_step_s"]) == 3  # before, between and after the moves
    for name in ("grow", "shrink"):
        move = summary[name]
        assert move["steps_during"] >= 1 and move["throughput_ratio_during"] > 0
        assert move["max_step_s"] >= move["step_s_during"] > 0
    assert summary["throughput_ratio_during"] == min(summary["grow"]["throughput_ratio_during"],
                                                     summary["shrink"]["throughput_ratio_during"])
