"""Streams of whole batches: the base of the streaming datasets, and batches of a fixed size cut from featurised
row chunks of any size (one id per row and feature, or bags of ids: multi-hot)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.data import IterableDataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.data.batch import CriteoBatch
from lightning_persia.data.transform import DataTransform


@dataclass
class Bags:
    """The sparse features of ``n`` rows, feature-major as a KJT holds them: ``values[f]`` the ids of feature ``f``
    (row after row), ``lengths[f, i]`` how many of them row ``i`` has (0: none, 1: one-hot, more: multi-hot)."""

    values: List[Tensor]
    lengths: Tensor  # [F, n] int32

    @classmethod
    def one_hot(cls, ids: Tensor) -> "Bags":
        """One id per row and feature: ``ids`` ``[n, F]``."""
        return cls(list(ids.t()), torch.ones(ids.shape[1], ids.shape[0], dtype=torch.int32))

    def __len__(self) -> int:
        return self.lengths.shape[1]

    def rows(self, start: int, stop: int) -> "Bags":
        """Rows ``[start, stop)``."""
        if bool((self.lengths == 1).all()):
            return Bags([v[start:stop] for v in self.values], self.lengths[:, start:stop])
        ends = torch.cumsum(self.lengths, dim=1)
        starts = ends - self.lengths
        values = []
        for f, v in enumerate(self.values):
            first = int(starts[f, start]) if start < len(self) else v.numel()
            last = int(ends[f, stop - 1]) if stop > start else first
            values.append(v[first:last])
        return Bags(values, self.lengths[:, start:stop])

    @staticmethod
    def cat(parts: Sequence["Bags"]) -> "Bags":
        return Bags([torch.cat(vs) for vs in zip(*(p.values for p in parts))], torch.cat([p.lengths for p in parts], dim=1))

    def kjt(self, feature_names: Sequence[str]) -> KeyedJaggedTensor:
        if len(self.values) != len(feature_names):
            raise ValueError(f"{len(self.values)} sparse columns for {len(feature_names)} feature names")
        return KeyedJaggedTensor(keys=list(feature_names), values=torch.cat(self.values) if self.values else torch.zeros(0, dtype=torch.int64),
                                 lengths=self.lengths.reshape(-1), stride=len(self))


#: Featurised rows: sparse ids (:class:`Bags`), dense ``[n, D]`` float32, labels ``[n]`` float32.
Rows = Tuple[Bags, Tensor, Tensor]


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
        #: the DataLoader workers that read it (0: the process that iterates it); the data module sets it to its
        #: loader's, for the datasets whose number of batches depends on it
        self.num_workers = 0


def _batch(rows: Rows, feature_names: Sequence[str]) -> CriteoBatch:
    bags, dense, labels = rows
    return CriteoBatch(sparse_features=bags.kjt(feature_names), dense_features=dense.to(torch.float32).contiguous(),
                       labels=labels.to(torch.float32).contiguous())


def _cat(parts: List[Rows]) -> Rows:
    return Bags.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


def _slice(rows: Rows, start: int, stop: int) -> Rows:
    return rows[0].rows(start, stop), rows[1][start:stop], rows[2][start:stop]


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
            yield _batch(chunk, feature_names)
            made += 1
        else:
            pending.append(chunk)
            pending_rows += chunk[2].shape[0]
            while pending_rows >= batch_size and made < limit:
                rows = _cat(pending)
                yield _batch(_slice(rows, 0, batch_size), feature_names)
                made += 1
                pending_rows -= batch_size
                pending = [_slice(rows, batch_size, batch_size + pending_rows)] if pending_rows else []
        if made >= limit:
            return
    if pending_rows and not drop_last:
        yield _batch(_cat(pending), feature_names)


def sparse_columns(transform: DataTransform, values: Tensor, missing: Optional[Tensor] = None) -> Bags:
    """One stored value per row and feature (``[n, F]`` int64, ``missing`` marking nulls) as ``transform``'s ids."""
    if missing is None or not bool(missing.any()):
        return Bags([transform.feature_ids(f, column) for f, column in enumerate(values.t())],
                    torch.ones(values.shape[1], values.shape[0], dtype=torch.int32))
    parts = [sparse_column(transform, f, column, absent) for f, (column, absent) in enumerate(zip(values.t(), missing.t()))]
    return Bags([ids for ids, _ in parts], torch.stack([lengths for _, lengths in parts]))


def sparse_column(transform: DataTransform, feature: int, values: Tensor, missing: Tensor) -> Tuple[Tensor, Tensor]:
    """``(ids, lengths)`` of one feature's stored values ``[n]``: hashed (a null is the feature's missing id) or raw
    (a null is a row without an id)."""
    if transform.ids[feature] == "raw":
        return values[~missing].to(torch.int64), (~missing).to(torch.int32)
    return transform.feature_ids(feature, values, missing), torch.ones(values.shape[0], dtype=torch.int32)
