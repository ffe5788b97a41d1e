"""The Lightning strategy: module interception, hybrid step hooks, checkpoints, the embedded PS cluster."""
from lightning_persia.strategy.persia import PersiaStrategy

__all__ = ["PersiaStrategy"]
