"""Click logs in Parquet files, columns named in the config, streamed row group by row group (``pyarrow``).

Each row is one example: a label column (0/1: integers, floats or booleans), dense columns (numbers) and sparse
columns (one integer per row in ``[0, 2**32)``: a categorical value or an index). Which column is what is given by
name, so the files may hold more columns than these, in any order:

* sparse column ``c`` of feature ``f`` (``sparse_columns: {f: c}``) becomes the ids of the KJT key ``f``, hashed
  by :func:`~lightning_persia.data.batch.hash_categorical` (a null is the feature's "missing" id);
* dense columns, in the order given: null -> 0, then ``log(1 + max(x, 0))`` (``dense_transform: log1p``, the
  Criteo transform) or as they are (``none``).

The row groups of all files, in order, are dealt to the ranks and, within a rank, to its DataLoader workers in
turn (:func:`~lightning_persia.data._sharding.deal_pieces`); each reader streams its row groups and cuts them into
batches. The files' schemas are checked when the dataset is built (their footers only).
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from lightning_persia.data._batching import BatchStream, Rows, cut_batches
from lightning_persia.data._files import expand_files
from lightning_persia.data._loader import FileSplitDataModule
from lightning_persia.data._sharding import deal_pieces
from lightning_persia.data.batch import CriteoBatch, hash_categorical, transform_dense
from lightning_persia.data.transform import FeatureTransform

DENSE_TRANSFORMS = ("log1p", "none")
_UINT32 = 1 << 32


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading Parquet needs pyarrow: pip install 'lightning-persia[parquet]'") from None
    return pq


class ParquetDataset(BatchStream):
    """Streams :class:`~lightning_persia.data.CriteoBatch` es from Parquet files, this reader's share of the row groups.

    Args:
        files: Parquet files (patterns allowed), read in order.
        label_column: the 0/1 label's column.
        dense_columns: the dense features' columns, in the order of the dense tensor.
        sparse_columns: KJT key -> column, in the order of the KJT's keys.
        dense_transform: ``log1p`` (nulls -> 0, then ``log(1 + max(x, 0))``) or ``none`` (nulls -> 0).
        batch_size: rows per batch.
        drop_last: drop each reader's last, incomplete batch.
        rank: trainer rank; ``None`` reads it from ``torch.distributed`` (or 0 when not initialised).
        world_size: number of trainer ranks; ``None`` as ``rank``.

    Raises ``FileNotFoundError`` or ``ValueError`` naming the file (and the column) that is missing or not of
    the types above.
    """

    def __init__(
        self,
        files: Sequence[str],
        label_column: str,
        dense_columns: Sequence[str],
        sparse_columns: Dict[str, str],
        dense_transform: str = "log1p",
        batch_size: int = 4096,
        drop_last: bool = False,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ) -> None:
        super().__init__(batch_size, drop_last, rank, world_size)
        if dense_transform not in DENSE_TRANSFORMS:
            raise ValueError(f"dense_transform must be one of {DENSE_TRANSFORMS}, got {dense_transform!r}")
        if not sparse_columns:
            raise ValueError("sparse_columns maps no feature to a column")
        self.files = expand_files(files, "Parquet file")
        self.label_column, self.dense_columns = label_column, list(dense_columns)
        self.feature_names, self.sparse_columns = list(sparse_columns), list(sparse_columns.values())
        self.dense_transform = dense_transform
        #: ``(file index, row group, rows, first row in the file)`` of every row group, in order
        self.row_groups: List[Tuple[int, int, int, int]] = []
        pq = _pyarrow()
        for index, path in enumerate(self.files):
            try:
                metadata = pq.ParquetFile(path).metadata
            except Exception as err:  # pyarrow raises its own kinds for a file that is not Parquet
                raise ValueError(f"{path} is not a readable Parquet file: {err}") from None
            self._check_schema(path, metadata.schema.to_arrow_schema())
            first = 0
            for group in range(metadata.num_row_groups):
                rows = metadata.row_group(group).num_rows
                self.row_groups.append((index, group, rows, first))
                first += rows

    def _check_schema(self, path: str, schema: Any) -> None:
        import pyarrow as pa

        wanted = [(self.label_column, "the label", (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean))]
        wanted += [(c, f"dense feature {i}", (pa.types.is_integer, pa.types.is_floating)) for i, c in enumerate(self.dense_columns)]
        wanted += [(c, f"sparse feature {f!r}", (pa.types.is_integer,)) for f, c in zip(self.feature_names, self.sparse_columns)]
        for column, role, kinds in wanted:
            index = schema.get_field_index(column)
            if index < 0:
                names = schema.names
                listed = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
                raise ValueError(f"{path} has no column {column!r} ({role}); its columns: {listed}")
            kind = schema.field(index).type
            if not any(accepts(kind) for accepts in kinds):
                expected = "integers (one id per row)" if len(kinds) == 1 else "numbers"
                raise ValueError(f"{path}: column {column!r} ({role}) holds {kind}; expected {expected}")

    @property
    def num_rows(self) -> int:
        return sum(rows for _, _, rows, _ in self.row_groups)

    def __iter__(self) -> Iterator[CriteoBatch]:
        mine, limit = deal_pieces([g[2] for g in self.row_groups], self.batch_size, self.drop_last, self.rank, self.world_size)
        return cut_batches(self._chunks(mine), self.batch_size, limit, self.drop_last, self.feature_names)

    def _chunks(self, groups: List[int]) -> Iterator[Rows]:
        pq = _pyarrow()
        columns = list(dict.fromkeys([self.label_column, *self.dense_columns, *self.sparse_columns]))
        opened: Dict[int, Any] = {}
        for g in groups:
            index, group, _, first = self.row_groups[g]
            if index not in opened:
                opened.clear()  # one file open at a time: the groups of a file come together
                opened[index] = pq.ParquetFile(self.files[index])
            row = first
            for record in opened[index].iter_batches(batch_size=self.batch_size, row_groups=[group], columns=columns,
                                                      use_threads=False):
                yield self._featurise(record, self.files[index], row)
                row += record.num_rows

    def _featurise(self, record: Any, path: str, first_row: int) -> Rows:
        def numbers(column: str) -> Tuple[np.ndarray, np.ndarray]:
            values = record.column(column)
            return values.fill_null(0).to_numpy(zero_copy_only=False), values.is_null().to_numpy(zero_copy_only=False)

        labels, missing = numbers(self.label_column)
        bad = missing | ((labels != 0) & (labels != 1))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{path}, row {first_row + row}, column {self.label_column!r}: label "
                             f"{'null' if missing[row] else labels[row]} is not 0 or 1")
        sparse = [numbers(column) for column in self.sparse_columns]
        values = np.stack([v.astype(np.int64) for v, _ in sparse], axis=1)
        for column, (raw, _) in zip(self.sparse_columns, sparse):
            out = (raw < 0) | (raw >= _UINT32)
            if out.any():
                row = int(np.flatnonzero(out)[0])
                raise ValueError(f"{path}, row {first_row + row}, column {column!r}: {raw[row]} is not in [0, 2**32) "
                                 "(hash larger ids into that range first)")
        ids = hash_categorical(torch.from_numpy(values), torch.from_numpy(np.stack([m for _, m in sparse], axis=1)))
        if self.dense_columns:
            dense_parts = [numbers(column) for column in self.dense_columns]
            dense = torch.from_numpy(np.stack([v.astype(np.float64) for v, _ in dense_parts], axis=1))
            missing_dense = torch.from_numpy(np.stack([m for _, m in dense_parts], axis=1))
            dense = transform_dense(dense, missing_dense) if self.dense_transform == "log1p" else dense.float()
        else:
            dense = torch.zeros(record.num_rows, 0)
        return ids, dense, torch.from_numpy(labels.astype(np.float32))


class ParquetDataModule(FileSplitDataModule):
    """Parquet click logs as a streaming LightningDataModule of :class:`~lightning_persia.data.CriteoBatch` es.

    Row groups are dealt to the ranks and to the DataLoader workers of each rank; with several ranks each runs as
    many batches (a rank with more stops early). Give files many row groups (at least ranks x workers) for an even
    share.

    Args:
        train_files: training files (patterns allowed), read in order.
        label_column: the 0/1 label's column.
        dense_columns: the dense features' columns, in the model's order.
        sparse_columns: KJT key (the model's feature name) -> column.
        val_files: validation files; none means no validation loop.
        test_files: test files; none means ``trainer.test`` has nothing to run.
        dense_transform: ``log1p`` (the Criteo transform) or ``none``.
        batch_size: rows per training batch.
        eval_batch_size: rows per validation/test batch (default: ``batch_size``).
        num_workers: DataLoader worker processes per rank, each reading its share of the row groups; ``None``:
            half the rank's share of the cores less one, at most 8 (0 on 2 cores). Each worker cuts its own row
            groups into batches, so batches hold other rows with another worker count: set it to compare runs.
        drop_last: drop each reader's last incomplete training batch.
        pin_memory: pin batches in host memory; ``None``: when the trainer runs on a GPU.
    """

    def __init__(
        self,
        train_files: List[str],
        label_column: str,
        dense_columns: List[str],
        sparse_columns: Dict[str, str],
        val_files: Optional[List[str]] = None,
        test_files: Optional[List[str]] = None,
        dense_transform: str = "log1p",
        batch_size: int = 4096,
        eval_batch_size: Optional[int] = None,
        num_workers: Optional[int] = None,
        drop_last: bool = False,
        pin_memory: Optional[bool] = None,
    ) -> None:
        super().__init__(train_files, val_files, test_files, batch_size, eval_batch_size, drop_last, num_workers, pin_memory)
        self.save_hyperparameters()
        self.columns = {"label_column": label_column, "dense_columns": list(dense_columns),
                        "sparse_columns": dict(sparse_columns), "dense_transform": dense_transform}

    @property
    def sparse_feature_names(self) -> List[str]:
        return list(self.columns["sparse_columns"])

    @property
    def num_dense_features(self) -> int:
        return len(self.columns["dense_columns"])

    def feature_transform(self) -> FeatureTransform:
        """The columns' values: integer categorical values hashed (a null is the feature's missing id), the dense
        columns through ``dense_transform``."""
        return FeatureTransform(tuple(self.sparse_feature_names), tuple(self.columns["dense_columns"]), ids="hash",
                                dense=self.columns["dense_transform"])

    def read_files(self, files: List[str], batch_size: int, drop_last: bool) -> ParquetDataset:
        return ParquetDataset(files, **self.columns, batch_size=batch_size, drop_last=drop_last)
