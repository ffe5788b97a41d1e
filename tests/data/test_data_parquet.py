"""Parquet click logs: columns by name, nulls, row groups dealt to ranks and workers, errors naming file and column."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click_files import CRITEO_COLUMNS, synthetic_rows, write_parquet
from torch.utils.data import DataLoader

from lightning_persia.data import CRITEO_SPARSE_FEATURES, ParquetDataModule, ParquetDataset, SyntheticCriteo, hash_categorical


@pytest.fixture
def files(tmp_path):
    """Rows 0..299 and 300..499 of the synthetic stream, in row groups of 40."""
    return [write_parquet(str(tmp_path / "part-0.parquet"), synthetic_rows(300), 40),
            write_parquet(str(tmp_path / "part-1.parquet"), synthetic_rows(200, start=300), 40)]


def _dataset(files, **kwargs):
    return ParquetDataset(files, **CRITEO_COLUMNS, **kwargs)


def test_hashed_batches_are_the_ones_of_the_synthetic_stream(files):
    """ids: hash: same rows, same featurisation (nulls are missing values) as the generator's own batches."""
    batches = list(_dataset(files, batch_size=100, rank=0, world_size=1, ids="hash"))
    assert [b.batch_size for b in batches] == [100] * 5
    expected = SyntheticCriteo.to_batch(synthetic_rows(500))
    assert batches[0].sparse_features.keys() == CRITEO_SPARSE_FEATURES
    assert torch.equal(torch.cat([b.sparse_ids() for b in batches]), expected.sparse_ids())
    torch.testing.assert_close(torch.cat([b.dense_features for b in batches]), expected.dense_features)
    assert torch.equal(torch.cat([b.labels for b in batches]), expected.labels)


def test_columns_are_mapped_by_name(files):
    (batch, *_) = ParquetDataset(files, label_column="label", dense_columns=["I2", "I1"], dense_transform="none",
                                 sparse_columns={"country": "C3", "device": "C1"}, batch_size=8, ids="hash")
    rows = synthetic_rows(8)
    assert batch.sparse_features.keys() == ["country", "device"]
    assert batch.dense_features.tolist() == rows.dense_values[:, [1, 0]].astype(np.float32).tolist()
    picked = torch.from_numpy(rows.cat_values[:, [2, 0]]), torch.from_numpy(rows.cat_missing[:, [2, 0]])
    assert torch.equal(batch.sparse_ids(), hash_categorical(*picked))  # feature f's ids: hashed as the KJT's f-th key


@pytest.mark.parametrize("world_size, num_workers", [(2, 1), (3, 2)])
def test_row_groups_are_dealt_to_ranks_and_workers(files, world_size, num_workers):
    """Every row once at most; every rank as many batches; 13 row groups of 40 (or 20) rows."""
    rank_batches = []
    for rank in range(world_size):
        dataset = _dataset(files, batch_size=30, rank=rank, world_size=world_size)
        rank_batches.append(list(DataLoader(dataset, batch_size=None, num_workers=num_workers)))
    assert len({len(batches) for batches in rank_batches}) == 1
    seen = torch.cat([b.labels.unsqueeze(1) + b.dense_features for batches in rank_batches for b in batches])
    assert len(torch.unique(seen, dim=0)) == len(seen) > 300  # synthetic rows are distinct (their dense values too)


def test_a_worker_reads_only_its_row_groups(files):
    groups = [g for g, _ in enumerate(_dataset(files).row_groups)]
    assert len(groups) == 13  # 8 groups of 40 rows (7 full, one of 20) and 5 (40 x 5)
    dataset = _dataset(files, batch_size=1000, rank=1, world_size=2)
    (batch,) = list(dataset)
    assert batch.batch_size == sum(rows for g, (_, _, rows, _) in enumerate(dataset.row_groups) if g % 2 == 1)


def test_missing_column_names_file_and_column(files, tmp_path):
    columns = dict(CRITEO_COLUMNS, sparse_columns={**CRITEO_COLUMNS["sparse_columns"], "cat_26": "C27"})
    with pytest.raises(ValueError, match=r"part-0\.parquet has no column 'C27' \(sparse feature 'cat_26'\); its columns: label, I1"):
        ParquetDataset(files, **columns)
    with pytest.raises(FileNotFoundError, match=r"Parquet file or directory not found: .*part-9\.parquet"):
        _dataset([str(tmp_path / "part-9.parquet")])


def test_wrong_column_type_names_file_and_column(files):
    with pytest.raises(ValueError, match=r"part-0\.parquet: column 'user_agent' \(sparse feature 'ua'\) holds string; expected integers"):
        ParquetDataset(files, label_column="label", dense_columns=[], sparse_columns={"ua": "user_agent"})


def test_bad_values_name_file_row_and_column(tmp_path):
    table = pa.table({"y": pa.array([0, 1, None, 1]), "c": pa.array([1, 2, 3, 4], pa.int64())})
    pq.write_table(table, tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"a\.parquet, row 2, column 'y': label null is not 0 or 1"):
        list(ParquetDataset([str(tmp_path / "a.parquet")], label_column="y", dense_columns=[], sparse_columns={"c": "c"}))
    pq.write_table(pa.table({"y": [0, 1], "c": pa.array([[5], [6, None]], pa.list_(pa.int64()))}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet, row 1, column 'c': a list holds a null id"):
        list(ParquetDataset([str(tmp_path / "b.parquet")], label_column="y", dense_columns=[], sparse_columns={"c": "c"}))
    (tmp_path / "c.parquet").write_text("label,c\n1,2\n")
    with pytest.raises(ValueError, match=r"c\.parquet is not a readable Parquet file"):
        ParquetDataset([str(tmp_path / "c.parquet")], label_column="y", dense_columns=[], sparse_columns={"c": "c"})


def test_datamodule(files):
    module = ParquetDataModule(train_files=[files[0].replace("part-0", "part-*")], val_files=files[1:], batch_size=64,
                               num_workers=0, **CRITEO_COLUMNS)
    assert module.sparse_feature_names == CRITEO_SPARSE_FEATURES and module.num_dense_features == 13
    assert sum(b.batch_size for b in module.train_dataloader()) == 500
    assert sum(b.batch_size for b in module.val_dataloader()) == 200
    assert module.test_dataloader() == []
