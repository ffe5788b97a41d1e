"""Small click logs written in the layouts users keep: TorchRec's binary Criteo (.npy per day) and Parquet."""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from lightning_persia.data import CRITEO_SPARSE_FEATURES, SyntheticCriteo

CRITEO_COLUMNS = {"label_column": "label", "dense_columns": [f"I{i + 1}" for i in range(13)],
                  "sparse_columns": {f: f"C{i + 1}" for i, f in enumerate(CRITEO_SPARSE_FEATURES)}}


@lru_cache(maxsize=1)
def _generator() -> SyntheticCriteo:
    return SyntheticCriteo(cardinality_scale=0.001)  # built once: it calibrates itself on 65,536 rows


def synthetic_rows(num_rows: int, start: int = 0):
    return _generator().rows("train", start, num_rows)


def write_torchrec_day(prefix: str, rows, sparse_dtype=np.int64) -> str:
    """The three files of one day as ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys`` writes them from
    the TSV of ``rows``: missing values are 0, dense ``log(x - min + 2)`` as float32, labels ``[N, 1]`` int32."""
    dense = np.where(rows.dense_missing, 0, rows.dense_values).astype(np.int32)
    dense -= dense.min() - 2
    np.save(f"{prefix}_dense.npy", np.log(dense, dtype=np.float32))
    np.save(f"{prefix}_sparse.npy", np.where(rows.cat_missing, 0, rows.cat_values).astype(sparse_dtype))
    np.save(f"{prefix}_labels.npy", rows.labels.astype(np.int32).reshape(-1, 1))
    return prefix


def write_parquet(path: str, rows, row_group_size: int, extra_column: bool = True) -> str:
    """``rows`` as a Parquet file with Criteo's column names (nulls for missing values) and an unused column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"label": pa.array(rows.labels.astype(np.int8))}
    for j in range(13):
        columns[f"I{j + 1}"] = pa.array(rows.dense_values[:, j], mask=rows.dense_missing[:, j])
    for j in range(26):
        columns[f"C{j + 1}"] = pa.array(rows.cat_values[:, j].astype(np.uint32), mask=rows.cat_missing[:, j])
    if extra_column:
        columns["user_agent"] = pa.array(["x"] * len(rows))
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path
