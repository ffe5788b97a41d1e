"""The PS YAML config: defaults, OmegaConf env interpolation, dotlist overrides, clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from lightning_persia.remote_ps.config import PSConfig, load_ps_config
from lightning_persia.remote_ps.table_config import Adagrad, ConfigError, TableConfig


def test_defaults():
    config = load_ps_config()
    assert config == PSConfig() and config.table_configs() == {}


def test_yaml_env_and_overrides(tmp_path, monkeypatch):
    path = tmp_path / "ps.yaml"
    path.write_text(
        "seed: ${oc.env:TEST_PS_SEED,1}\n"
        "server_threads: 3\n"
        "tables:\n"
        "  user: {dim: 16, optimizer: {kind: Adagrad, rowwise: true, lr: 0.05}, capacity: 1000}\n"
    )
    monkeypatch.setenv("TEST_PS_SEED", "42")
    config = load_ps_config(str(path), ["tables.user.dim=32", "max_ids_per_request=10", "tables.item.dim=4"])
    assert (config.seed, config.server_threads, config.max_ids_per_request) == (42, 3, 10)
    tables = config.table_configs()
    assert tables["user"] == TableConfig("user", 32, optimizer=Adagrad(lr=0.05, rowwise=True), capacity=1000)
    assert tables["item"].dim == 4


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["no_such_key=1"], "Key 'no_such_key' not in 'PSConfig'"),
        (["seed=abc"], "could not be converted to Integer"),
        (["server_threads=0"], "server_threads must be >= 1"),
        (["nice=20"], "nice must be in [0, 19], got 20"),
        (["move_nice=-1"], "move_nice must be in [0, 19], got -1"),
        (["scheduling=batch"], "scheduling must be one of normal, idle, got 'batch'"),
        (["disk_mapped_mb=-1"], "disk_mapped_mb must be >= 0, got -1"),
        (["memory_limit_mb=0"], "memory_limit_mb must be >= 1 or unset, got 0"),
        (["tables.t.dim=0"], "tables.t: table 't': dim must be in 1..65536"),
        (["tables.t.dim=2", "tables.t.optimizer.kind=Lion"], "unknown optimizer kind 'Lion'"),
        (["seed"], "overrides must be key=value"),
        (["seed=${oc.env:TEST_PS_UNSET_VARIABLE}"], "Environment variable 'TEST_PS_UNSET_VARIABLE' not found"),
    ],
)
def test_bad_settings_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("$", r"\$").replace("{", r"\{").replace("[", r"\[")):
        load_ps_config(None, overrides)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read PS config .*missing.yaml"):
        load_ps_config(str(tmp_path / "missing.yaml"))


def test_malformed_yaml_is_named(tmp_path):
    broken = tmp_path / "ps.yaml"
    broken.write_text("nice: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read PS config .*ps.yaml"):
        load_ps_config(str(broken))


def test_the_example_ps_yaml_loads_with_its_environment(monkeypatch, tmp_path):
    example = Path(__file__).resolve().parents[2] / "examples" / "ps.yaml"
    monkeypatch.delenv("PERSIA_PS_SEED", raising=False)
    monkeypatch.delenv("PERSIA_CHECKPOINT_ROOT", raising=False)
    monkeypatch.setenv("PERSIA_WAL_DIR", str(tmp_path / "wal"))
    config = load_ps_config(str(example), ["server_threads=16"])
    assert (config.seed, config.server_threads, config.checkpoint_root, config.wal_dir) == (0, 16, None, str(tmp_path / "wal"))
    user = config.table_configs()["user_id"]
    assert (user.dim, user.capacity, user.storage_dtype, user.optimizer) == (16, 10_000_000, "fp16", Adagrad(lr=0.05, rowwise=True))
