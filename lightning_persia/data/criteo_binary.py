"""TorchRec's and MLPerf's preprocessed binary Criteo days (``.npy`` per day), memory-mapped and streamed, and their
LightningDataModule.

Layout, as ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys`` (and TorchRec's ``npy_preproc_criteo.py``,
``contiguous_preproc_criteo.py``, ``shuffle_preproc_criteo.py``) write it: three files per day, named by a prefix
(``/data/criteo/day_0``, or ``train`` for Criteo Kaggle):

* ``<prefix>_dense.npy``: ``[N, 13]`` floats, already transformed by TorchRec (``log`` of the shifted counts):
  used as they are;
* ``<prefix>_sparse.npy``: ``[N, 26]`` integers, one id per row and feature: vocabulary ids (TorchRec's contiguous
  preprocessing) or the 32-bit categorical values (a missing one is 0); ``int32`` files (TorchRec's shuffle writes
  them) are read as unsigned;
* or, MLPerf DLRM-DCNv2's multi-hot days (``materialize_synthetic_multihot_dataset.py``, read by TorchRec's
  ``MultiHotCriteoIterDataPipe``), ``<prefix>_sparse_multi_hot.npz`` in its place: an ``np.savez`` archive of
  members ``0.npy`` .. ``25.npy``, member ``f`` ``[N, k_f]`` integers, the ``k_f`` ids of feature ``f`` in each row
  (a bag of ``k_f`` ids, pooled by the model's ``EmbeddingBagCollection``);
* ``<prefix>_labels.npy``: ``[N, 1]`` (or ``[N]``) 0/1 integers.

Ids are used as they are (``ids: raw``, the default: these files hold vocabulary ids) or hashed per feature
(``ids: hash``, as the TSV reader does, so the same value of the same feature is the same id in both).
The days form one stream of rows cut into batches; batch ``k`` goes to rank ``k % world_size`` and, within a rank,
to its DataLoader workers in turn (:func:`~lightning_persia.data._sharding.deal_pieces`), so a rank sees its batches
in the same order whatever its worker count. Each process maps the files and copies one batch at a time.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Iterator, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from lightning_persia.data._batching import Bags, BatchStream, Rows, cut_batches, sparse_columns
from lightning_persia.data._loader import FileSplitDataModule
from lightning_persia.data._npy import load_npy, load_npz_members
from lightning_persia.data._sharding import deal_pieces, process_rank
from lightning_persia.data.batch import CriteoBatch
from lightning_persia.data.criteo import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE, CRITEO_SPARSE_FEATURES, CriteoFeatures, criteo_transform
from lightning_persia.data.transform import DataTransform, IdsSetting

PARTS = ("dense", "sparse", "labels")
MULTI_HOT_SUFFIX = "_sparse_multi_hot.npz"
_UINT32 = 1 << 32
#: Which rows of the listed days a dataset reads: all, or the first or second half (TorchRec's validation and test).
Half = Literal["first", "second"]


def _binary_transform(ids: IdsSetting) -> DataTransform:
    """The binary days' values: vocabulary ids (raw unless ``ids`` says otherwise), dense values as stored."""
    return criteo_transform(ids, "raw", "none", "decimal")


@dataclass
class _Day:
    """The arrays of one day (memory-mapped) and where they come from; ``sparse`` is ``[N, 26]`` (one-hot) or a list
    of 26 ``[N, k_f]`` arrays (multi-hot)."""

    prefix: str
    dense: np.ndarray
    sparse: Union[np.ndarray, List[np.ndarray]]
    labels: np.ndarray

    @property
    def rows(self) -> int:
        return self.labels.shape[0]

    @property
    def multi_hot(self) -> bool:
        return isinstance(self.sparse, list)

    def path(self, part: str) -> str:
        return self.prefix + MULTI_HOT_SUFFIX if part == "sparse" and self.multi_hot else f"{self.prefix}_{part}.npy"


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
    """Maps the files of ``prefix``; raises naming the file when one is missing or not of the layout."""
    arrays = {}
    for part in ("dense", "labels"):
        path = f"{prefix}_{part}.npy"
        if not os.path.isfile(path):
            raise FileNotFoundError(f"binary Criteo file not found: {path!r} (a day is {prefix}_{{dense,sparse,labels}}.npy)")
        arrays[part] = load_npy(path)
    one_hot, multi_hot = f"{prefix}_sparse.npy", prefix + MULTI_HOT_SUFFIX
    if os.path.isfile(one_hot):
        sparse: Union[np.ndarray, List[np.ndarray]] = load_npy(one_hot)
    elif os.path.isfile(multi_hot):
        sparse = _multi_hot_members(multi_hot)
    else:
        raise FileNotFoundError(f"binary Criteo file not found: neither {one_hot!r} (one id per feature, TorchRec's) nor "
                                f"{multi_hot!r} (multi-hot, MLPerf DLRM-DCNv2's)")
    day = _Day(prefix, arrays["dense"], sparse, arrays["labels"])
    _check_shape(day.path("dense"), day.dense, CRITEO_NUM_DENSE, "fiu", "dense")
    if day.multi_hot:
        for f, member in enumerate(day.sparse):
            if member.ndim != 2 or member.dtype.kind not in "iu":
                raise ValueError(f"{day.path('sparse')}: member {f}.npy holds {member.dtype} {member.shape}; expected "
                                 "[N, k] integers (k ids of the feature per row)")
    else:
        _check_shape(day.path("sparse"), day.sparse, CRITEO_NUM_SPARSE, "iu", "sparse")
    labels = day.labels
    if labels.ndim == 2 and labels.shape[1] == 1:
        day.labels = labels[:, 0]
    elif labels.ndim != 1 or labels.dtype.kind not in "iuf":
        raise ValueError(f"{day.path('labels')} holds {labels.dtype} {labels.shape}; expected [N, 1] or [N] integers")
    parts = [("dense", day.dense)] + ([("sparse", m) for m in day.sparse] if day.multi_hot else [("sparse", day.sparse)])
    for part, array in parts:
        if array.shape[0] != day.rows:
            raise ValueError(f"{day.path(part)} has {array.shape[0]} rows but {day.path('labels')} has {day.rows}")
    return day


