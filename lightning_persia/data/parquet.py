"""Click logs in Parquet datasets, columns named in the config, streamed row group by row group (``pyarrow.dataset``).

A source is a file, a directory (Spark's or NVTabular's output, a hive-partitioned folder: its ``.parquet`` files,
recursively, ``key=value`` folders giving columns) or a pattern, on the local disk or any filesystem pyarrow or fsspec
opens (``file://``, ``s3://``, ``gs://``, ``hdfs://``, ``memory://``...). Each row is one example: a label column
(0/1: integers, floats or booleans), dense columns (numbers) and sparse columns. Which column is what is given by
name, so the files may hold more columns than these, in any order:

* sparse column ``c`` of feature ``f`` (``sparse_columns: {f: c}``) becomes the ids of the KJT key ``f``: any int64,
  one per row, or a ``list<int>`` column (Merlin's multi-hot: a bag of ids per row, pooled by the model's
  ``EmbeddingBagCollection``); ``ids: raw`` (the default: vocabulary ids, as NVTabular's ``Categorify`` writes them)
  uses them as they are, ``ids: hash`` hashes them per feature (:func:`~lightning_persia.data.batch.hash_categorical`),
  and takes string columns too, plain or dictionary-encoded (pandas' categoricals: each string's 8-byte blake2b, then
  hashed); see :mod:`lightning_persia.data.transform` for nulls;
* dense columns, in the order given: null -> 0, then ``log(1 + max(x, 0))`` (``dense_transform: log1p``, the
  Criteo transform) or as they are (``none``: NVTabular's output, already ``log``'d).

The row groups of all files, in order, are dealt to the ranks and, within a rank, to its DataLoader workers in
turn (:func:`~lightning_persia.data._sharding.deal_pieces`); each reader streams its row groups and cuts them into
batches. The files' schemas are checked when the dataset is built (their footers only).
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from lightning_persia.data._batching import Bags, BatchStream, Rows, cut_batches, sparse_column, sparse_columns
from lightning_persia.data._dataset_files import _pyarrow, parquet_datasets
from lightning_persia.data._loader import FileSplitDataModule
from lightning_persia.data._sharding import deal_pieces, rank_batches
from lightning_persia.data.batch import CriteoBatch, string_key
from lightning_persia.data.transform import DataTransform, IdsSetting, resolve_ids


def _integers(kind: Any) -> bool:
    pa = _pyarrow()[0]
    return pa.types.is_integer(kind) or (pa.types.is_dictionary(kind) and pa.types.is_integer(kind.value_type))


def _strings(kind: Any) -> bool:
    pa = _pyarrow()[0]
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _string_keys(array: Any) -> Tuple[np.ndarray, np.ndarray]:
    """int64 keys of a string column (plain or dictionary-encoded: pandas' categoricals), each distinct string hashed
    once (blake2b, 8 bytes), and its nulls: what ``ids: hash`` then hashes per feature."""
    pa = _pyarrow()[0]
    encoded = array if pa.types.is_dictionary(array.type) else array.dictionary_encode()
    keys = np.array([string_key(v) for v in encoded.dictionary.to_pylist()] or [0], dtype=np.int64)
    indices = encoded.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    return keys[indices], array.is_null().to_numpy(zero_copy_only=False)


def _bags(kind: Any) -> bool:
    pa = _pyarrow()[0]
    lists = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    return lists and pa.types.is_integer(kind.value_type)


def _numbers(kind: Any) -> bool:
    pa = _pyarrow()[0]
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def parquet_transform(features: Sequence[str], ids: IdsSetting, dense_columns: Sequence[str], dense_transform: str) -> DataTransform:
    """The :class:`DataTransform` of Parquet columns: ids raw unless said otherwise, text values strings (a string
    column's values are keyed, then hashed)."""
    return DataTransform(tuple(features), resolve_ids(ids, features, "raw"), tuple(dense_columns), dense_transform, text_ids="string")


class ParquetDataset(BatchStream):
    """Streams :class:`~lightning_persia.data.CriteoBatch` es from Parquet datasets, this reader's share of the row groups.

    Args:
        files: Parquet sources (files, directories, patterns, URIs), read in order.
        label_column: the 0/1 label's column.
        dense_columns: the dense features' columns, in the order of the dense tensor.
        sparse_columns: KJT key -> column, in the order of the KJT's keys.
        dense_transform: ``log1p`` (nulls -> 0, then ``log(1 + max(x, 0))``) or ``none`` (nulls -> 0).
        batch_size: rows per batch.
        drop_last: drop each reader's last, incomplete batch.
        rank: trainer rank; ``None`` reads it from ``torch.distributed`` (or 0 when not initialised).
        world_size: number of trainer ranks; ``None`` as ``rank``.
        ids: ``raw`` or ``hash``, for every feature or per KJT key (``{country: hash}``).

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
        ids: IdsSetting = "raw",
    ) -> None:
        super().__init__(batch_size, drop_last, rank, world_size)
        if not sparse_columns:
            raise ValueError("sparse_columns maps no feature to a column")
        self.label_column, self.dense_columns = label_column, list(dense_columns)
        self.feature_names, self.sparse_columns = list(sparse_columns), list(sparse_columns.values())
        self.transform = parquet_transform(self.feature_names, ids, self.dense_columns, dense_transform)
        #: ``(fragment index, row group, rows, first row in the file)`` of every row group, in order
        self.row_groups: List[Tuple[int, int, int, int]] = []
        self._fragments: List[Any] = []  # pyarrow's ParquetFileFragment: picklable, reopened by each reader
        self._schemas: List[Any] = []  # each dataset's schema (the files' columns and the partition columns)
        self._fragment_schema: List[int] = []
        for dataset in parquet_datasets(files):
            self._schemas.append(dataset.schema)
            for fragment in dataset.get_fragments():
                try:
                    metadata = fragment.metadata
                    schema = fragment.physical_schema
                except Exception as err:  # pyarrow raises its own kinds for a file that is not Parquet
                    raise ValueError(f"{fragment.path} is not a readable Parquet file: {err}") from None
                partitions = [f for f in dataset.schema if f.name not in schema.names]
                self._check_schema(fragment.path, schema, partitions)
                first = 0
                for group in range(metadata.num_row_groups):
                    rows = metadata.row_group(group).num_rows
                    self.row_groups.append((len(self._fragments), group, rows, first))
                    first += rows
                self._fragments.append(fragment)
                self._fragment_schema.append(len(self._schemas) - 1)

    @property
    def files(self) -> List[str]:
        """The paths of the Parquet files read, in order."""
        return [fragment.path for fragment in self._fragments]

    def _check_schema(self, path: str, schema: Any, partitions: List[Any]) -> None:
        fields = {f.name: f.type for f in schema}
        fields.update({f.name: f.type for f in partitions})
        wanted = [(self.label_column, "the label", _numbers, "numbers")]
        wanted += [(c, f"dense feature {i}", _numbers, "numbers") for i, c in enumerate(self.dense_columns)]
        for f, c, mode in zip(self.feature_names, self.sparse_columns, self.transform.ids):
            if mode == "hash":
                wanted.append((c, f"sparse feature {f!r}", lambda k: _integers(k) or _bags(k) or _strings(k),
                               "integers (one id per row), lists of integers or strings"))
            else:
                wanted.append((c, f"sparse feature {f!r}", lambda k: _integers(k) or _bags(k),
                               "integers (one id per row) or lists of integers: ids raw takes the ids as stored (ids hash "
                               "takes strings)"))
        pa = _pyarrow()[0]
        for column, role, accepts, expected in wanted:
            if column not in fields:
                names = list(fields)
                listed = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
                raise ValueError(f"{path} has no column {column!r} ({role}); its columns: {listed}")
            kind = fields[column]
            if not (accepts(kind) or (role == "the label" and pa.types.is_boolean(kind))):
                raise ValueError(f"{path}: column {column!r} ({role}) holds {kind}; expected {expected}")

    @property
    def num_rows(self) -> int:
        return sum(rows for _, _, rows, _ in self.row_groups)

    def __len__(self) -> int:
        """Batches this rank yields: each reader cuts its own row groups, so the count depends on how many DataLoader
        workers read it (:attr:`num_workers`, which the data module sets to its loader's)."""
        return rank_batches([g[2] for g in self.row_groups], self.batch_size, self.drop_last, self.rank, self.world_size,
                            self.num_workers)

    def __iter__(self) -> Iterator[CriteoBatch]:
        mine, limit = deal_pieces([g[2] for g in self.row_groups], self.batch_size, self.drop_last, self.rank, self.world_size)
        return cut_batches(self._chunks(mine), self.batch_size, limit, self.drop_last, self.feature_names)

    def _chunks(self, groups: List[int]) -> Iterator[Rows]:
        columns = list(dict.fromkeys([self.label_column, *self.dense_columns, *self.sparse_columns]))
        for g in groups:
            index, group, _, first = self.row_groups[g]
            fragment = self._fragments[index]
            row = first
            for record in fragment.subset(row_group_ids=[group]).to_batches(
                schema=self._schemas[self._fragment_schema[index]], columns=columns, batch_size=self.batch_size, use_threads=False,
            ):
                yield self._featurise(record, fragment.path, row)
                row += record.num_rows

    def _featurise(self, record: Any, path: str, first_row: int) -> Rows:
        pa = _pyarrow()[0]

        def column(name: str) -> Any:
            values = record.column(name)
            values = values.dictionary_decode() if pa.types.is_dictionary(values.type) else values
            return values.cast(pa.int8()) if pa.types.is_boolean(values.type) else values

        def numbers(name: str) -> Tuple[np.ndarray, np.ndarray]:
            values = column(name)
            return values.fill_null(0).to_numpy(zero_copy_only=False), values.is_null().to_numpy(zero_copy_only=False)

        labels, missing = numbers(self.label_column)
        bad = missing | ((labels != 0) & (labels != 1))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{path}, row {first_row + row}, column {self.label_column!r}: label "
                             f"{'null' if missing[row] else labels[row]} is not 0 or 1")
        n = record.num_rows
        if any(_bags(column(c).type) for c in self.sparse_columns):
            sparse = self._bags([column(c) for c in self.sparse_columns], path, first_row)
        else:
            parts = [_string_keys(record.column(c)) if _strings(record.column(c).type) else numbers(c) for c in self.sparse_columns]
            sparse = sparse_columns(self.transform, torch.from_numpy(np.stack([v.astype(np.int64) for v, _ in parts], axis=1)),
                                    torch.from_numpy(np.stack([m for _, m in parts], axis=1)))
        if self.dense_columns:
            dense_parts = [numbers(c) for c in self.dense_columns]
            dense = self.transform.dense(torch.from_numpy(np.stack([v.astype(np.float64) for v, _ in dense_parts], axis=1)),
                                         torch.from_numpy(np.stack([m for _, m in dense_parts], axis=1)))
        else:
            dense = torch.zeros(n, 0)
        return sparse, dense, torch.from_numpy(labels.astype(np.float32))

    def _bags(self, arrays: List[Any], path: str, first_row: int) -> Bags:
        """Sparse columns some of which are lists (a bag per row; a null list is an empty bag)."""
        import pyarrow.compute as pc

        values, lengths = [], []
        for f, (name, array) in enumerate(zip(self.sparse_columns, arrays)):
            if _bags(array.type):
                flat = pc.list_flatten(array)
                if flat.null_count:
                    row = pc.list_parent_indices(array)[int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])]
                    raise ValueError(f"{path}, row {first_row + row.as_py()}, column {name!r}: a list holds a null id")
                ids = torch.from_numpy(flat.to_numpy(zero_copy_only=False).astype(np.int64))
                values.append(self.transform.feature_ids(f, ids))
                lengths.append(torch.from_numpy(pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int32)))
            else:
                keys, missing = _string_keys(array) if _strings(array.type) else (
                    array.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64), array.is_null().to_numpy(zero_copy_only=False))
                ids, length = sparse_column(self.transform, f, torch.from_numpy(keys), torch.from_numpy(missing))
                values.append(ids)
                lengths.append(length)
        return Bags(values, torch.stack(lengths))


