"""Streams of whole batches: the base of the streaming datasets, and batches of a fixed size cut from featurised
row chunks of any size."""
from __future__ import annotations

from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from lightning_persia.data.batch import CriteoBatch, make_batch

#: Featurised rows: ids ``[n, F]`` int64, dense ``[n, D]`` float32, labels ``[n]`` float32.
Rows = Tuple[Tensor, Tensor, Tensor]


class BatchStream(IterableDataset):
    """A dataset whose items are whole batches of ``batch_size`` rows (``DataLoader(batch_size=None)``), of which
    each reader (trainer rank, DataLoader worker) streams its own share.

    Args:
        batch_size: rows per batch.
        drop_last: drop the last, incomplete batch.
        rank: trainer rank; ``None`` reads it from ``torch.distributed`` (or 0 when not initialised).
        world_size: number of trainer ranks; ``None`` as ``rank``.
    """

    def __init__(self, batch_size: int, drop_last: bool, rank: Optional[int], world_size: Optional[int]) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.drop_last = batch_size, drop_last
        self.rank, self.world_size = rank, world_size


def cut_batches(
    chunks: Iterable[Rows], batch_size: int, limit: int, drop_last: bool, feature_names: Sequence[str]
) -> Iterator[CriteoBatch]:
    """At most ``limit`` batches of ``batch_size`` rows from ``chunks`` in order; the last one short unless
    ``drop_last``. Never holds more than a batch and a chunk; stops reading once ``limit`` batches are out."""
    pending: List[Rows] = []
    pending_rows = 0
    made = 0
    if limit <= 0:
        return
    for chunk in chunks:
        if not pending and chunk[2].shape[0] == batch_size:
            yield make_batch(*chunk, feature_names)
            made += 1
        else:
            pending.append(chunk)
            pending_rows += chunk[2].shape[0]
            while pending_rows >= batch_size and made < limit:
                rows = [torch.cat(parts) for parts in zip(*pending)]
                yield make_batch(*(part[:batch_size] for part in rows), feature_names)
                made += 1
                pending_rows -= batch_size
                pending = [tuple(part[batch_size:] for part in rows)] if pending_rows else []
        if made >= limit:
            return
    if pending_rows and not drop_last:
        yield make_batch(*(torch.cat(parts) for parts in zip(*pending)), feature_names)
