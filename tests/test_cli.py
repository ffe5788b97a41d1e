"""The ``lightning-persia`` training commands: a refused argument ends the output with its reason, and
LightningCLI does not warn about the command line it is given."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_persia.cli import ConfigurationError, lightning_cli

ROOT = Path(__file__).resolve().parents[1]
DLRM = str(ROOT / "examples" / "dlrm" / "config.yaml")


def test_a_refused_strategy_argument_ends_with_its_one_line_reason():
    done = subprocess.run(
        [sys.executable, "-m", "lightning_persia.cli", "fit", "--config", "examples/dlrm/config.yaml",
         "--trainer.strategy.init_args.staleness=-1"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2
    assert output.strip().splitlines()[-1] == "lightning-persia fit: error: lightning_persia.PersiaStrategy: staleness must be >= 0, got -1"
    assert "Namespace(" not in output and "Traceback" not in output
    assert "LightningCLI's args parameter" not in output  # the console entry hands LightningCLI its own command line


@pytest.mark.parametrize(
    "argument, reason",
    [
        ("--model.init_args.optimizer=foo", "examples.dlrm.model.DLRM: optimizer must be one of ('adam', 'adagrad', 'sgd'), got 'foo'"),
        # a Union inside a Union (the embedding optimizer is one of SGD, Adagrad, Adam): every member's reason
        ("--trainer.strategy.init_args.embedding_optimizer.init_args.lr=-1",
         "lightning_persia.PersiaStrategy: SGD.lr must be finite and >= 0, got -1.0; Adagrad.lr must be finite and >= 0, "
         "got -1.0; Adam.lr must be finite and >= 0, got -1.0"),
    ],
)
def test_configuration_errors_carry_the_class_s_reason(argument, reason, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigurationError) as info:
        lightning_cli(["fit", "--config", DLRM, argument])
    assert str(info.value) == reason


def test_an_old_flat_strategy_argument_ends_with_its_new_place(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as done:
        lightning_cli(["fit", "--config", DLRM, "--trainer.strategy.init_args.ps_timeout_s=3"])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: lightning_persia.PersiaStrategy: PersiaStrategy(ps_timeout_s=...) moved: "
        "PersiaStrategy(ps=PSSettings(timeout_s=...)); in YAML init_args.ps.timeout_s"
    )


@pytest.mark.parametrize(
    "module, own",
    [
        ("lightning_persia.data.CriteoDataModule", ["--data.ids", "--data.skip_malformed"]),
        ("lightning_persia.data.CriteoBinaryDataModule", ["--data.ids", "--data.val_test_split"]),
        ("lightning_persia.data.ParquetDataModule", ["--data.ids", "--data.label_column", "--data.sparse_columns"]),
    ],
)
def test_the_file_data_modules_list_the_shared_arguments_once_with_one_default(module, own, monkeypatch, capsys):
    """Each declares only its own arguments and passes the shared ones (FileSplitDataModule's) on: LightningCLI's help
    lists both, and num_workers has the one default (None: auto) everywhere."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as done:
        lightning_cli(["fit", "--config", DLRM, "--data.help", module])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    for argument in [*own, "--data.train_files", "--data.val_files", "--data.batch_size", "--data.eval_batch_size",
                     "--data.drop_last", "--data.pin_memory"]:
        assert f"  {argument} " in shown, argument
    num_workers = shown[shown.index("  --data.num_workers NUM_WORKERS"):shown.index("  --data.pin_memory")]
    assert re.search(r"\(type:\s+Optional\[int\], default: null\)", num_workers)
