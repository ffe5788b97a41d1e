"""lightning-persia: train recommenders whose embedding tables live on parameter-server shards, with one Lightning line.

Example::

    import lightning as L
    from lightning_persia import Adagrad, PersiaStrategy

    trainer = L.Trainer(strategy=PersiaStrategy(staleness=4, embedding_optimizer=Adagrad(lr=0.01)), devices=2)
    trainer.fit(model, datamodule)

Importing this package checks that torch, FBGEMM, TorchRec and Lightning are releases it supports
(:mod:`lightning_persia._versions`), then imports the strategy, which registers ``strategy="persia"`` with
Lightning (once, in ``lightning_persia/strategy/persia.py``). A parameter-server shard process
(``LIGHTNING_PERSIA_SHARD_PROCESS=1``, set by the launcher of local shards and the Kubernetes manifests) leaves the
strategy out, and with it Lightning and TorchRec; its names are still there on first use.
"""
import importlib
import os

from lightning_persia import _versions

_versions.check()  # before anything imports FBGEMM: a mismatched build fails deep inside it

from lightning_persia.remote_ps.protocol.constants import SHARD_PROCESS_ENV
from lightning_persia.remote_ps.table_config import SGD, Adagrad, Adam, Constant, Normal, TableConfig, TableSettings, Uniform

__all__ = ["PersiaStrategy", "SGD", "Adagrad", "Adam", "Uniform", "Normal", "Constant", "TableSettings", "TableOverride", "TableConfig", "RecoveryConfig",
           "PSSettings", "EmbeddingWorkerSettings", "MetricsEndpoint", "PersiaArgumentParser", "PublishDeltas"]

_LAZY_NAMES = {"PersiaStrategy": "lightning_persia.strategy", "TableOverride": "lightning_persia.strategy.interception",
               "RecoveryConfig": "lightning_persia.strategy.recovery", "PSSettings": "lightning_persia.strategy.ps_settings",
               "EmbeddingWorkerSettings": "lightning_persia.strategy.worker_settings",
               "MetricsEndpoint": "lightning_persia.strategy.metrics", "PersiaArgumentParser": "lightning_persia.strategy.cli_parser",
               "PublishDeltas": "lightning_persia.serving.publish"}


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module 'lightning_persia' has no attribute {name!r}")


if os.environ.get(SHARD_PROCESS_ENV) != "1":
    importlib.import_module("lightning_persia.strategy")
