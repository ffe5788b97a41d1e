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