def _multi_hot_members(path: str) -> List[np.ndarray]:
    members = load_npz_members(path)
    wanted = [str(f) for f in range(CRITEO_NUM_SPARSE)]
    if sorted(members, key=_natural) != wanted:
        raise ValueError(f"{path} holds members {sorted(members, key=_natural)}; expected 0.npy .. {CRITEO_NUM_SPARSE - 1}.npy "
                         "(one per sparse feature, as MLPerf writes them)")
    return [members[name] for name in wanted]


def _check_shape(path: str, array: np.ndarray, columns: int, kinds: str, part: str) -> None:
    if array.ndim != 2 or array.shape[1] != columns or array.dtype.kind not in kinds:
        raise ValueError(f"{path} holds {array.dtype} {array.shape}; expected [N, {columns}] "
                         f"{'numbers' if 'f' in kinds else 'integers'} (one column per {part} feature)")


def _as_ids(values: np.ndarray) -> np.ndarray:
    """Stored integers as int64 ids: 32-bit ones read as unsigned (TorchRec writes wrapped-around int32)."""
    return values.astype(np.int64) & (_UINT32 - 1) if values.dtype in (np.int32, np.uint32) else values.astype(np.int64)


class CriteoBinaryDataset(BatchStream):
    """Streams :class:`~lightning_persia.data.CriteoBatch` es from binary Criteo days, this reader's share.

    Args:
        prefixes: day prefixes (``<prefix>_{dense,sparse,labels}.npy``, or ``<prefix>_sparse_multi_hot.npz`` for
            the sparse part; patterns allowed), read in order.
        batch_size: rows per batch.
        drop_last: drop the last, incomplete batch.
        rank: trainer rank; ``None`` reads it from ``torch.distributed`` (or 0 when not initialised).
        world_size: number of trainer ranks; ``None`` as ``rank``.
        ids: ``raw`` (ids as stored) or ``hash``, for every feature or per feature (``{cat_3: hash}``).
        half: read only the ``first`` half of the days' rows (``ceil(N / 2)``) or the ``second``: TorchRec's and
            MLPerf's validation and test halves of the last day; ``None``: every row.
    """

    def __init__(
        self, prefixes: Sequence[str], batch_size: int = 4096, drop_last: bool = False,
        rank: Optional[int] = None, world_size: Optional[int] = None, ids: IdsSetting = "raw", half: Optional[Half] = None,
    ) -> None:
        super().__init__(batch_size, drop_last, rank, world_size)
        if half not in (None, "first", "second"):
            raise ValueError(f"half must be 'first', 'second' or None, got {half!r}")
        self.prefixes = expand_prefixes(prefixes)
        self.transform = _binary_transform(ids)
        # checked here, in the process that builds the dataset; each reader maps the files again (a map does not
        # travel to a DataLoader worker: pickling it would copy the whole array)
        days = [_open_day(prefix) for prefix in self.prefixes]
        if len({day.multi_hot for day in days}) > 1:
            raise ValueError(f"days {self.prefixes} mix one-hot (_sparse.npy) and multi-hot (_sparse_multi_hot.npz) files")
        self.day_rows = [day.rows for day in days]
        total = sum(self.day_rows)
        middle = (total + 1) // 2
        #: the rows read, ``[start, stop)`` of the days taken as one stream
        self.window: Tuple[int, int] = {None: (0, total), "first": (0, middle), "second": (middle, total)}[half]

    @property
    def num_rows(self) -> int:
        return self.window[1] - self.window[0]

    def _pieces(self) -> List[int]:
        total, size = self.num_rows, self.batch_size
        return [min(size, total - start) for start in range(0, total, size)]

    def __len__(self) -> int:
        """Batches this rank yields (all its DataLoader workers together)."""
        _, world_size = process_rank(self.rank, self.world_size)
        full = self.num_rows // self.batch_size
        batches = full if self.drop_last or full * self.batch_size == self.num_rows else full + 1
        return batches // world_size if world_size > 1 else batches

    def __iter__(self) -> Iterator[CriteoBatch]:
        mine, limit = deal_pieces(self._pieces(), self.batch_size, self.drop_last, self.rank, self.world_size)
        days = [_open_day(prefix) for prefix in self.prefixes]
        return cut_batches(self._chunks(days, mine), self.batch_size, limit, self.drop_last, CRITEO_SPARSE_FEATURES)

    def _chunks(self, days: List[_Day], batches: List[int]) -> Iterator[Rows]:
        starts = np.cumsum([0] + self.day_rows)
        first, stop = self.window
        for k in batches:
            start, end = first + k * self.batch_size, min(first + (k + 1) * self.batch_size, stop)
            for d in range(int(np.searchsorted(starts, start, side="right")) - 1, len(days)):
                if starts[d] >= end:
                    break
                lo, hi = max(start, starts[d]) - starts[d], min(end, starts[d + 1]) - starts[d]
                yield self._featurise(days[d], int(lo), int(hi))

    def _featurise(self, day: _Day, lo: int, hi: int) -> Rows:
        """Rows ``[lo, hi)`` of ``day`` as ids, dense and labels; raises naming the file, column and row of a bad value."""
        if day.multi_hot:
            bags = [_as_ids(np.asarray(member[lo:hi])) for member in day.sparse]
            values = [self.transform.feature_ids(f, torch.from_numpy(b.reshape(-1))) for f, b in enumerate(bags)]
            lengths = torch.tensor([[b.shape[1]] for b in bags], dtype=torch.int32).expand(-1, hi - lo).contiguous()
            sparse = Bags(values, lengths)
        else:
            sparse = sparse_columns(self.transform, torch.from_numpy(_as_ids(np.asarray(day.sparse[lo:hi]))))
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
        return sparse, torch.from_numpy(dense), torch.from_numpy(labels.astype(np.float32))


