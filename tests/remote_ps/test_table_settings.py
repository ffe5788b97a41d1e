"""One set of table defaults: TableSettings, the TableConfig a shard stores, and the per-table TableOverride."""
from __future__ import annotations

import dataclasses
import typing

import pytest

from lightning_persia import SGD, Adagrad, Normal, TableConfig, TableOverride, TableSettings, Uniform
from lightning_persia.remote_ps.table_config import TABLE_SETTING_NAMES, ConfigError
from lightning_persia.strategy.interception import TableDefaults


def test_override_has_exactly_the_settings_each_optional():
    override_fields = {f.name: f for f in dataclasses.fields(TableOverride)}
    assert list(override_fields) == list(TABLE_SETTING_NAMES)
    assert all(getattr(TableOverride(), name) is None for name in TABLE_SETTING_NAMES)
    settings_types = typing.get_type_hints(TableSettings)
    for name, hint in typing.get_type_hints(TableOverride).items():
        assert hint == typing.Optional[settings_types[name]], name  # what LightningCLI parses a YAML override as


def test_override_of_a_config_replays_every_setting():
    config = TableConfig("t", 4, capacity=9, optimizer=SGD(lr=0.2), init=Normal(std=0.5), ttl_seconds=3.0, admit_after=4)
    replayed = TableDefaults(overrides={"t": TableOverride.of(config)}).config_for("t", "t", 4, Uniform())
    assert replayed == config


def test_a_table_config_takes_its_defaults_from_the_settings():
    settings, config = TableSettings(), TableConfig("t", 4)
    for name in TABLE_SETTING_NAMES:
        if name != "init":  # a stored table needs a concrete initialiser; TableSettings(init=None) keeps the module's
            assert getattr(config, name) == getattr(settings, name), name
    assert config.optimizer == Adagrad(lr=0.01, rowwise=True)
    assert (settings.init, config.init) == (None, Uniform())
    assert config.settings == dataclasses.replace(settings, init=Uniform())


def test_strategy_defaults_build_tables_from_settings_then_overrides():
    defaults = TableDefaults(capacity=100, storage_dtype="fp16", overrides={"b": TableOverride(capacity=7, optimizer=SGD(lr=3.0))})
    a = defaults.config_for("m.a", "a", 4, Normal(0.0, 1.0))
    b = defaults.config_for("m.b", "b", 4, Normal(0.0, 1.0))
    assert (a.capacity, a.storage_dtype, a.optimizer, a.init) == (100, "fp16", Adagrad(lr=0.01, rowwise=True), Normal(0.0, 1.0))
    assert (b.capacity, b.storage_dtype, b.optimizer) == (7, "fp16", SGD(lr=3.0))


def test_bad_settings_fail_where_they_are_given_naming_the_setting():
    with pytest.raises(ConfigError, match="TableSettings: capacity"):
        TableSettings(capacity=0)
    with pytest.raises(ConfigError, match="TableSettings: a TTL needs eviction 'lru'"):
        TableSettings(eviction="lfu", ttl_steps=10)
    with pytest.raises(ConfigError, match="table 't': storage_dtype"):
        TableConfig("t", 4, storage_dtype="int8")


def test_a_dict_without_the_newer_settings_loads_with_their_defaults():
    old = {"name": "t", "dim": 4, "optimizer": {"kind": "SGD", "lr": 0.1, "weight_decay": 0.0},
           "init": {"kind": "Uniform", "low": -0.1, "high": 0.1}, "capacity": 10, "eviction": "lru",
           "admit_probability": 1.0, "weight_bound": None, "storage_dtype": "fp32"}  # as written before the disk tier
    config = TableConfig.from_dict(old)
    assert (config.optimizer, config.storage, config.ttl_steps, config.admit_after) == (SGD(lr=0.1), "memory", None, 1)
    assert TableConfig.from_dict(config.to_dict()) == config
    assert TableConfig.from_dict({"name": "t", "dim": 4}).optimizer == TableSettings().optimizer
