"""The private state of Lightning that the strategy has to set, where Lightning offers no public way: in this one
module, each write with a test that fails when Lightning changes what it reads (``tests/strategy/test_data_order.py``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import lightning.pytorch as pl


def keep_the_users_samplers(trainer: "pl.Trainer") -> None:
    """With one process the loaders keep the samplers their user made, as under Lightning's single-device strategy.

    Lightning counts every ``DDPStrategy`` as distributed, whatever the world size, and then replaces each
    loader's sampler by a ``DistributedSampler`` (a shuffling one for training): with one process that only
    reorders the user's data, and with it their results. Lightning reads no strategy hook for this, only the
    trainer's ``use_distributed_sampler`` flag, which it keeps on a private object.
    """
    connector = trainer._accelerator_connector
    if not hasattr(connector, "use_distributed_sampler"):
        raise RuntimeError(
            "PersiaStrategy: this Lightning version keeps no trainer._accelerator_connector.use_distributed_sampler; "
            "with one process pass Trainer(use_distributed_sampler=False) to keep your loaders' samplers"
        )
    connector.use_distributed_sampler = False
