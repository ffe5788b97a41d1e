"""Which part of a stream this process reads: the (rank, world size) of the trainer and the DataLoader worker."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
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


def deal_pieces(
    piece_rows: Sequence[int], batch_size: int, drop_last: bool, rank: Optional[int] = None, world_size: Optional[int] = None,
    worker: Optional[Tuple[int, int]] = None,
) -> Tuple[List[int], int]:
    """This reader's pieces of a stream cut into pieces (row groups, batches), and how many batches it yields.

    Piece ``k`` goes to rank ``k % world_size``; the rank's ``j``-th piece to DataLoader worker ``j % num_workers``.
    A reader cuts its pieces' rows into batches of ``batch_size`` (the last one short unless ``drop_last``). With
    several ranks every rank yields as many batches as the rank with the fewest (a DDP step is collective): the
    readers of a rank with more stop early, its last workers first. Returns ``(piece indices, batch limit)``;
    ``worker``: ``(worker id, number of workers)`` to ask for another reader than this process.
    """
    rank, world_size = process_rank(rank, world_size)
    worker, num_workers = worker or worker_rank()
    pieces = np.arange(len(piece_rows))
    reader = (pieces % world_size) * num_workers + (pieces // world_size) % num_workers  # rank-major
    rows = np.bincount(reader, weights=np.asarray(piece_rows, dtype=np.float64), minlength=world_size * num_workers)
    rows = rows.astype(np.int64).reshape(world_size, num_workers)
    batches = rows // batch_size if drop_last else -(-rows // batch_size)
    limit = int(batches[rank, worker])
    if world_size > 1:
        surplus = int(batches[rank].sum() - batches.sum(1).min())
        for w in reversed(range(num_workers)):  # the rank's surplus comes off its last workers
            cut = min(surplus, int(batches[rank, w]))
            surplus -= cut
            if w == worker:
                limit -= cut
    return pieces[reader == rank * num_workers + worker].tolist(), limit


def rank_batches(
    piece_rows: Sequence[int], batch_size: int, drop_last: bool, rank: Optional[int], world_size: Optional[int], num_workers: int,
) -> int:
    """The batches a rank yields, all its ``num_workers`` DataLoader workers (0: the rank's own process) together."""
    readers = max(num_workers, 1)
    return sum(deal_pieces(piece_rows, batch_size, drop_last, rank, world_size, (w, readers))[1] for w in range(readers))
