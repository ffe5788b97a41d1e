"""benchmarks/data/readers_bench.py: each reader's rate is measured over every row, and bad arguments are refused by name."""
from __future__ import annotations

import pytest

from benchmarks.data import readers_bench


def test_every_rate_is_measured_on_the_rows_asked_for(monkeypatch):
    timed = []
    real = readers_bench._best_rate
    monkeypatch.setattr(readers_bench, "_best_rate", lambda rows, run, repeats=3: timed.append(run()) or real(rows, run, 1))
    out = readers_bench.main(["--rows", "300", "--batch-size", "64", "--json"])
    assert all(out[k] > 0 for k in out if k.endswith("_rows_per_s"))
    assert timed[2:] == [300, 300, 300]  # the TSV reader and both binary layouts yield every row


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        readers_bench.main(["--rows", "0"])
    assert "--rows and --batch-size must be >= 1, got 0 and 4096" in capsys.readouterr().err
