"""UCI Adult (census income) as a LightningDataModule of :class:`~lightning_persia.data.CriteoBatch` es.

The data ships with the package (``adult.csv``; see ``ADULT_LICENSE.md``: UCI Machine Learning Repository,
Becker & Kohavi 1996, CC BY 4.0). It is the 48,842 rows of the original ``adult.test`` (16,281 rows) followed
by the original ``adult.data`` (32,561 rows), with a header row and the trailing dots of the test labels
removed. The standard split is kept: the 32,561 ``adult.data`` rows (the *last* ones of this file) train, the
16,281 ``adult.test`` rows (the *first* ones) test; validation uses the test rows.

Features:

* sparse (one id per row and column, in a KJT): the 8 categorical columns, each through a small vocabulary
  built from the training rows (sorted values, ids ``1..V``); ``?`` (missing) and a value never seen in
  training get id 0, so the table of a column has ``V + 1`` rows (:data:`ADULT_CARDINALITIES`);
* dense: the 6 numeric columns, ``capital-gain`` and ``capital-loss`` through ``log1p`` (they are 0 for
  most rows and reach 99,999), then standardised with the training mean and standard deviation;
* label: income > 50K.
"""
from __future__ import annotations

import csv
import os
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lightning_persia.data._loader import on_gpu
from lightning_persia.data.batch import CriteoBatch, make_batch

ADULT_CSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adult.csv")
ADULT_NUM_TRAIN = 32561
ADULT_NUM_TEST = 16281
#: CSV columns of the categorical features, in KJT key order.
ADULT_CATEGORICAL_COLUMNS: List[str] = [
    "workclass", "education", "marital-status", "occupation", "relationship", "race", "gender", "native-country",
]  # fmt: skip
#: KJT keys of the sparse features (the categorical columns with ``_`` for ``-``).
ADULT_SPARSE_FEATURES: List[str] = [c.replace("-", "_") for c in ADULT_CATEGORICAL_COLUMNS]
#: CSV columns of the dense features, in order.
ADULT_NUMERIC_COLUMNS: List[str] = ["age", "fnlwgt", "educational-num", "capital-gain", "capital-loss", "hours-per-week"]
ADULT_DENSE_FEATURES: List[str] = [c.replace("-", "_") for c in ADULT_NUMERIC_COLUMNS]
_LOG_COLUMNS = {"capital-gain", "capital-loss"}
#: Rows per sparse table: the training vocabulary of each categorical column plus the unknown/missing id 0.
ADULT_CARDINALITIES: List[int] = [9, 17, 8, 15, 7, 6, 3, 42]
_MISSING = "?"
_LABEL_COLUMN = "income"


def _read_csv(path: str) -> Tuple[List[str], List[List[str]]]:
    with open(path, newline="") as handle:
        reader = csv.reader(handle)
        header = [h.strip() for h in next(reader)]
        rows = [[cell.strip() for cell in row] for row in reader if row]
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"{path}, line {i + 2}: expected {len(header)} fields, got {len(row)}")
    return header, rows


def _label(value: str, where: str) -> float:
    value = value.rstrip(".")
    if value == ">50K":
        return 1.0
    if value == "<=50K":
        return 0.0
    raise ValueError(f"{where}: unexpected income label {value!r}")


