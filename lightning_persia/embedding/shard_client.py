"""The parameter-server calls the embedding pipeline makes (``PSClient`` makes them over gRPC)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from lightning_persia.ops.keyed_ids import KeyedIds


class ShardClient(Protocol):
    """Lookups and updates of several tables' ids, bucketed by shard once per batch."""

    def shard(self, keyed: KeyedIds) -> Any:
        """``keyed``'s ids bucketed by shard and made ready to send; serves their lookup and their update."""

    def sharder(self) -> Callable[[KeyedIds], Any]:
        """:meth:`shard` as a picklable function (it runs in processes without a client: DataLoader workers)."""

    def lookup_sharded_async(self, sharded: Any, *, train: bool, wire_dtype: str = "fp16") -> "Future[torch.Tensor]":
        """The rows of every id, flat float32 in ``keyed``'s order (table after table, row-major)."""

    def update_sharded_async(
        self, sharded: Any, grads: torch.Tensor, dims: Sequence[int], *, wire_dtype: str = "fp16", sender: Optional[str] = None,
    ) -> "Future[None]":
        """Applies ``grads`` (flat, in ``keyed``'s order, ``dims[t]`` values per row of table ``t``) once."""