class CriteoBinaryDataModule(CriteoFeatures, FileSplitDataModule):
    """Binary Criteo days (TorchRec's one-hot, MLPerf's multi-hot) as a streaming LightningDataModule of
    :class:`~lightning_persia.data.CriteoBatch` es.

    Batches are dealt to the ranks and to the DataLoader workers of each rank; with several ranks each runs as many
    batches (the last, fewer than ``world_size``, are left out). The datasets have a length, so Lightning's progress
    bar counts the batches and a fractional ``val_check_interval`` works.

    Args:
        ids: ``raw`` (the default: the stored vocabulary ids, as TorchRec and MLPerf use them) or ``hash``, for every
            feature or per feature (``{cat_3: hash}``); see :mod:`lightning_persia.data.transform`.
        val_test_split: when no ``test_files`` are given, the ``val_files`` days (the last day, for TorchRec and
            MLPerf) are split in half: validation reads the first ``ceil(N / 2)`` rows, test the rest, as TorchRec's
            and MLPerf's DLRM runs do; off: validation reads them all and test only ``test_files``.
        **kwargs: :class:`~lightning_persia.data._loader.FileSplitDataModule`'s: ``train_files`` (day prefixes:
            ``/data/criteo/day_0`` for ``day_0_{dense,sparse,labels}.npy``; patterns such as ``/data/criteo/day_*``),
            ``val_files``, ``test_files``, ``batch_size``, ``eval_batch_size``, ``drop_last``, ``num_workers``,
            ``pin_memory``.
    """

    def __init__(self, ids: IdsSetting = "raw", val_test_split: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()
        #: the ``ids`` setting (:attr:`transform` gives each feature's mode)
        self.ids = ids
        self.val_test_split = val_test_split
        #: what the batches are made of: the stored ids (raw or hashed), the stored dense values as they are
        self.transform = _binary_transform(ids)

    @property
    def splits_val_days(self) -> bool:
        """Whether validation and test are the two halves of the validation days."""
        return self.val_test_split and not self.files["test"] and bool(self.files["val"])

    def make_dataset(self, split: str) -> Optional[CriteoBinaryDataset]:
        halves = self.splits_val_days and split != "train"
        files = self.files["val" if halves else split]
        if not files:
            return None
        train = split == "train"
        return CriteoBinaryDataset(files, batch_size=self.batch_size if train else self.eval_batch_size,
                                   drop_last=self.drop_last and train, ids=self.ids,
                                   half=("first" if split == "val" else "second") if halves else None)
