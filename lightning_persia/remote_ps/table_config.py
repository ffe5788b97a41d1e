"""Configuration of a remote embedding table: its sparse optimizer, initialiser and memory policy.

:class:`TableSettings` holds every setting and its one default; :class:`TableConfig` is a table on the shards.

These dataclasses are the public configuration API (re-exported as ``lightning_persia.SGD`` etc.). They
travel to the shards as plain dicts (``to_dict``/``from_dict``), so the PS never unpickles anything.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Tuple, Union

import torch


class ConfigError(ValueError):
    """A table, optimizer or initialiser setting that cannot work; the message names the setting."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass
class EmbeddingOptimizer:
    """Base of the sparse optimizers applied on the parameter server."""

    lr: float = 0.01
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check(math.isfinite(self.lr) and self.lr >= 0, f"{type(self).__name__}.lr must be finite and >= 0, got {self.lr}")
        _check(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            f"{type(self).__name__}.weight_decay must be finite and >= 0, got {self.weight_decay}",
        )


@dataclass
class SGD(EmbeddingOptimizer):
    """Plain SGD: ``w -= lr * (g + weight_decay * w)``.

    Example::

        PersiaStrategy(embedding_optimizer=SGD(lr=0.1))
    """


@dataclass
class Adagrad(EmbeddingOptimizer):
    """Adagrad, element-wise (as ``torch.optim.Adagrad``) or row-wise (one accumulator per row, as FBGEMM).

    Row-wise keeps 4 bytes of state per row instead of ``4 * dim``; it is the usual choice for large tables.

    Example::

        PersiaStrategy(embedding_optimizer=Adagrad(lr=0.01, rowwise=True))
    """

    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    rowwise: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.eps > 0, f"Adagrad.eps must be > 0, got {self.eps}")
        _check(self.initial_accumulator_value >= 0, "Adagrad.initial_accumulator_value must be >= 0")


@dataclass
class Adam(EmbeddingOptimizer):
    """Adam with a per-row step count, so each row's bias correction counts that row's own updates.

    Example::

        PersiaStrategy(embedding_optimizer=Adam(lr=1e-3, betas=(0.9, 0.999)))
    """

    lr: float = 0.001
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        self.betas = tuple(float(b) for b in self.betas)  # YAML gives lists
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"Adam.betas must be two numbers in [0, 1), got {self.betas}")
        _check(self.eps > 0, f"Adam.eps must be > 0, got {self.eps}")


@dataclass
class EmbeddingInit:
    """Base of the row initialisers; a row's initial value depends only on (seed, table, id)."""


@dataclass
class Uniform(EmbeddingInit):
    """Rows drawn from U(low, high)."""

    low: float = -0.01
    high: float = 0.01

    def __post_init__(self) -> None:
        _check(self.low < self.high, f"Uniform needs low < high, got low={self.low} high={self.high}")


@dataclass
class Normal(EmbeddingInit):
    """Rows drawn from N(mean, std^2)."""

    mean: float = 0.0
    std: float = 0.01

    def __post_init__(self) -> None:
        _check(self.std >= 0, f"Normal.std must be >= 0, got {self.std}")


@dataclass
class Constant(EmbeddingInit):
    """Every row equal to ``value`` (zero-initialised first-order weights, as DeepFM uses)."""

    value: float = 0.0


EVICTION_POLICIES = ("lru", "lfu")
STORAGES = ("memory", "disk")
"""Where a shard keeps the rows past a table's ``capacity``: nowhere (``memory``: they are evicted) or on disk."""
STORAGE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
"""How a shard stores a table's rows; the optimizer state is float32 either way."""
DEFAULT_CAPACITY = 1 << 26

OptimizerLike = Union[SGD, Adagrad, Adam]
InitLike = Union[Uniform, Normal, Constant]
_OPTIMIZERS = {cls.__name__: cls for cls in (SGD, Adagrad, Adam)}
_INITS = {cls.__name__: cls for cls in (Uniform, Normal, Constant)}


def _default_optimizer() -> EmbeddingOptimizer:
    return Adagrad(lr=0.01, rowwise=True)


