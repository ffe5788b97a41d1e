"""The README's example runs as written: two DDP ranks, the embedded shards, bounded epochs, a logged loss that falls."""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _example() -> str:
    """The first Python block under the README's "## Example" heading."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Example\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_trains_as_written(tmp_path):
    (tmp_path / "example.py").write_text(_example())
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "`Trainer.fit` stopped: `max_epochs=3` reached." in output
    assert "PersiaStrategy: 2 tables on the shards (ebc.t_user, ebc.t_item)" in output
    # Lightning's default logger here (no TensorBoard among the dependencies in pyproject.toml) writes CSV beside the script
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as f:
        losses = [float(row["train_loss_epoch"]) for row in csv.DictReader(f) if row.get("train_loss_epoch")]
    assert len(losses) == 3 and losses[2] < losses[0] - 0.02, losses
