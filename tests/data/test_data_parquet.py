"""Parquet click logs: columns by name, nulls, row groups dealt to ranks and workers, errors naming file and column."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click_files import (
    CRITEO_COLUMNS,
    NVT_COLUMNS,
    nvtabular_table,
    synthetic_rows,
    write_nvtabular_output,
    write_parquet,
    write_spark_output,
)
from torch.utils.data import DataLoader

from lightning_persia.data import (
    CRITEO_SPARSE_FEATURES,
    ParquetDataModule,
    ParquetDataset,
    SyntheticCriteo,
    hash_categorical,
    hash_feature_ids,
)


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
        dataset.num_workers = num_workers
        rank_batches.append(list(DataLoader(dataset, batch_size=None, num_workers=num_workers)))
        assert len(dataset) == len(rank_batches[-1])  # what the rank's workers yield together
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


def _read(sources, columns, **kwargs):
    batches = list(ParquetDataset(sources, **columns, batch_size=kwargs.pop("batch_size", 1000), **kwargs))
    return batches


def test_an_nvtabular_output_directory_reads_with_its_column_names(tmp_path):
    """TorchRec's NVTabular pipeline's names (label, int_*, cat_*), its directory (_metadata, schema.pbtxt beside the
    parts), vocabulary ids used as they are, dense values as NVTabular left them."""
    table = nvtabular_table(synthetic_rows(300))
    directory = write_nvtabular_output(tmp_path / "train", table)
    dataset = ParquetDataset([directory], **NVT_COLUMNS, batch_size=100)
    assert [p.rsplit("/", 1)[1] for p in dataset.files] == ["part_0.parquet", "part_1.parquet"]
    batches = list(dataset)
    stored = np.stack([table.column(f"cat_{j}").to_numpy() for j in range(26)], axis=1)
    assert torch.equal(torch.cat([b.sparse_ids() for b in batches]), torch.from_numpy(stored))
    dense = np.stack([table.column(f"int_{j}").to_numpy() for j in range(13)], axis=1)
    assert torch.equal(torch.cat([b.dense_features for b in batches]), torch.from_numpy(dense))
    assert dataset.transform.raw_features == tuple(CRITEO_SPARSE_FEATURES) and dataset.transform.dense_transform == "none"


def _spark_table(num_rows: int):
    """A Spark-shaped table: a row number, a day to partition by, Spark's signed xxhash64 ids (negative, >= 2**32)."""
    rng = np.random.default_rng(0)
    hashed = rng.integers(-(1 << 63), (1 << 63) - 1, size=num_rows, dtype=np.int64)
    hashed[:3] = [-1, 1 << 40, -(1 << 63)]
    return pa.table({"row": pa.array(np.arange(num_rows, dtype=np.int32)), "day": pa.array(np.arange(num_rows) % 3),
                     "clicked": pa.array(rng.integers(0, 2, num_rows).astype(bool)), "user": pa.array(hashed)})


SPARK_COLUMNS = {"label_column": "clicked", "dense_columns": ["row"], "sparse_columns": {"user": "user", "day": "day"},
                 "dense_transform": "none"}


def test_a_hive_partitioned_spark_folder_with_signed_64_bit_ids(tmp_path):
    """day=N/ folders, _SUCCESS and .crc files beside the parts; the partition column reads as a column; any int64."""
    table = _spark_table(600)
    directory = write_spark_output(tmp_path / "clicks", table, partition_by=["day"])
    assert sorted(p.name for p in (tmp_path / "clicks").iterdir()) == ["_SUCCESS", "day=0", "day=1", "day=2"]
    batches = _read([directory], SPARK_COLUMNS, batch_size=128)
    rows = torch.cat([b.dense_features[:, 0] for b in batches]).long()
    assert sorted(rows.tolist()) == list(range(600))  # every row once
    ids = torch.cat([b.sparse_features["user"].values() for b in batches])
    expected = torch.from_numpy(table.column("user").to_numpy())[rows]
    assert torch.equal(ids, expected) and bool((ids < 0).any()) and bool((ids >= 1 << 32).any())  # raw: as they are
    assert torch.equal(torch.cat([b.sparse_features["day"].values() for b in batches]), rows % 3)
    hashed = _read([directory], SPARK_COLUMNS, batch_size=128, ids={"user": "hash"})
    assert torch.equal(torch.cat([b.sparse_features["user"].values() for b in hashed]),
                       hash_feature_ids(expected, 0))  # the KJT's first key


