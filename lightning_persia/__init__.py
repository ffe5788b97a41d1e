"""lightning-persia: train recommenders whose embedding tables live on parameter-server shards, with one Lightning line.

Example::

    import lightning as L
    from lightning_persia import Adagrad, PersiaStrategy

    trainer = L.Trainer(strategy=PersiaStrategy(staleness=4, embedding_optimizer=Adagrad(lr=0.01)), devices=2)
    trainer.fit(model, datamodule)

Importing this package registers ``strategy="persia"`` with Lightning. The strategy (and with it Lightning and
TorchRec) is imported only once Lightning is, so a parameter-server shard process stays free of both.
"""
import importlib
import importlib.abc
import importlib.util
import sys

from lightning_persia.remote_ps.table_config import SGD, Adagrad, Adam, Constant, Normal, TableConfig, Uniform

__all__ = ["PersiaStrategy", "SGD", "Adagrad", "Adam", "Uniform", "Normal", "Constant", "TableOverride", "TableConfig", "RecoveryConfig",
           "PublishDeltas"]

_STRATEGY_NAMES = {"PersiaStrategy": "lightning_persia.strategy", "TableOverride": "lightning_persia.strategy.interception",
                   "RecoveryConfig": "lightning_persia.strategy.recovery", "PublishDeltas": "lightning_persia.serving.publish"}


def __getattr__(name: str):
    if name in _STRATEGY_NAMES:
        return getattr(importlib.import_module(_STRATEGY_NAMES[name]), name)
    raise AttributeError(f"module 'lightning_persia' has no attribute {name!r}")


class _RegisterWithLightning(importlib.abc.MetaPathFinder):
    """Imports the strategy (which registers "persia") right after ``lightning.pytorch`` finishes importing."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "lightning.pytorch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            importlib.import_module("lightning_persia.strategy")

        spec.loader.exec_module = exec_module
        return spec


if "lightning.pytorch" in sys.modules:
    importlib.import_module("lightning_persia.strategy")
else:
    sys.meta_path.insert(0, _RegisterWithLightning())
