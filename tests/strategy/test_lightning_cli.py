"""PersiaStrategy from a LightningCLI YAML: every argument typed, nested optimizer/initialiser configs, overrides."""
from __future__ import annotations

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_persia import SGD, Adagrad, Adam, Normal, PersiaStrategy, TableSettings
from toy import ToyRecommender

CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  strategy:
    class_path: lightning_persia.PersiaStrategy
    init_args:
      staleness: 3
      wire_dtype: fp32
      num_local_shards: 3
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
    assert (strategy.staleness, strategy.wire_dtype, strategy.num_local_shards) == (8, "fp32", 3)
    assert strategy.table_defaults.optimizer == Adam(lr=0.002, betas=(0.8, 0.9))
    assert strategy.table_defaults.init == Normal(std=0.02)
    override = strategy.table_defaults.overrides["t0"]
    assert (override.capacity, override.eviction, override.optimizer) == (1000, "lfu", SGD(lr=0.5))


def test_strategy_by_its_registered_name():
    cli = LightningCLI(ToyRecommender, run=False, args=["--trainer.strategy=persia", "--trainer.accelerator=cpu", "--trainer.devices=1"])
    assert isinstance(cli.trainer.strategy, PersiaStrategy)


TABLES_CONFIG = """
trainer:
  accelerator: cpu
  devices: 1
  strategy:
    class_path: lightning_persia.PersiaStrategy
    init_args:
      tables:
        capacity: 5000
        storage_dtype: fp16
        optimizer: {class_path: lightning_persia.SGD, init_args: {lr: 0.3}}
      table_overrides:
        t0: {capacity: 1000, storage: disk}
"""


def test_yaml_table_settings_and_overrides(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(TABLES_CONFIG)
    cli = LightningCLI(ToyRecommender, run=False, args=["--config", str(path), "--trainer.strategy.init_args.tables.eviction=lfu"])
    defaults = cli.trainer.strategy.table_defaults
    assert (defaults.capacity, defaults.storage_dtype, defaults.eviction, defaults.optimizer) == (5000, "fp16", "lfu", SGD(lr=0.3))
    t0 = defaults.config_for("emb.t0", "t0", 4, Normal())
    assert (t0.capacity, t0.storage, t0.storage_dtype, t0.optimizer) == (1000, "disk", "fp16", SGD(lr=0.3))


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