@dataclass(kw_only=True)
class TableSettings:
    """Every setting of a table but its name and dimension, with the one set of defaults.

    ``PersiaStrategy(tables=TableSettings(...))`` applies them to every table it serves; ``TableOverride`` replaces
    some of them for one table; :class:`TableConfig` (what a shard stores) is these settings plus the name and dim.

    ``optimizer`` is the sparse optimizer run on the shards. ``init=None`` keeps each intercepted module's own
    initialisation. ``capacity`` is the number of rows one shard keeps before it evicts (``eviction`` picks the
    victims); ``admit_probability`` is the chance that an unseen id met in training gets a row; ``weight_bound``
    clips every updated weight to ``[-weight_bound, weight_bound]``; ``storage_dtype`` is how the shard stores
    the rows (``"fp16"`` halves their memory; updates are computed in float32 and rounded to nearest).

    ``storage="disk"`` makes ``capacity`` the rows a shard keeps *in memory* (its memory budget for the table):
    the rows eviction picks move to the shard's disk tier (``PSConfig.disk_dir``) and come back when looked up.

    ``ttl_steps`` / ``ttl_seconds`` delete the rows (in memory and on disk) that no training lookup touched for that
    many lookups of the table / seconds, in bulk, on a thread of the shard (needs ``eviction="lru"``).
    ``admit_after=k`` stores an unseen id only at its k-th training lookup (counted by a counting filter, no row
    per unseen id); before that it is served its initial row.

    Example (YAML)::

        tables: {capacity: 1000000, optimizer: {class_path: lightning_persia.Adagrad, init_args: {lr: 0.05}}}
    """

    optimizer: OptimizerLike = field(default_factory=_default_optimizer)
    init: Optional[InitLike] = None
    capacity: int = DEFAULT_CAPACITY
    eviction: Literal["lru", "lfu"] = "lru"
    admit_probability: float = 1.0
    weight_bound: Optional[float] = None
    storage_dtype: Literal["fp16", "fp32"] = "fp32"
    storage: Literal["memory", "disk"] = "memory"
    ttl_steps: Optional[int] = None
    ttl_seconds: Optional[float] = None
    admit_after: int = 1

    def __post_init__(self) -> None:
        self._check_settings("TableSettings")

    def _check_settings(self, where: str) -> None:
        _check(isinstance(self.optimizer, EmbeddingOptimizer), f"{where}: optimizer must be SGD, Adagrad or Adam")
        _check(self.init is None or isinstance(self.init, EmbeddingInit), f"{where}: init must be Uniform, Normal or Constant")
        _check(isinstance(self.capacity, int) and 0 < self.capacity < 1 << 31,
               f"{where}: capacity must be in 1..2^31-1 rows, got {self.capacity}")
        _check(self.eviction in EVICTION_POLICIES, f"{where}: eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        _check(0.0 <= self.admit_probability <= 1.0, f"{where}: admit_probability must be in [0, 1], got {self.admit_probability}")
        _check(self.weight_bound is None or self.weight_bound > 0, f"{where}: weight_bound must be > 0 or None, got {self.weight_bound}")
        _check(self.storage_dtype in STORAGE_DTYPES,
               f"{where}: storage_dtype must be one of {sorted(STORAGE_DTYPES)}, got {self.storage_dtype!r}")
        _check(self.storage in STORAGES, f"{where}: storage must be one of {STORAGES}, got {self.storage!r}")
        _check(self.ttl_steps is None or (isinstance(self.ttl_steps, int) and self.ttl_steps > 0),
               f"{where}: ttl_steps must be a positive number of lookups or None, got {self.ttl_steps!r}")
        _check(self.ttl_seconds is None or self.ttl_seconds > 0, f"{where}: ttl_seconds must be > 0 or None, got {self.ttl_seconds!r}")
        _check((self.ttl_steps is None and self.ttl_seconds is None) or self.eviction == "lru",
               f"{where}: a TTL needs eviction 'lru' (a row's access value is then its last step), got {self.eviction!r}")
        _check(isinstance(self.admit_after, int) and 1 <= self.admit_after <= 255,
               f"{where}: admit_after must be in 1..255 sightings, got {self.admit_after!r}")


TABLE_SETTING_NAMES = tuple(f.name for f in dataclasses.fields(TableSettings))


@dataclass
class TableConfig(TableSettings):
    """One remote table as a shard stores it: its name, its dimension and its :class:`TableSettings`.

    Example::

        TableConfig("user_id", 16, capacity=1_000_000, optimizer=Adagrad(lr=0.05, rowwise=True))
    """

    name: str
    dim: int
    # A stored table needs a concrete initialiser; only intercepted modules have an own one to keep.
    init: InitLike = field(default_factory=Uniform, kw_only=True)

    def __post_init__(self) -> None:
        _check(isinstance(self.name, str) and 0 < len(self.name) <= 256, f"table name must be 1..256 characters, got {self.name!r}")
        _check(isinstance(self.dim, int) and 0 < self.dim <= 65536, f"table {self.name!r}: dim must be in 1..65536, got {self.dim}")
        _check(self.init is not None, f"table {self.name!r}: init must be Uniform, Normal or Constant")
        self._check_settings(f"table {self.name!r}")

    @property
    def settings(self) -> TableSettings:
        """The table's settings without its name and dim."""
        return TableSettings(**{name: getattr(self, name) for name in TABLE_SETTING_NAMES})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-safe) form, as sent over the wire and stored in checkpoints."""
        out = dataclasses.asdict(self)
        out["optimizer"] = {"kind": type(self.optimizer).__name__, **dataclasses.asdict(self.optimizer)}
        out["init"] = {"kind": type(self.init).__name__, **dataclasses.asdict(self.init)}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TableConfig":
        """Inverse of :meth:`to_dict`; a missing setting takes its default, an unknown kind or field is a
        :class:`ConfigError` naming it."""
        try:
            data = dict(data)
            if "optimizer" in data:
                data["optimizer"] = _build(_OPTIMIZERS, data["optimizer"], "optimizer")
            if "init" in data:
                data["init"] = _build(_INITS, data["init"], "init")
            return cls(**data)
        except TypeError as err:
            raise ConfigError(f"bad table config: {err}") from None


def _build(registry: dict[str, type], spec: Any, what: str) -> Any:
    _check(isinstance(spec, dict) and "kind" in spec, f"{what} must be a dict with a 'kind', got {spec!r}")
    spec = dict(spec)
    kind = spec.pop("kind")
    _check(kind in registry, f"unknown {what} kind {kind!r}; expected one of {sorted(registry)}")
    return registry[kind](**spec)

