"""Configuration of a PS shard process: a YAML file read with OmegaConf, plus dotlist overrides.

Example ``ps.yaml``::

    seed: ${oc.env:PERSIA_SEED,0}
    max_ids_per_request: 2097152
    server_threads: 8
    tables:
      user_id:
        dim: 16
        optimizer: {kind: Adagrad, lr: 0.05, rowwise: true}
        init: {kind: Normal, std: 0.01}
        capacity: 10000000

and on the command line: ``lightning-persia ps serve --config ps.yaml tables.user_id.dim=32 seed=7``.
Tables listed under ``tables`` are created on a shard the first time they are used; trainers can also create
tables at run time with ``PSClient.configure``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_persia.remote_ps.table_config import ConfigError, TableConfig

SCHEDULING = ("normal", "idle")
"""The values of :attr:`PSConfig.scheduling`."""
DURABILITY = ("none", "log", "fsync")
"""The values of :attr:`PSConfig.durability` (``store/wal/``: the write-ahead log)."""


@dataclass
class PSConfig:
    """Settings of one shard. Every field can come from YAML or a ``key=value`` override."""

    seed: int = 0
    """Seed of the deterministic row initialisation; every shard of a cluster must share it."""
    max_ids_per_request: int = 1 << 21
    """Most ids one Lookup or Update may carry (all tables together); more is RESOURCE_EXHAUSTED."""
    max_message_mb: int = 512
    """Largest gRPC message the shard sends or receives."""
    server_threads: int = 8
    """gRPC handler threads (concurrent requests). Keep it above the number of trainer ranks: their lookups of a
    step arrive together, and a request waits for a free thread."""
    torch_threads: int = 1
    """Intra-op threads of torch in the shard (0: torch's default, a thread per core). A shard runs its
    requests side by side on ``server_threads`` and its hot loops are native code, so intra-op threads only
    add synchronisation: more CPU for about the same wall time on idle cores, and on busy cores a thread
    pool's waits cost far more than the work they share."""
    nice: int = 0
    """Added to the shard process's nice value at start (0..19). Shards sharing cores with trainers (the
    embedded cluster) run at a lower priority: a trainer's parallel regions stall on any core taken from
    them, while a prefetched lookup has a whole step to come back."""
    scheduling: str = "normal"
    """The shard's CPU scheduling: ``"normal"``, or ``"idle"`` (Linux ``SCHED_IDLE``: its threads take a core only
    when no other thread wants it, and never preempt one). For shards that share cores with trainers (the
    embedded cluster): a woken shard thread at any nice value may still preempt a trainer thread, whose parallel
    region then stalls (measured: ``strategy/local_cluster.py``'s ``EMBEDDED_SCHEDULING``). A shard on a machine of
    its own gains nothing from it."""
    dedup_window: int = 4096
    """Recently applied update seqs remembered per client, for exactly-once retries."""
    dedup_max_clients: int = 4096
    """Clients whose seqs are remembered (least recently seen forgotten first)."""
    grace_s: float = 5.0
    """On SIGTERM, how long in-flight requests may run before the shard exits."""
    malloc_trim_interval_s: float = 1.0
    """Every so often, hand memory freed by finished requests back to the OS (glibc); 0 never does."""
    max_tables: int = 1024
    """Most tables one shard holds; a Configure that would create more is RESOURCE_EXHAUSTED."""
    checkpoint_root: Optional[str] = None
    """Save and Load only under this folder (PERMISSION_DENIED elsewhere); ``None`` allows any absolute path the
    shard process can write, and any ``fsspec`` URL its credentials reach, which any client holding the token can then
    use. A URL root (``s3://bucket/checkpoints``) allows the URLs under it; a path root allows no URL."""
    restore_from: Optional[str] = None
    """Load a checkpoint before serving: a checkpoint folder, or a folder holding several (the newest complete
    one is loaded, e.g. a PersiaStrategy ``<ckpt>.ps`` folder or a whole checkpoint directory). A shard
    that cannot load one refuses to start (exit status 2) rather than serve empty tables."""
    disk_dir: Optional[str] = None
    """Where the disk tiers of the tables of ``storage: disk`` live (a folder of this shard's own; it needs the disk
    space of the rows past the tables' memory budgets, ~56 bytes a row at dim 16 in fp16); ``None`` refuses such tables."""
    disk_mapped_mb: int = 1024
    """Of each disk table's records, how many MB the shard keeps mapped into its page tables, the most read first: a
    read of a mapped record is a memory copy, of any other a ``pread`` (docs/disk_tier.md, *Reads*). The mapped pages
    count in the shard's resident memory (the page cache holds them either way): raise it where memory allows.
    Not used with ``memory_limit_mb``."""
    memory_limit_mb: Optional[int] = None
    """The shard's resident memory (RSS, in MiB) its disk tables' mapped records may fill up to, instead of
    ``disk_mapped_mb`` each: the demoter maps the most read segments while the shard's RSS is below the limit less
    1/16 of it, and unmaps the least read as the rows and id maps grow (docs/disk_tier.md, *Reads*). It limits only
    the mappings: the rows in memory are the tables' ``capacity``. Set it to the memory the shard may hold (its
    container's limit); ``None``: a fixed ``disk_mapped_mb`` a table."""
    durability: str = "none"
    """What an acknowledged update survives (docs/reliability.md, *Durability*): ``"none"``: nothing (a restarted shard
    starts from ``restore_from`` and its clients roll back to a checkpoint); ``"log"``: the shard process dying
    (every update is in the write-ahead log in ``wal_dir`` before it is acknowledged; a restarted shard replays it
    and its clients go on); ``"fsync"``: also the machine dying (the log is flushed to the disk before the
    acknowledgement)."""
    wal_dir: Optional[str] = None
    """Folder of the write-ahead logs (each shard writes ``shard-NNNNN-of-NNNNN`` in it); needed unless
    ``durability`` is ``"none"``. It must outlive the shard process (and, for ``"fsync"``, the machine)."""
    metrics_port: Optional[int] = None
    """Serve Prometheus metrics at ``http://<host>:<port>/metrics`` (the shard's ``--host``); 0 picks a free port,
    ``None`` serves none. A port that is taken stops the shard before it serves any call."""
    read_only: bool = False
    """Serve lookups only (an inference shard): a training lookup is answered like an evaluation lookup (unseen
    ids read their initial row, nothing is inserted, evicted or touched); Update, Load, Save and a Configure
    that would create or change a table are refused with FAILED_PRECONDITION."""
    handover_deadline_s: float = 30.0
    """A shard that fenced the slots it hands over (a live move's cut-over) and has heard nothing from the move's
    coordinator for this long settles the move on its own: it asks the first new owner whether it adopted the new map,
    and finishes or rolls back by the answer (docs/elastic.md, *A move without its coordinator*). Requests for those
    slots wait meanwhile: keep it under the clients' retry budget (``RetryPolicy``), well over a cut-over's seconds."""
    move_nice: int = 10
    """Added to the nice value of the threads a live move's pages are given and taken on (0..19; Linux, where a
    thread has a nice value of its own; elsewhere they keep the shard's). Pages sent once the slots are fenced, which
    requests wait for, keep the shard's priority. On a 2-core machine whose shards share the cores with the trainer
    (20M rows, ``copy_share`` 0.25), samples/s during a grow were 0.66x to 0.82x of the steady rate at 0 (5 runs),
    0.75x to 0.96x at 10 (8 runs) and 0.84x to 0.90x at 19 (3 runs), but a grow took 37 to 49 s at 0, 48 to 55 s
    at 10 and 53 to 78 s at 19. Not 19: a shard is scaled out when it runs out of CPU, and on a core its requests
    keep busy a thread at +19 gets about 1/70 of a request thread's share, at +10 about 1/10."""
    fault_delay_s: float = 0.0
    """Testing only: every Lookup and Update sleeps this long before it runs (a slow shard)."""
    fault_save_delay_s: float = 0.0
    """Testing only: a Save pauses this long after each chunk of rows it writes (to kill a shard in the middle of a save)."""
    fault_ack_delay_s: float = 0.0
    """Testing only: an Update pauses this long once it is applied and logged, before it answers (to kill a shard
    between a log write and its acknowledgement)."""
    fault_replay_delay_s: float = 0.0
    """Testing only: the replay of the write-ahead log pauses this long after each record (to kill a shard in the
    middle of its replay)."""
    tables: Dict[str, Any] = field(default_factory=dict)
    """Table defaults: ``{name: TableConfig fields without the name}``."""

    def __post_init__(self) -> None:
        if not self.handover_deadline_s > 0:
            raise ConfigError(f"PS config: handover_deadline_s must be > 0, got {self.handover_deadline_s}")
        for name in ("max_ids_per_request", "max_message_mb", "server_threads", "dedup_window", "dedup_max_clients", "max_tables"):
            if getattr(self, name) < 1:
                raise ConfigError(f"PS config: {name} must be >= 1, got {getattr(self, name)}")
        if self.torch_threads < 0:
            raise ConfigError(f"PS config: torch_threads must be >= 0, got {self.torch_threads}")
        for name in ("nice", "move_nice"):
            if not 0 <= getattr(self, name) <= 19:
                raise ConfigError(f"PS config: {name} must be in [0, 19], got {getattr(self, name)}")
        if self.scheduling not in SCHEDULING:
            raise ConfigError(f"PS config: scheduling must be one of {', '.join(SCHEDULING)}, got {self.scheduling!r}")
        if self.scheduling == "idle" and not hasattr(os, "SCHED_IDLE"):
            raise ConfigError("PS config: scheduling 'idle' needs Linux's SCHED_IDLE, which this platform does not have")
        if self.disk_mapped_mb < 0:
            raise ConfigError(f"PS config: disk_mapped_mb must be >= 0, got {self.disk_mapped_mb}")
        if self.memory_limit_mb is not None and self.memory_limit_mb < 1:
            raise ConfigError(f"PS config: memory_limit_mb must be >= 1 or unset, got {self.memory_limit_mb}")
        if self.memory_limit_mb is not None and not os.path.exists("/proc/self/statm"):
            raise ConfigError("PS config: memory_limit_mb reads the shard's resident memory from /proc/self/statm, "
                              "which this platform does not have")
        if self.malloc_trim_interval_s < 0:
            raise ConfigError(f"PS config: malloc_trim_interval_s must be >= 0, got {self.malloc_trim_interval_s}")
        for name in ("fault_delay_s", "fault_save_delay_s", "fault_ack_delay_s", "fault_replay_delay_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"PS config: {name} must be >= 0, got {getattr(self, name)}")
        if self.durability not in DURABILITY:
            raise ConfigError(f"PS config: durability must be one of {', '.join(DURABILITY)}, got {self.durability!r}")
        if self.durability != "none" and not self.wal_dir and not self.read_only:
            raise ConfigError(f"PS config: durability {self.durability!r} needs wal_dir, the folder of the write-ahead log")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"PS config: metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.grace_s < 0:
            raise ConfigError(f"PS config: grace_s must be >= 0, got {self.grace_s}")
        self.table_configs()  # fail at load time, naming the table

    def table_configs(self) -> dict[str, TableConfig]:
        """The ``tables`` section as :class:`TableConfig` objects (``ConfigError`` names a bad table)."""
        out = {}
        for name, spec in self.tables.items():
            if not isinstance(spec, dict):
                raise ConfigError(f"PS config: tables.{name} must be a mapping of table settings, got {spec!r}")
            if "name" in spec and spec["name"] != name:
                raise ConfigError(f"PS config: tables.{name} has a different name {spec['name']!r}")
            try:
                out[name] = TableConfig.from_dict({**spec, "name": name})
            except ConfigError as err:
                raise ConfigError(f"PS config: tables.{name}: {err}") from None
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_ps_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> PSConfig:
    """Defaults, then the YAML file at ``path`` (if any), then ``key=value`` overrides; interpolations resolved.

    Raises :class:`ConfigError` with the file, key and reason on any bad input.
    """
    try:
        merged = OmegaConf.structured(PSConfig)
        if path is not None:
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        if overrides:
            bad = [item for item in overrides if "=" not in item]
            if bad:
                raise ConfigError(f"PS config overrides must be key=value, got {bad}")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        plain = OmegaConf.to_container(merged, resolve=True, throw_on_missing=True)
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read PS config {path!r}: {err}") from None
    except OmegaConfBaseException as err:
        sources = ([f"file {path}"] if path else []) + ([f"overrides {list(overrides)}"] if overrides else [])
        raise ConfigError(f"bad PS config ({', '.join(sources) or 'defaults'}): {err}") from None
    return PSConfig(**plain)
