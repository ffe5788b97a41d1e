"""The shards' tables in a PersiaStrategy checkpoint: saved with the dense state of the same step, named by the
``.ckpt``'s :data:`CHECKPOINT_KEY` entry (which ``serving/export.py`` reads), loaded back on resume.

Where the tables' folder is, for paths and ``fsspec`` URLs alike, is ``strategy/ps_checkpoint.py``'s subject.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from lightning_persia.strategy import ps_checkpoint
from lightning_persia.strategy.recovery import PersiaRecoveryError, Recovery, is_shard_failure, new_save_id

if TYPE_CHECKING:
    from lightning_persia.embedding.data_parallel import DataParallelTables
    from lightning_persia.embedding.modules import RemoteModule
    from lightning_persia.embedding.pipeline import EmbeddingPipeline
    from lightning_persia.remote_ps.client import PSClient
    from lightning_persia.strategy.interception import TableDefaults
    from lightning_persia.strategy.ps_settings import PSSettings

CHECKPOINT_KEY = "persia"


class SavingStrategy(Protocol):
    """What the saves need of their strategy (``PersiaStrategy``): Lightning's collectives, the client of the shards,
    the rank's pipeline and what was swapped. A protocol, so that the strategy imports this module and not the other
    way round."""

    is_global_zero: bool
    client: Optional["PSClient"]
    remote_modules: list["RemoteModule"]
    data_parallel_tables: list["DataParallelTables"]
    intercept_kinds: list[str]
    exclude: list[str]
    table_defaults: "TableDefaults"
    ps: "PSSettings"
    wire_dtype: str

    @property
    def pipeline(self) -> Optional["EmbeddingPipeline"]: ...

    def barrier(self, name: Optional[str] = None) -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


class TableSaves:
    """The shards' side of one PersiaStrategy's checkpoints (hooks: ``save``, ``saved``, ``load``)."""

    def __init__(self, strategy: SavingStrategy, recovery: Recovery) -> None:
        self.strategy = strategy
        self.recovery = recovery

    def save(self, filepath: Any, checkpoint: dict[str, Any]) -> str:
        """Collective: every shard saves its state, consistent with ``checkpoint`` (the dense state of the same step),
        into a fresh folder, which ``checkpoint`` then names under :data:`CHECKPOINT_KEY`; returns the folder.

        A shard that fails during the save is a shard failure like any other: every rank rolls back (``checkpoint``
        is refilled with the restored state) and the save starts again, so the ``.ckpt`` written next never names an
        incomplete folder and Lightning never hears of a save that did not happen."""
        strategy = self.strategy
        assert strategy.client is not None
        while True:
            if strategy.pipeline is not None:
                strategy.pipeline.drain()
            strategy.barrier("persia_save_checkpoint")
            self.recovery.check("checkpoint", checkpoint)
            # A fresh folder per save (<file>.ps/<save id>/): the previous one, named by the .ckpt it belongs to,
            # stays intact until the new .ckpt has replaced it, so a save killed half-way never breaks the pair.
            ps_dir = ps_checkpoint.folder_of(filepath, strategy.broadcast(new_save_id()))
            error: Optional[tuple[bool, str]] = None
            if strategy.is_global_zero:
                try:
                    strategy.client.save(ps_dir)
                except Exception as err:  # noqa: BLE001 - every rank hears of it below
                    error = (is_shard_failure(err), f"{type(err).__name__}: {err}")
                    ps_checkpoint.remove(ps_dir)  # what the shards that did answer wrote
            error = strategy.broadcast(error)
            if error is None:
                break
            shard_failure, reason = error
            if not shard_failure or not self.recovery.config.enabled:
                raise PersiaRecoveryError(f"the parameter-server shards could not save the checkpoint {filepath}: {reason}")
            self.recovery.failed(f"the shards' save of checkpoint {Path(str(filepath)).name} failed: {reason}")
        checkpoint[CHECKPOINT_KEY] = {"ps_dir": ps_checkpoint.relative_name(ps_dir),
                                      "tables": [t.name for m in strategy.remote_modules for t in m.remote_tables],
                                      "interception": self._interception_record()}
        return ps_dir

    def saved(self, filepath: Any, ps_dir: str) -> None:
        """The ``.ckpt`` that names ``ps_dir`` is written: earlier saves of that file go, and it is the next rollback's
        target."""
        if self.strategy.is_global_zero:
            ps_checkpoint.remove_other_saves(ps_dir)
        self.recovery.saved(filepath, ps_dir)

    def load(self, checkpoint_path: Any, checkpoint: dict[str, Any]) -> None:
        """Collective: the shards load the tables that ``checkpoint`` (read from ``checkpoint_path``) names, if any
        (also into another shard count)."""
        strategy = self.strategy
        entry = checkpoint.get(CHECKPOINT_KEY)
        if entry is None or strategy.client is None:
            return
        ps_dir = ps_checkpoint.folder_named_by(checkpoint_path, entry["ps_dir"])
        strategy.barrier("persia_load_checkpoint")
        if strategy.is_global_zero:
            strategy.client.load(ps_dir)
        strategy.barrier("persia_load_checkpoint_done")
        strategy.client.refresh_incarnations()  # every shard holds this checkpoint now, a restarted one too
        self.recovery.loaded(checkpoint_path, ps_dir)

    def _interception_record(self) -> dict[str, Any]:
        """What rebuilds the twins without the strategy (``lightning_persia.serving``): which modules were swapped,
        and the configuration of every table, remote or kept (plain values: checkpoints load weights-only)."""
        strategy = self.strategy
        configs = [t.config for m in strategy.remote_modules for t in m.remote_tables]
        configs += [c for tables in strategy.data_parallel_tables for c in tables.configs]
        return {
            "intercept": list(strategy.intercept_kinds),
            "exclude": list(strategy.exclude),
            "data_parallel_max_rows": strategy.table_defaults.data_parallel_max_rows,
            "seed": strategy.ps.seed,
            "wire_dtype": strategy.wire_dtype,
            "tables": {c.name: json.loads(json.dumps(c.to_dict())) for c in configs},
        }