class AdultTable:
    """The featurised Adult rows: ``ids [N, 8]`` int64, ``dense [N, 6]`` float32, ``labels [N]`` float32.

    ``vocabularies`` (per categorical column, value -> id) and the dense ``mean``/``std`` come from the
    training rows only.
    """

    def __init__(self, path: str = ADULT_CSV) -> None:
        header, rows = _read_csv(path)
        if len(rows) != ADULT_NUM_TRAIN + ADULT_NUM_TEST:
            raise ValueError(f"{path}: expected {ADULT_NUM_TRAIN + ADULT_NUM_TEST} rows, got {len(rows)}")
        missing_columns = set(ADULT_CATEGORICAL_COLUMNS + ADULT_NUMERIC_COLUMNS + [_LABEL_COLUMN]) - set(header)
        if missing_columns:
            raise ValueError(f"{path}: missing columns {sorted(missing_columns)}")
        col = {name: i for i, name in enumerate(header)}
        train_rows = rows[ADULT_NUM_TEST:]
        self.vocabularies: Dict[str, Dict[str, int]] = {}
        for name in ADULT_CATEGORICAL_COLUMNS:
            values = sorted({r[col[name]] for r in train_rows} - {_MISSING, ""})
            self.vocabularies[name] = {v: i + 1 for i, v in enumerate(values)}
        self.ids = torch.tensor(
            [[self.vocabularies[name].get(r[col[name]], 0) for name in ADULT_CATEGORICAL_COLUMNS] for r in rows],
            dtype=torch.int64,
        )
        try:
            raw = np.array([[float(r[col[name]]) for name in ADULT_NUMERIC_COLUMNS] for r in rows], dtype=np.float64)
        except ValueError as err:
            raise ValueError(f"{path}: non-numeric value in a numeric column: {err}") from None
        for j, name in enumerate(ADULT_NUMERIC_COLUMNS):
            if name in _LOG_COLUMNS:
                raw[:, j] = np.log1p(np.maximum(raw[:, j], 0.0))
        train_raw = raw[ADULT_NUM_TEST:]
        self.mean = train_raw.mean(0)
        self.std = train_raw.std(0) + 1e-8
        self.dense = torch.from_numpy(((raw - self.mean) / self.std).astype(np.float32))
        self.labels = torch.tensor(
            [_label(r[col[_LABEL_COLUMN]], f"{path}, line {i + 2}") for i, r in enumerate(rows)], dtype=torch.float32
        )

    @property
    def cardinalities(self) -> List[int]:
        """Rows per sparse table (vocabulary size + the unknown id 0)."""
        return [len(self.vocabularies[name]) + 1 for name in ADULT_CATEGORICAL_COLUMNS]

    def split(self, name: str) -> slice:
        """Row range of ``train`` or ``test`` (``val`` is ``test``)."""
        if name == "train":
            return slice(ADULT_NUM_TEST, ADULT_NUM_TEST + ADULT_NUM_TRAIN)
        if name in ("test", "val"):
            return slice(0, ADULT_NUM_TEST)
        raise ValueError(f"unknown split {name!r}; expected train, val or test")


class AdultDataset(Dataset):
    """Map-style dataset of one split's rows; ``collate`` turns a list of row indices' items into a batch."""

    def __init__(self, table: AdultTable, split: str) -> None:
        rows = table.split(split)
        self.ids, self.dense, self.labels = table.ids[rows], table.dense[rows], table.labels[rows]

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, index: int) -> int:
        return index

    def __getitems__(self, indices: List[int]) -> List[int]:
        return list(indices)

    def collate(self, indices: List[int]) -> CriteoBatch:
        index = torch.as_tensor(indices, dtype=torch.int64)
        return make_batch(self.ids[index], self.dense[index], self.labels[index], ADULT_SPARSE_FEATURES)


class AdultDataModule(LightningDataModule):
    """UCI Adult census income: 32,561 training rows, 16,281 test rows (also used for validation).

    Map-style, so Lightning adds a ``DistributedSampler`` under DDP (each rank gets its share of the rows).

    Args:
        batch_size: rows per training batch.
        eval_batch_size: rows per validation/test batch.
        shuffle: shuffle the training rows each epoch.
        num_workers: DataLoader workers.
        csv_path: the CSV file (default: the copy shipped with the package).
        pin_memory: pin batches in host memory; ``None``: when the trainer runs on a GPU.
    """

    def __init__(
        self,
        batch_size: int = 256,
        eval_batch_size: int = 4096,
        shuffle: bool = True,
        num_workers: int = 0,
        csv_path: Optional[str] = None,
        pin_memory: Optional[bool] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.csv_path = csv_path or ADULT_CSV
        self.pin_memory = pin_memory
        self._table: Optional[AdultTable] = None

    @property
    def table(self) -> AdultTable:
        if self._table is None:
            self._table = AdultTable(self.csv_path)
        return self._table

    @property
    def sparse_feature_names(self) -> List[str]:
        return list(ADULT_SPARSE_FEATURES)

    @property
    def num_dense_features(self) -> int:
        return len(ADULT_NUMERIC_COLUMNS)

    @property
    def cardinalities(self) -> List[int]:
        return self.table.cardinalities

    def setup(self, stage: Optional[str] = None) -> None:
        self.table  # noqa: B018 - load once, before the loaders

    def _loader(self, split: str) -> DataLoader:
        dataset = AdultDataset(self.table, split)
        train = split == "train"
        return DataLoader(
            dataset,
            batch_size=self.batch_size if train else self.eval_batch_size,
            shuffle=self.shuffle and train,
            collate_fn=dataset.collate,
            num_workers=self.num_workers,
            pin_memory=on_gpu(self.trainer) if self.pin_memory is None else self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")
