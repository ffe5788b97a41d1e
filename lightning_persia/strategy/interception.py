"""Finding the embedding modules of a model and swapping them for their remote twins.

The twin of a module comes from a registry keyed by module type (:func:`register_twin`; a subclass of a
registered type gets its base's twin). Each table gets a name on the parameter server made of the module's
path in the model and the table's own name (``sparse.ebc.t_cat_0``), so two collections may reuse table
names. Settings come from the strategy's defaults, then from a per-table override keyed by either name.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from torch import nn
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from lightning_persia.embedding.batch_rows import RemoteTable
from lightning_persia.embedding.data_parallel import DataParallelTables
from lightning_persia.embedding.modules import (
    RemoteEmbedding,
    RemoteEmbeddingBag,
    RemoteEmbeddingBagCollection,
    RemoteEmbeddingCollection,
    RemoteModule,
)
from lightning_persia.remote_ps.table_config import (
    TABLE_SETTING_NAMES,
    Constant,
    EmbeddingInit,
    InitLike,
    Normal,
    OptimizerLike,
    TableConfig,
    TableSettings,
    Uniform,
)

TwinBuilder = Callable[[str, nn.Module, "TableDefaults", int], RemoteModule]
_TWINS: dict[type, tuple[str, TwinBuilder]] = {}  # module type -> (kind name, builder of its twin)


def register_twin(module_type: type, kind: str) -> Callable[[TwinBuilder], TwinBuilder]:
    """Registers ``builder(path, module, defaults, seed) -> twin`` for modules of ``module_type`` (and its
    subclasses), under the kind name that ``PersiaStrategy(intercept=[...])`` selects."""

    def decorate(builder: TwinBuilder) -> TwinBuilder:
        _TWINS[module_type] = (kind, builder)
        return builder

    return decorate


def _registered(module: nn.Module) -> Optional[tuple[str, TwinBuilder]]:
    for cls in type(module).__mro__:
        if cls in _TWINS:
            return _TWINS[cls]
    return None


def _override_of(cls: type, config: TableConfig) -> "TableOverride":
    """Every setting of ``config``, as an override (what replays a recorded table exactly)."""
    return cls(**{name: getattr(config, name) for name in TABLE_SETTING_NAMES})


# Derived from TableSettings, so that a new table setting is overridable per table without being listed twice.
TableOverride = dataclasses.make_dataclass(
    "TableOverride",
    [(name, Optional[hint], field(default=None)) for name, hint in typing.get_type_hints(TableSettings).items()
     if name in TABLE_SETTING_NAMES],
    namespace={"of": classmethod(_override_of)},
)
TableOverride.__module__ = __name__  # make_dataclass takes ``module=`` only from Python 3.12
TableOverride.__doc__ = """Per-table settings that replace the strategy's ``tables`` defaults; ``None`` keeps the default.

    The fields are those of :class:`TableSettings`, each optional (see there for what they mean);
    ``TableOverride.of(config)`` gives every setting of a :class:`TableConfig`.

    Example (YAML)::

        table_overrides:
          t_cat_0: {capacity: 1000000, optimizer: {class_path: lightning_persia.SGD, init_args: {lr: 0.1}}}
    """


@dataclass(kw_only=True)
class TableDefaults(TableSettings):
    """The strategy's table settings, its per-table overrides and the size up to which tables stay on the trainer;
    ``raw_features``: the features whose ids index the rows of a table kept on the trainer directly (vocabulary ids:
    the data module's ``DataTransform.raw_features``); the others' are folded modulo its size."""

    overrides: dict[str, TableOverride] = field(default_factory=dict)
    data_parallel_max_rows: int = 0
    raw_features: tuple[str, ...] = ()

    @classmethod
    def of(cls, tables: Optional[TableSettings], optimizer: Optional[OptimizerLike], init: Optional[InitLike],
           overrides: Optional[dict[str, TableOverride]], data_parallel_max_rows: int) -> "TableDefaults":
        """The defaults of PersiaStrategy's arguments: ``tables``, its shorthands ``embedding_optimizer`` and
        ``embedding_init`` (refused where ``tables`` sets the same setting otherwise), ``table_overrides`` and
        ``data_parallel_max_rows``."""
        unset = TableSettings()
        for shorthand, name, value in (("embedding_optimizer", "optimizer", optimizer), ("embedding_init", "init", init)):
            if tables is not None and value is not None and getattr(tables, name) not in (getattr(unset, name), value):
                raise ValueError(f"PersiaStrategy: {shorthand}={value!r} and tables.{name}={getattr(tables, name)!r} disagree; "
                                 f"{shorthand} is a shorthand for tables.{name}: give one of the two")
        settings = {name: getattr(tables, name) for name in TABLE_SETTING_NAMES} if tables is not None else {}
        if optimizer is not None:
            settings["optimizer"] = optimizer
        if init is not None:
            settings["init"] = init
        return cls(**settings, overrides=dict(overrides or {}), data_parallel_max_rows=data_parallel_max_rows)

    def config_for(self, name: str, short_name: str, dim: int, module_init: EmbeddingInit) -> TableConfig:
        settings = {key: getattr(self, key) for key in TABLE_SETTING_NAMES}
        settings["init"] = self.init or module_init
        for key in (short_name, name):
            override = self.overrides.get(key)
            if override is not None:
                settings.update({k: getattr(override, k) for k in TABLE_SETTING_NAMES if getattr(override, k) is not None})
        return TableConfig(name=name, dim=dim, **settings)


def intercept(model: nn.Module, kinds: Sequence[str], exclude: Sequence[str], defaults: TableDefaults, seed: int = 0) -> list[RemoteModule]:
    """Replaces, in place, every embedding module of ``kinds`` not under an ``exclude`` path; returns the twins.

    Tables of TorchRec collections with at most ``defaults.data_parallel_max_rows`` rows stay in the twin as
    :class:`DataParallelTables`, initialised like the parameter server's rows of ``seed``.
    """
    known = [kind for kind, _ in _TWINS.values()]
    unknown = set(kinds) - set(known)
    if unknown:
        raise ValueError(f"intercept: unknown module kinds {sorted(unknown)}; choose from {known}")
    twins: list[RemoteModule] = []
    replaced: list[str] = []
    for path, module in list(model.named_modules()):
        if not path or any(_under(path, p) for p in replaced) or any(_under(path, p) for p in exclude):
            continue
        twin = _twin(path, module, kinds, defaults, seed)
        if twin is None:
            continue
        parent_path, _, attribute = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attribute, twin)
        replaced.append(path)
        twins.append(twin)
    names = [t.name for twin in twins for t in twin.remote_tables]
    names += [c.name for twin in twins if twin.data_parallel is not None for c in twin.data_parallel.configs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"two embedding tables map to the same parameter-server name: {duplicates}")
    override_names = set(defaults.overrides)
    unused = override_names - set(names) - {n.rpartition(".")[2] for n in names}
    if unused:
        raise ValueError(f"table_overrides name tables the model does not have: {sorted(unused)}; tables are {names}")
    return twins


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _twin(path: str, module: nn.Module, kinds: Sequence[str], defaults: TableDefaults, seed: int) -> Optional[RemoteModule]:
    entry = _registered(module)
    if entry is None or entry[0] not in kinds:
        return None
    return entry[1](path, module, defaults, seed)


@register_twin(EmbeddingBagCollection, "EmbeddingBagCollection")
def _bag_collection_twin(path: str, module: EmbeddingBagCollection, defaults: TableDefaults, seed: int) -> RemoteModule:
    configs = module.embedding_bag_configs()
    poolings = {c.pooling for c in configs}
    if len(poolings) > 1:
        raise ValueError(f"{path}: tables with different pooling types in one EmbeddingBagCollection are not supported; split them")
    pooling = "mean" if poolings == {PoolingType.MEAN} else "sum"
    if poolings - {PoolingType.SUM, PoolingType.MEAN}:
        raise ValueError(f"{path}: pooling {poolings} is not supported; use SUM or MEAN")
    remote, local = _torchrec_tables(path, configs, defaults, seed)
    return RemoteEmbeddingBagCollection(path, remote, pooling, module.is_weighted(), local, _features(configs), configs=list(configs))


@register_twin(EmbeddingCollection, "EmbeddingCollection")
def _collection_twin(path: str, module: EmbeddingCollection, defaults: TableDefaults, seed: int) -> RemoteModule:
    configs = module.embedding_configs()
    remote, local = _torchrec_tables(path, configs, defaults, seed)
    return RemoteEmbeddingCollection(path, remote, local, _features(configs), configs=list(configs), need_indices=module.need_indices())


@register_twin(nn.EmbeddingBag, "EmbeddingBag")
def _bag_twin(path: str, module: nn.EmbeddingBag, defaults: TableDefaults, seed: int) -> RemoteModule:
    _check_plain(path, module)
    if module.mode not in ("sum", "mean", "max"):
        raise ValueError(f"{path}: nn.EmbeddingBag mode {module.mode!r} is not supported")
    table = RemoteTable(path, defaults.config_for(path, path, module.embedding_dim, Normal(0.0, 1.0)))
    return RemoteEmbeddingBag(path, table, module.mode, module.include_last_offset)


@register_twin(nn.Embedding, "Embedding")
def _embedding_twin(path: str, module: nn.Embedding, defaults: TableDefaults, seed: int) -> RemoteModule:
    _check_plain(path, module)
    return RemoteEmbedding(path, RemoteTable(path, defaults.config_for(path, path, module.embedding_dim, Normal(0.0, 1.0))))


MODULE_KINDS = tuple(kind for kind, _ in _TWINS.values())  # the built-in ones: PersiaStrategy's default


def _check_plain(path: str, module: nn.Module) -> None:
    if module.padding_idx is not None or module.max_norm is not None:
        raise ValueError(
            f"{path}: {type(module).__name__} with padding_idx or max_norm cannot be served remotely; "
            f"keep it local with PersiaStrategy(exclude=[{path!r}])"
        )


def _features(configs) -> list[str]:
    return [f for config in configs for f in config.feature_names]


def _torchrec_tables(path: str, configs, defaults: TableDefaults, seed: int) -> tuple[list[RemoteTable], Optional[DataParallelTables]]:
    """The collection's tables served remotely, and those kept on the trainer (None when there are none)."""
    remote, kept = [], []
    for config in configs:
        if config.weight_init_min is not None and config.weight_init_min == config.weight_init_max:
            module_init = Constant(config.weight_init_min)
        elif config.weight_init_min is not None and config.weight_init_max is not None:
            module_init = Uniform(config.weight_init_min, config.weight_init_max)
        else:  # TorchRec's own default: U(-sqrt(1/n), sqrt(1/n))
            bound = math.sqrt(1.0 / config.num_embeddings)
            module_init = Uniform(-bound, bound)
        name = f"{path}.{config.name}"
        table_config = defaults.config_for(name, config.name, config.embedding_dim, module_init)
        if config.num_embeddings <= defaults.data_parallel_max_rows:
            kept.append((table_config, config.num_embeddings, tuple(config.feature_names)))
        else:
            remote.append(RemoteTable(name, table_config, tuple(config.feature_names)))
    if not kept:
        return remote, None
    configs_kept, rows, features = zip(*kept)
    return remote, DataParallelTables(list(configs_kept), list(rows), list(features), seed, defaults.raw_features)
