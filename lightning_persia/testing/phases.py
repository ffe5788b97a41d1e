"""Where a run is, printed as it goes: what a fault injector matches its faults against.

``PhaseMarks`` prints one ``PHASE <name> <step>`` line (rank 0, flushed) each time the run enters a phase, and
``ROLLBACKS <json>`` at the end of ``fit`` (the strategy's rollback events). A phase lasts until the next mark:

    sanity check | forward (from a training batch's start to its backward) | backward (backward and optimizer step)
    | between steps | save (from Lightning's dump of a checkpoint on) | validation | end of training | after fit

The strategy's ``rolling back``/``rolled back`` log lines mark a rollback. Used by
``tools/fault_scenarios.py --random``::

    trainer.callbacks: [{class_path: lightning_persia.testing.phases.PhaseMarks}]
"""
from __future__ import annotations

import json
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

PHASE_PREFIX = "PHASE "
ROLLBACKS_PREFIX = "ROLLBACKS "


class PhaseMarks(Callback):
    """Prints ``PHASE <name> <global step>`` on rank 0 at every phase change (see the module docstring)."""

    def _mark(self, trainer: Trainer, name: str) -> None:
        if trainer.is_global_zero:
            print(f"{PHASE_PREFIX}{name} {trainer.global_step}", flush=True)

    def on_validation_start(self, trainer: Trainer, module: LightningModule) -> None:
        self._mark(trainer, "sanity check" if trainer.sanity_checking else "validation")

    def on_validation_end(self, trainer: Trainer, module: LightningModule) -> None:
        self._mark(trainer, "between steps")

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._mark(trainer, "forward")

    def on_before_backward(self, trainer: Trainer, module: LightningModule, loss: Any) -> None:
        self._mark(trainer, "backward")

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._mark(trainer, "between steps")

    def on_save_checkpoint(self, trainer: Trainer, module: LightningModule, checkpoint: dict) -> None:
        self._mark(trainer, "save")

    def on_train_end(self, trainer: Trainer, module: LightningModule) -> None:
        self._mark(trainer, "end of training")

    def on_fit_end(self, trainer: Trainer, module: LightningModule) -> None:
        self._mark(trainer, "after fit")
        if trainer.is_global_zero:
            events = [{"step": e.step, "where": e.where, "seconds": round(e.seconds, 2)} for e in getattr(trainer.strategy, "rollbacks", [])]
            print(f"{ROLLBACKS_PREFIX}{json.dumps(events)}", flush=True)
