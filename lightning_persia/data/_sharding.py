"""Which part of a stream this process reads: the (rank, world size) of the trainer and the DataLoader worker."""
from __future__ import annotations

from typing import Optional, Tuple

import torch.distributed as dist
from torch.utils.data import get_worker_info


def process_rank(rank: Optional[int] = None, world_size: Optional[int] = None) -> Tuple[int, int]:
    """``(rank, world_size)``: the given values, else ``torch.distributed``'s when initialised, else ``(0, 1)``."""
    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank, world_size = 0, 1
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad rank {rank} for world size {world_size}")
    return rank, world_size


def worker_rank() -> Tuple[int, int]:
    """``(worker id, number of workers)`` of the current DataLoader worker, ``(0, 1)`` in the main process."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def reader_shard(rank: Optional[int] = None, world_size: Optional[int] = None) -> Tuple[int, int]:
    """``(shard, num_shards)`` of this reader: one shard per (rank, DataLoader worker), rank-major."""
    rank, world_size = process_rank(rank, world_size)
    worker, num_workers = worker_rank()
    return rank * num_workers + worker, world_size * num_workers