class ParquetDataModule(FileSplitDataModule):
    """Parquet click logs as a streaming LightningDataModule of :class:`~lightning_persia.data.CriteoBatch` es.

    Row groups are dealt to the ranks and to the DataLoader workers of each rank; with several ranks each runs as
    many batches (a rank with more stops early). Give files many row groups (at least ranks x workers) for an even
    share. Each worker cuts its own row groups into batches, so batches hold other rows with another worker count:
    set ``num_workers`` to compare runs.

    Args:
        label_column: the 0/1 label's column.
        dense_columns: the dense features' columns, in the model's order.
        sparse_columns: KJT key (the model's feature name) -> column (integers, or lists of integers: multi-hot).
        dense_transform: ``log1p`` (the Criteo transform) or ``none`` (values already scaled, as NVTabular writes them).
        ids: ``raw`` (the default: the stored integers are the ids) or ``hash``, for every feature or per KJT key
            (``{country: hash}``); see :mod:`lightning_persia.data.transform`.
        **kwargs: :class:`~lightning_persia.data._loader.FileSplitDataModule`'s: ``train_files`` (files,
            directories, patterns, URIs), ``val_files``, ``test_files``, ``batch_size``, ``eval_batch_size``,
            ``drop_last``, ``num_workers``, ``pin_memory``.
    """

    def __init__(
        self,
        label_column: str,
        dense_columns: List[str],
        sparse_columns: Dict[str, str],
        dense_transform: str = "log1p",
        ids: IdsSetting = "raw",
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()
        #: the ``ids`` setting (:attr:`transform` gives each feature's mode)
        self.ids = ids
        self.columns = {"label_column": label_column, "dense_columns": list(dense_columns),
                        "sparse_columns": dict(sparse_columns), "dense_transform": dense_transform}
        #: what the batches are made of: each feature's id mode, the dense columns and their transform
        self.transform = parquet_transform(list(sparse_columns), ids, dense_columns, dense_transform)

    @property
    def sparse_feature_names(self) -> List[str]:
        return list(self.columns["sparse_columns"])

    @property
    def num_dense_features(self) -> int:
        return len(self.columns["dense_columns"])

    def read_files(self, files: List[str], batch_size: int, drop_last: bool) -> ParquetDataset:
        return ParquetDataset(files, **self.columns, batch_size=batch_size, drop_last=drop_last, ids=self.ids)
