"""benchmarks/data_bench.py: each reader's rate is measured over every row, and bad arguments are refused by name."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import data_bench  # noqa: E402


def test_every_rate_is_measured_on_the_rows_asked_for(monkeypatch):
    timed = []
    real = data_bench._best_rate
    monkeypatch.setattr(data_bench, "_best_rate", lambda rows, run, repeats=3: timed.append(run()) or real(rows, run, 1))
    out = data_bench.main(["--rows", "300", "--batch-size", "64", "--json"])
    assert all(out[k] > 0 for k in out if k.endswith("_rows_per_s"))
    assert timed[2:] == [300, 300, 300]  # the TSV reader and both binary layouts yield every row


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        data_bench.main(["--rows", "0"])
    assert "--rows and --batch-size must be >= 1, got 0 and 4096" in capsys.readouterr().err
