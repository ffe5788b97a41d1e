"""Run an example with LightningCLI: ``python -m examples.run fit --config examples/dlrm/config.yaml``.

The config names the model and data classes (``class_path``); any value can be overridden on the command
line, e.g. ``--trainer.max_steps=100`` or ``--model.init_args.embedding_dim=32``.
"""
from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_persia  # noqa: F401 - registers the "persia" strategy once the package provides it


def main(args=None) -> LightningCLI:
    return LightningCLI(args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
