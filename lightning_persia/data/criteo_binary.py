"""TorchRec's preprocessed binary Criteo (``.npy`` per day), memory-mapped and streamed, and its LightningDataModule.

Layout, as ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys`` (and TorchRec's ``npy_preproc_criteo.py``,
``contiguous_preproc_criteo.py``, ``shuffle_preproc_criteo.py``) write it: three files per day, named by a prefix
(``/data/criteo/day_0``, or ``train`` for Criteo Kaggle):

* ``<prefix>_dense.npy``: ``[N, 13]`` floats, already transformed by TorchRec (``log`` of the shifted counts):
  used as they are;
* ``<prefix>_sparse.npy``: ``[N, 26]`` integers, the 32-bit categorical values (a missing one is 0) or their
  contiguous indices; ``int32`` files (TorchRec's shuffle writes them) are read as unsigned;
* ``<prefix>_labels.npy``: ``[N, 1]`` (or ``[N]``) 0/1 integers.

Sparse values become ids with :func:`~lightning_persia.data.batch.hash_categorical`, as the TSV reader's do, so the
same value of the same feature is the same id in both (TorchRec's files cannot tell a missing value from 0).
The days form one stream of rows cut into batches; batch ``k`` goes to rank ``k % world_size`` and, within a rank,
to its DataLoader workers in turn (:func:`~lightning_persia.data._sharding.deal_pieces`), so a rank sees its batches
in the same order whatever its worker count. Each process maps the files and copies one batch at a time.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import numpy as np
import torch

from lightning_persia.data._batching import BatchStream, Rows, cut_batches
from lightning_persia.data._loader import FileSplitDataModule
from lightning_persia.data._sharding import deal_pieces
from lightning_persia.data.batch import CriteoBatch, hash_categorical
from lightning_persia.data.criteo import CRITEO_DENSE_FEATURES, CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE, CRITEO_SPARSE_FEATURES, CriteoFeatures
from lightning_persia.data.transform import FeatureTransform

PARTS = ("dense", "sparse", "labels")
_UINT32 = 1 << 32


@dataclass
class _Day:
    """The three arrays of one day (memory-mapped) and where they come from."""

    prefix: str
    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray

    @property
    def rows(self) -> int:
        return self.labels.shape[0]

    def path(self, part: str) -> str:
        return f"{self.prefix}_{part}.npy"


def _natural(text: str) -> list:
    """Sort key putting ``day_2`` before ``day_10``."""
    return [int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", text)]


def expand_prefixes(prefixes: Sequence[str]) -> List[str]:
    """Day prefixes in order; a pattern (``/data/day_*``) expands to the prefixes of its ``*_dense.npy`` files."""
    out: List[str] = []
    for pattern in prefixes:
        pattern = os.path.expanduser(str(pattern))
        if any(ch in pattern for ch in "*?["):
            matches = sorted((path[: -len("_dense.npy")] for path in glob.glob(f"{pattern}_dense.npy")), key=_natural)
            if not matches:
                raise FileNotFoundError(f"no file matches {pattern + '_dense.npy'!r}")
            out.extend(matches)
        else:
            out.append(pattern)
    return out


def _open_day(prefix: str) -> _Day:
    """Maps the three files of ``prefix``; raises naming the file when one is missing or not of the layout."""
    arrays = {}
    for part in PARTS:
        path = f"{prefix}_{part}.npy"
        if not os.path.isfile(path):
            raise FileNotFoundError(f"binary Criteo file not found: {path!r} (a day is {prefix}_{{dense,sparse,labels}}.npy)")
        try:
            arrays[part] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise ValueError(f"{path} is not a readable .npy array: {err}") from None
    day = _Day(prefix, arrays["dense"], arrays["sparse"], arrays["labels"])
    _check_shape(day, "dense", CRITEO_NUM_DENSE, ("f", "i", "u"))
    _check_shape(day, "sparse", CRITEO_NUM_SPARSE, ("i", "u"))
    labels = day.labels
    if labels.ndim == 2 and labels.shape[1] == 1:
        day.labels = labels[:, 0]
    elif labels.ndim != 1 or labels.dtype.kind not in "iuf":
        raise ValueError(f"{day.path('labels')} holds {labels.dtype} {labels.shape}; expected [N, 1] or [N] integers")
    for part in ("dense", "sparse"):
        if getattr(day, part).shape[0] != day.rows:
            raise ValueError(f"{day.path(part)} has {getattr(day, part).shape[0]} rows but {day.path('labels')} has {day.rows}")
    return day


def _check_shape(day: _Day, part: str, columns: int, kinds: Sequence[str]) -> None:
    array = getattr(day, part)
    if array.ndim != 2 or array.shape[1] != columns or array.dtype.kind not in kinds:
        raise ValueError(f"{day.path(part)} holds {array.dtype} {array.shape}; expected [N, {columns}] "
                         f"{'numbers' if 'f' in kinds else 'integers'} (one column per {part} feature)")


class CriteoBinaryDataset(BatchStream):
    """Streams :class:`~lightning_persia.data.CriteoBatch` es from TorchRec's binary Criteo days, this reader's share.

    Args:
        prefixes: day prefixes (``<prefix>_{dense,sparse,labels}.npy``; patterns allowed), read in order.
        batch_size: rows per batch.
        drop_last: drop the last, incomplete batch.
        rank: trainer rank; ``None`` reads it from ``torch.distributed`` (or 0 when not initialised).
        world_size: number of trainer ranks; ``None`` as ``rank``.
    """

    def __init__(
        self, prefixes: Sequence[str], batch_size: int = 4096, drop_last: bool = False,
        rank: Optional[int] = None, world_size: Optional[int] = None,
    ) -> None:
        super().__init__(batch_size, drop_last, rank, world_size)
        self.prefixes = expand_prefixes(prefixes)
        # checked here, in the process that builds the dataset; each reader maps the files again (a map does not
        # travel to a DataLoader worker: pickling it would copy the whole array)
        self.day_rows = [_open_day(prefix).rows for prefix in self.prefixes]

    @property
    def num_rows(self) -> int:
        return sum(self.day_rows)

    def __iter__(self) -> Iterator[CriteoBatch]:
        total, size = self.num_rows, self.batch_size
        pieces = [min(size, total - start) for start in range(0, total, size)]
        mine, limit = deal_pieces(pieces, size, self.drop_last, self.rank, self.world_size)
        days = [_open_day(prefix) for prefix in self.prefixes]
        return cut_batches(self._chunks(days, mine), size, limit, self.drop_last, CRITEO_SPARSE_FEATURES)

    def _chunks(self, days: List[_Day], batches: List[int]) -> Iterator[Rows]:
        starts = np.cumsum([0] + self.day_rows)
        for k in batches:
            start, end = k * self.batch_size, min((k + 1) * self.batch_size, self.num_rows)
            for d in range(int(np.searchsorted(starts, start, side="right")) - 1, len(days)):
                if starts[d] >= end:
                    break
                lo, hi = max(start, starts[d]) - starts[d], min(end, starts[d + 1]) - starts[d]
                yield _featurise(days[d], int(lo), int(hi))


def _featurise(day: _Day, lo: int, hi: int) -> Rows:
    """Rows ``[lo, hi)`` of ``day`` as ids, dense and labels; raises naming the file, column and row of a bad value."""
    sparse = np.asarray(day.sparse[lo:hi])
    values = sparse.astype(np.int64) & (_UINT32 - 1) if sparse.dtype in (np.int32, np.uint32) else sparse.astype(np.int64)
    bad = (values < 0) | (values >= _UINT32)
    if bad.any():
        row, column = map(int, np.argwhere(bad)[0])
        raise ValueError(f"{day.path('sparse')}, row {lo + row}, column {column} ({CRITEO_SPARSE_FEATURES[column]}): "
                         f"{sparse[row, column]} is not a 32-bit categorical value")
    dense = np.array(day.dense[lo:hi], dtype=np.float32)  # a copy: the batch outlives the map
    if not np.isfinite(dense).all():
        row, column = map(int, np.argwhere(~np.isfinite(dense))[0])
        raise ValueError(f"{day.path('dense')}, row {lo + row}, column {column}: {dense[row, column]} is not a finite number")
    labels = np.asarray(day.labels[lo:hi])
    bad_labels = (labels != 0) & (labels != 1)
    if bad_labels.any():
        row = int(np.flatnonzero(bad_labels)[0])
        raise ValueError(f"{day.path('labels')}, row {lo + row}: label {labels[row]} is not 0 or 1 "
                         "(Criteo Kaggle's test set has no labels: TorchRec writes -1)")
    ids = hash_categorical(torch.from_numpy(values))
    return ids, torch.from_numpy(dense), torch.from_numpy(labels.astype(np.float32))


class CriteoBinaryDataModule(CriteoFeatures, FileSplitDataModule):
    """TorchRec's binary Criteo days as a streaming LightningDataModule of :class:`~lightning_persia.data.CriteoBatch` es.

    Batches are dealt to the ranks and to the DataLoader workers of each rank; with several ranks each runs as many
    batches (the last, fewer than ``world_size``, are left out).

    Args:
        train_files: day prefixes of training (``/data/criteo/day_0`` for ``day_0_{dense,sparse,labels}.npy``;
            patterns such as ``/data/criteo/day_*`` allowed), read in order.
        val_files: prefixes of validation; none means no validation loop.
        test_files: prefixes of test; none means ``trainer.test`` has nothing to run.
        batch_size: rows per training batch.
        eval_batch_size: rows per validation/test batch (default: ``batch_size``).
        num_workers: DataLoader worker processes per rank, each reading its share of the batches; ``None``: half
            the rank's share of the cores less one, at most 8 (0 on 2 cores).
        drop_last: drop the last incomplete training batch of a pass.
        pin_memory: pin batches in host memory; ``None``: when the trainer runs on a GPU.
    """

    def __init__(
        self,
        train_files: List[str],
        val_files: Optional[List[str]] = None,
        test_files: Optional[List[str]] = None,
        batch_size: int = 4096,
        eval_batch_size: Optional[int] = None,
        num_workers: Optional[int] = None,
        drop_last: bool = False,
        pin_memory: Optional[bool] = None,
    ) -> None:
        super().__init__(train_files, val_files, test_files, batch_size, eval_batch_size, drop_last, num_workers, pin_memory)
        self.save_hyperparameters()

    def feature_transform(self) -> FeatureTransform:
        """The days' values: 32-bit categorical values hashed (a negative int32 is its unsigned value), the dense
        values as the files hold them (TorchRec's preprocessing transformed them already)."""
        return FeatureTransform(tuple(CRITEO_SPARSE_FEATURES), tuple(CRITEO_DENSE_FEATURES), ids="hash", dense="none")

    def read_files(self, files: List[str], batch_size: int, drop_last: bool) -> CriteoBinaryDataset:
        return CriteoBinaryDataset(files, batch_size=batch_size, drop_last=drop_last)
