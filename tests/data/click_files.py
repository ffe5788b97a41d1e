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


def torchrec_days(directory, day_rows, contiguous: bool = True):
    """Days written by TorchRec's own tools from the synthetic TSV: ``BinaryCriteoUtils.tsv_to_npys`` (32-bit values,
    int32), then, when ``contiguous``, ``BinaryCriteoUtils.sparse_to_contiguous`` (vocabulary ids, values seen fewer
    than 3 times mapped to 1), as TorchRec's Criteo preprocessing does. Returns the day prefixes."""
    import shutil

    import pytest

    pytest.importorskip("iopath", reason="TorchRec's BinaryCriteoUtils, which writes these days as users' tools do, needs "
                        "iopath: pip install 'lightning-persia[test]' (make setup installs it)")
    from torchrec.datasets.criteo import BinaryCriteoUtils

    raw, out = directory / "npy", directory / "contiguous"
    raw.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    start, prefixes = 0, []
    for day, rows in enumerate(day_rows):
        tsv = _generator().write_tsv(str(directory / f"day_{day}.tsv"), rows, start=start)
        start += rows
        prefix = str(raw / f"day_{day}")
        BinaryCriteoUtils.tsv_to_npys(tsv, f"{prefix}_dense.npy", f"{prefix}_sparse.npy", f"{prefix}_labels.npy")
        prefixes.append(prefix)
    if not contiguous:
        return prefixes
    BinaryCriteoUtils.sparse_to_contiguous([f"{p}_sparse.npy" for p in prefixes], str(out), output_file_suffix=".npy")
    for day in range(len(day_rows)):
        for part in ("dense", "labels"):
            shutil.copy(raw / f"day_{day}_{part}.npy", out / f"day_{day}_{part}.npy")
    return [str(out / f"day_{day}") for day in range(len(day_rows))]


#: MLPerf DLRM-DCNv2's ids per row of each feature (its --multi_hot_sizes)
MLPERF_MULTI_HOT_SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


def write_multi_hot_day(prefix: str, one_hot_prefix: str, multi_hot_sizes, num_embeddings, seed: int = 0) -> str:
    """A day in MLPerf DLRM-DCNv2's multi-hot layout, made from a one-hot day the way MLPerf's
    ``materialize_synthetic_multihot_dataset.py`` makes it: per feature, each (one-hot id mod the table size) picks a
    fixed row of ``k_f`` ids, saved with ``np.savez`` as members ``0`` .. ``25`` (``int32 [N, k_f]``)."""
    import shutil

    sparse = np.load(f"{one_hot_prefix}_sparse.npy")
    rng = np.random.default_rng(seed)
    members = {}
    for f, (k, rows) in enumerate(zip(multi_hot_sizes, num_embeddings)):
        table = rng.integers(0, rows, size=(rows, k), dtype=np.int32)  # MLPerf's multi_hot_tables_l, one per feature
        members[str(f)] = table[sparse[:, f].astype(np.int64) % rows]
    np.savez(f"{prefix}_sparse_multi_hot.npz", **members)
    for part in ("dense", "labels"):
        shutil.copy(f"{one_hot_prefix}_{part}.npy", f"{prefix}_{part}.npy")
    return prefix


#: The columns TorchRec's NVTabular pipeline (torchrec/datasets/scripts/nvt) writes: label, int_0.., cat_0...
NVT_COLUMNS = {"label_column": "label", "dense_columns": [f"int_{i}" for i in range(13)],
               "sparse_columns": {f: f for f in CRITEO_SPARSE_FEATURES}, "dense_transform": "none"}


def nvtabular_table(rows):
    """``rows`` as NVTabular's Criteo workflow leaves them: dense filled, clipped at 0 and ``log1p``'d (float32),
    categoricals as frequency-ordered vocabulary ids (``Categorify``: 0 for nulls), label int32."""
    import pyarrow as pa

    columns = {"label": pa.array(rows.labels.astype(np.int32))}
    for j in range(13):
        columns[f"int_{j}"] = pa.array(np.log1p(np.clip(np.where(rows.dense_missing[:, j], 0, rows.dense_values[:, j]), 0, None)).astype(np.float32))
    for j in range(26):
        values, counts = np.unique(rows.cat_values[:, j][~rows.cat_missing[:, j]], return_counts=True)
        vocabulary = {v: i + 1 for i, v in enumerate(values[np.argsort(-counts, kind="stable")])}
        columns[f"cat_{j}"] = pa.array([0 if m else vocabulary[v] for v, m in zip(rows.cat_values[:, j], rows.cat_missing[:, j])], pa.int64())
    return pa.table(columns)


def write_nvtabular_output(directory, table, files: int = 2, row_group_size: int = 64) -> str:
    """``table`` laid out as NVTabular's ``Dataset.to_parquet`` leaves a directory: ``part_N.parquet`` beside
    ``_file_list.txt``, ``_metadata`` (the row groups' footers), ``_metadata.json`` and ``schema.pbtxt``."""
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    step = -(-table.num_rows // files)
    collector = []
    for i in range(files):
        pq.write_table(table.slice(i * step, step), directory / f"part_{i}.parquet", row_group_size=row_group_size,
                       metadata_collector=collector)
        collector[-1].set_file_path(f"part_{i}.parquet")
    pq.write_metadata(table.schema, directory / "_metadata", metadata_collector=collector)
    (directory / "_file_list.txt").write_text(f"{files}\n" + "".join(f"part_{i}.parquet\n" for i in range(files)))
    (directory / "_metadata.json").write_text('{"file_stats": []}')
    (directory / "schema.pbtxt").write_text('feature { name: "cat_0" type: INT }\n')
    return str(directory)


def write_spark_output(directory, table, partition_by=None, rows_per_file: int = 128) -> str:
    """``table`` laid out as Spark's ``df.write.parquet`` leaves it: ``part-NNNNN-<uuid>-c000.snappy.parquet``
    files (with ``partition_by``, under ``column=value`` folders), their hidden ``.crc`` files and ``_SUCCESS``."""
    import pyarrow.dataset as ds

    ds.write_dataset(table, directory, format="parquet", basename_template="part-{i}-5f1c9a2e-c000.snappy.parquet",
                     partitioning=partition_by, partitioning_flavor="hive" if partition_by else None,
                     max_rows_per_file=rows_per_file, max_rows_per_group=rows_per_file // 2, existing_data_behavior="overwrite_or_ignore")
    for path in list(directory.rglob("*.parquet")):
        number, rest = path.name[len("part-"):].split("-", 1)
        path = path.rename(path.parent / f"part-{int(number):05d}-{rest}")  # Spark's five digits
        (path.parent / f".{path.name}.crc").write_bytes(b"crc")
    (directory / "_SUCCESS").write_bytes(b"")
    return str(directory)
