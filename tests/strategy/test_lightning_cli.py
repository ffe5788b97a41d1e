"""PersiaStrategy from a LightningCLI YAML: every argument typed, nested optimizer/initialiser configs, overrides."""
from __future__ import annotations

import re

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_persia import SGD, Adagrad, Adam, Constant, MetricsEndpoint, Normal, PersiaArgumentParser, PersiaStrategy, PSSettings, TableSettings
from toy import ToyRecommender

STRATEGY = """
trainer:
  accelerator: cpu
  devices: 1
  strategy:
    class_path: lightning_persia.PersiaStrategy
    init_args:
"""

CONFIG = STRATEGY + """\
      staleness: 3
      wire_dtype: fp32
      ps: {num_local_shards: 3, timeout_s: 30}
      metrics: {port: 9400, host: 0.0.0.0}
      embedding_optimizer: {class_path: lightning_persia.Adam, init_args: {lr: 0.002, betas: [0.8, 0.9]}}
      embedding_init: {class_path: lightning_persia.Normal, init_args: {std: 0.02}}
      table_overrides:
        t0: {capacity: 1000, eviction: lfu, optimizer: {class_path: lightning_persia.SGD, init_args: {lr: 0.5}}}
"""


def test_yaml_configures_the_strategy_and_command_line_overrides_win(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    cli = LightningCLI(ToyRecommender, run=False, args=["--config", str(path), "--trainer.strategy.init_args.staleness=8"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, PersiaStrategy)
    assert (strategy.staleness, strategy.wire_dtype) == (8, "fp32")
    assert strategy.ps == PSSettings(num_local_shards=3, timeout_s=30)
    assert strategy.metrics == MetricsEndpoint(port=9400, host="0.0.0.0")
    assert strategy.table_defaults.optimizer == Adam(lr=0.002, betas=(0.8, 0.9))
    assert strategy.table_defaults.init == Normal(std=0.02)
    override = strategy.table_defaults.overrides["t0"]
    assert (override.capacity, override.eviction, override.optimizer) == (1000, "lfu", SGD(lr=0.5))


def test_strategy_by_its_registered_name():
    cli = LightningCLI(ToyRecommender, run=False, args=["--trainer.strategy=persia", "--trainer.accelerator=cpu", "--trainer.devices=1"])
    assert isinstance(cli.trainer.strategy, PersiaStrategy)


TABLES_CONFIG = STRATEGY + """\
      tables:
        capacity: 5000
        storage_dtype: fp16
        optimizer: {class_path: lightning_persia.SGD, init_args: {lr: 0.3}}
      table_overrides:
        t0: {capacity: 1000, storage: disk, eviction: lru, ttl_steps: 50, admit_after: 2, init: {class_path: lightning_persia.Constant, init_args: {value: 0.5}}}
"""


def test_yaml_table_settings_and_overrides(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(TABLES_CONFIG)
    cli = LightningCLI(ToyRecommender, run=False, args=["--config", str(path), "--trainer.strategy.init_args.tables.eviction=lfu"])
    defaults = cli.trainer.strategy.table_defaults
    assert (defaults.capacity, defaults.storage_dtype, defaults.eviction, defaults.optimizer) == (5000, "fp16", "lfu", SGD(lr=0.3))
    t0 = defaults.config_for("emb.t0", "t0", 4, Normal())
    assert (t0.capacity, t0.storage, t0.storage_dtype, t0.optimizer) == (1000, "disk", "fp16", SGD(lr=0.3))
    assert (t0.ttl_steps, t0.admit_after, t0.init, t0.eviction) == (50, 2, Constant(value=0.5), "lru")


def test_yaml_override_of_a_wrong_type_is_refused_naming_the_setting(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(TABLES_CONFIG.replace("storage: disk", "storage: tape"))
    with pytest.raises(SystemExit):
        LightningCLI(ToyRecommender, run=False, args=["--config", str(path)])
    assert "storage" in capsys.readouterr().err


def test_a_moved_flat_argument_names_its_new_place():
    with pytest.raises(TypeError, match=r"PersiaStrategy\(capacity=..., eviction=...\) moved: PersiaStrategy\(tables=TableSettings"):
        PersiaStrategy(capacity=10, eviction="lfu")
    with pytest.raises(ValueError, match="embedding_optimizer=.* and tables.optimizer=.* disagree"):
        PersiaStrategy(tables=TableSettings(optimizer=Adam()), embedding_optimizer=SGD())
    with pytest.raises(ValueError, match="embedding_init=.* and tables.init=.* disagree"):
        PersiaStrategy(tables=TableSettings(init=Normal()), embedding_init=Normal(std=1.0))
    strategy = PersiaStrategy(tables=TableSettings(capacity=10))
    assert (strategy.table_defaults.capacity, strategy.table_defaults.optimizer) == (10, Adagrad(lr=0.01, rowwise=True))
    strategy = PersiaStrategy(tables=TableSettings(capacity=10), embedding_optimizer=SGD(lr=0.2))  # the shorthand with other settings
    assert (strategy.table_defaults.capacity, strategy.table_defaults.optimizer) == (10, SGD(lr=0.2))


def test_old_flat_connection_and_metrics_arguments_name_their_new_place():
    with pytest.raises(TypeError, match=re.escape(
        "PersiaStrategy(ps_addresses=..., ps_timeout_s=..., metrics_port=...) moved: "
        "PersiaStrategy(ps=PSSettings(addresses=..., timeout_s=...), metrics=MetricsEndpoint(port=...)); "
        "in YAML init_args.ps.addresses, init_args.ps.timeout_s, init_args.metrics.port")):
        PersiaStrategy(ps_addresses=["127.0.0.1:5000"], ps_timeout_s=3, metrics_port=9400)
    with pytest.raises(TypeError, match=re.escape("PersiaStrategy(num_local_shards=...) moved: PersiaStrategy(ps=PSSettings(num_local_shards=...))")):
        PersiaStrategy(num_local_shards=1)


OLD_YAML = STRATEGY + """\
      staleness: 2
      {old}
"""


@pytest.mark.parametrize("old, new_place", [
    ("ps_token: abc", "PersiaStrategy(ps_token=...) moved: PersiaStrategy(ps=PSSettings(token=...)); in YAML init_args.ps.token"),
    ("metrics_host: 0.0.0.0", "PersiaStrategy(metrics_host=...) moved: PersiaStrategy(metrics=MetricsEndpoint(host=...)); in YAML init_args.metrics.host"),
    ("capacity: 10", "PersiaStrategy(capacity=...) moved: PersiaStrategy(tables=TableSettings(capacity=...)); in YAML init_args.tables.capacity"),
])
def test_an_old_flat_argument_in_yaml_is_refused_naming_its_new_place(old, new_place, tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(OLD_YAML.format(old=old))
    # jsonargparse refuses the key before the strategy sees it; the strategy's parser says where it went
    with pytest.raises(SystemExit) as done:
        LightningCLI(ToyRecommender, run=False, args=["--config", str(path)], parser_class=PersiaArgumentParser)
    assert done.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: lightning_persia.PersiaStrategy: {new_place}"), last


def test_other_parse_errors_keep_jsonargparse_s_report(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(OLD_YAML.format(old="no_such_argument: 1"))
    with pytest.raises(SystemExit):
        LightningCLI(ToyRecommender, run=False, args=["--config", str(path)], parser_class=PersiaArgumentParser)
    assert "Option 'no_such_argument' is not accepted" in capsys.readouterr().err