def test_uris_of_any_filesystem_and_patterns_read_the_same_rows(tmp_path):
    """file:// URIs, an fsspec in-memory filesystem (memory://), a pattern over folders: the same batches."""
    import fsspec

    table = _spark_table(300)
    write_spark_output(tmp_path / "clicks", table)
    local = _read([str(tmp_path / "clicks")], SPARK_COLUMNS)
    memory = fsspec.filesystem("memory")
    for path in (tmp_path / "clicks").glob("*.parquet"):
        memory.pipe(f"/bucket/clicks/{path.name}", path.read_bytes())
    for sources in ([f"file://{tmp_path / 'clicks'}"], ["memory://bucket/clicks"], ["memory://bucket/clicks/part-*.parquet"],
                    [str(tmp_path / "click*" / "part-0000[0-9]-*.parquet")]):
        got = _read(sources, SPARK_COLUMNS)
        assert [b.batch_size for b in got] == [b.batch_size for b in local]
        assert all(torch.equal(a.sparse_features.values(), b.sparse_features.values()) for a, b in zip(got, local)), sources
    with pytest.raises(FileNotFoundError, match=r"Parquet file or directory not found: 'memory://bucket/none'"):
        _read(["memory://bucket/none"], SPARK_COLUMNS)
    with pytest.raises(FileNotFoundError, match=r"no file matches 'memory://bucket/clicks/\*\.csv'"):
        _read(["memory://bucket/clicks/*.csv"], SPARK_COLUMNS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no Parquet file \(.parquet, .parq, .pq\) under"):
        _read([str(tmp_path / "empty")], SPARK_COLUMNS)


def test_dictionary_encoded_string_columns_hash_and_workers_read_a_directory(tmp_path):
    """pandas' categoricals (dictionary<string>) and plain strings: each string one key, hashed per feature (ids:
    hash; ids: raw is refused, naming the column); DataLoader workers reopen the directory's fragments."""
    table = _spark_table(400)
    countries = pa.array([["fr", "de", None, "us"][i % 4] for i in range(400)])
    table = table.append_column("country", countries.dictionary_encode()).append_column("city", countries)
    (tmp_path / "clicks").mkdir()
    for i in range(4):
        pq.write_table(table.slice(100 * i, 100), tmp_path / "clicks" / f"part.{i}.parquet", row_group_size=50)
    columns = dict(SPARK_COLUMNS, sparse_columns={"country": "country", "city": "city"})
    dataset = ParquetDataset([str(tmp_path / "clicks")], **columns, batch_size=50, ids="hash")
    assert pa.types.is_dictionary(pq.read_schema(dataset.files[0]).field("country").type)
    alone = list(dataset)
    with_workers = list(DataLoader(dataset, batch_size=None, num_workers=2))
    for batches in (alone, with_workers):
        rows = torch.cat([b.dense_features[:, 0] for b in batches]).long()
        country, city = (torch.cat([b.sparse_features[f].values() for b in batches]) for f in ("country", "city"))
        assert len(set(country.tolist())) == 4 and len(set(city.tolist())) == 4  # 3 strings and the missing id
        first = {r: c for r, c in zip(rows.tolist(), country.tolist())}
        assert [first[r] for r in range(4)] == [first[r + 4] for r in range(4)]  # a string is one id wherever it is
        assert not set(country.tolist()) & set(city.tolist())  # the same string in another feature: another id
    with pytest.raises(ValueError, match=r"column 'country' \(sparse feature 'country'\) holds dictionary<values=string.*ids hash takes strings"):
        ParquetDataset([str(tmp_path / "clicks")], **columns)


def test_list_columns_are_bags_pooled_as_torchrec_pools_them(tmp_path):
    """Merlin's multi-hot: list<int64> columns give KJT lengths > 1 (a null list: an empty bag), summed by an
    EmbeddingBagCollection; one-hot columns beside them keep one id per row (a null: none, with ids raw)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    genres = [[1, 4], [2], None, [], [0, 3, 4]]
    table = pa.table({"y": pa.array([0, 1, 0, 1, 1], pa.int8()), "genres": pa.array(genres, pa.list_(pa.int64())),
                      "movie": pa.array([7, None, 5, 6, 8], pa.int64()), "age": pa.array([1.0, 2.0, None, 4.0, 5.0])})
    pq.write_table(table, tmp_path / "m.parquet")
    columns = {"label_column": "y", "dense_columns": ["age"], "sparse_columns": {"genres": "genres", "movie": "movie"},
               "dense_transform": "none"}
    (batch,) = _read([str(tmp_path / "m.parquet")], columns)
    kjt = batch.sparse_features
    assert kjt["genres"].lengths().tolist() == [2, 1, 0, 0, 3] and kjt["genres"].values().tolist() == [1, 4, 2, 0, 3, 4]
    assert kjt["movie"].lengths().tolist() == [1, 0, 1, 1, 1] and kjt["movie"].values().tolist() == [7, 5, 6, 8]
    assert batch.dense_features[:, 0].tolist() == [1.0, 2.0, 0.0, 4.0, 5.0]
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="g", embedding_dim=2, num_embeddings=5, feature_names=["genres"]),
                                         EmbeddingBagConfig(name="m", embedding_dim=2, num_embeddings=9, feature_names=["movie"])])
    pooled = ebc(kjt)["genres"]
    weight = ebc.embedding_bags["g"].weight
    expected = torch.stack([weight[[1, 4]].sum(0), weight[2], torch.zeros(2), torch.zeros(2), weight[[0, 3, 4]].sum(0)])
    torch.testing.assert_close(pooled, expected)
    (hashed,) = _read([str(tmp_path / "m.parquet")], columns, ids="hash")
    assert hashed.sparse_features["genres"].values().tolist() == hash_feature_ids(torch.tensor([1, 4, 2, 0, 3, 4]), 0).tolist()
    assert hashed.sparse_features["movie"].lengths().tolist() == [1] * 5  # hashed: a null is the feature's missing id


def test_bags_cut_into_batches_across_row_groups_keep_every_id_in_order(tmp_path):
    """Batches of 17 rows cut from row groups of 30: each row's bag whole, in order, through workers too."""
    bags = [list(range(i, i + i % 4)) if i % 5 else None for i in range(200)]
    table = pa.table({"y": pa.array([i % 2 for i in range(200)], pa.int8()), "row": pa.array(np.arange(200, dtype=np.float32)),
                      "tags": pa.array(bags, pa.list_(pa.int64())), "user": pa.array(np.arange(200) * 7)})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=30)
    columns = {"label_column": "y", "dense_columns": ["row"], "sparse_columns": {"tags": "tags", "user": "user"}, "dense_transform": "none"}
    dataset = ParquetDataset([str(tmp_path / "t.parquet")], **columns, batch_size=17)
    for batches in (list(dataset), list(DataLoader(dataset, batch_size=None, num_workers=2))):
        rows = torch.cat([b.dense_features[:, 0] for b in batches]).long().tolist()
        got = {}
        for b in batches:
            lengths, values = b.sparse_features["tags"].lengths().tolist(), b.sparse_features["tags"].values().tolist()
            for r, start, n in zip(b.dense_features[:, 0].long().tolist(), np.cumsum([0] + lengths[:-1]), lengths):
                got[r] = values[start : start + n]
        assert sorted(rows) == list(range(200)) and all(b.batch_size <= 17 for b in batches)
        assert got == {i: bag or [] for i, bag in enumerate(bags)}
        users = torch.cat([b.sparse_features["user"].values() for b in batches])
        assert users.tolist() == [r * 7 for r in rows]
