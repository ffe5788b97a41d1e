"""TorchRec's binary Criteo days: values, batches across days, the deal to ranks and workers, errors that name the file."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from click_files import MLPERF_MULTI_HOT_SIZES, synthetic_rows, torchrec_days, write_multi_hot_day, write_torchrec_day
from torch.utils.data import DataLoader

from lightning_persia.data import (
    CRITEO_SPARSE_FEATURES,
    CriteoBinaryDataModule,
    CriteoBinaryDataset,
    hash_categorical,
    hash_feature_ids,
)


@pytest.fixture
def days(tmp_path):
    """Two days of 300 and 200 rows (rows 0..499 of the synthetic stream)."""
    return [write_torchrec_day(str(tmp_path / "day_0"), synthetic_rows(300)),
            write_torchrec_day(str(tmp_path / "day_1"), synthetic_rows(200, start=300))]


def _cat(batches, attr):
    return torch.cat([getattr(b, attr) for b in batches])


def test_batches_hold_the_files_rows_across_days(days):
    rows = synthetic_rows(500)
    batches = list(CriteoBinaryDataset(days, batch_size=128, rank=0, world_size=1, ids="hash"))
    assert [b.batch_size for b in batches] == [128, 128, 128, 116]  # the third batch spans both days
    kjt = batches[0].sparse_features
    assert kjt.keys() == CRITEO_SPARSE_FEATURES and kjt.lengths().tolist() == [1] * (128 * 26)
    values = np.where(rows.cat_missing, 0, rows.cat_values)  # TorchRec writes a missing value as 0
    assert torch.equal(torch.cat([b.sparse_ids() for b in batches]), hash_categorical(torch.from_numpy(values)))
    dense = np.concatenate([np.load(f"{day}_dense.npy") for day in days])  # as TorchRec transformed them
    assert torch.equal(_cat(batches, "dense_features"), torch.from_numpy(dense))
    assert _cat(batches, "labels").tolist() == rows.labels.astype(np.float32).tolist()


def test_int32_files_are_read_as_unsigned(tmp_path):
    rows = synthetic_rows(64)
    wide = write_torchrec_day(str(tmp_path / "wide"), rows)
    narrow = write_torchrec_day(str(tmp_path / "narrow"), rows, sparse_dtype=np.int32)  # as TorchRec's shuffle writes
    assert (np.load(f"{narrow}_sparse.npy") < 0).any()  # values of 2**31 and more wrapped around
    (a,), (b,) = list(CriteoBinaryDataset([wide], batch_size=64)), list(CriteoBinaryDataset([narrow], batch_size=64))
    assert torch.equal(a.sparse_ids(), b.sparse_ids())
    assert torch.equal(a.sparse_ids(), torch.from_numpy(np.load(f"{wide}_sparse.npy")))  # ids: raw, the default


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_disjoint_batches_and_as_many_each(days, world_size):
    whole = [b.labels for b in CriteoBinaryDataset(days, batch_size=50, rank=0, world_size=1)]  # 10 batches
    per_rank = [list(CriteoBinaryDataset(days, batch_size=50, rank=r, world_size=world_size)) for r in range(world_size)]
    assert {len(batches) for batches in per_rank} == {10 // world_size}
    for r, batches in enumerate(per_rank):  # batch k goes to rank k % world_size
        assert all(torch.equal(b.labels, whole[r + world_size * i]) for i, b in enumerate(batches))


def test_workers_share_a_rank_in_the_same_order(days):
    dataset = CriteoBinaryDataset(days, batch_size=64, rank=1, world_size=2)
    alone = [b.sparse_ids() for b in dataset]
    with_workers = [b.sparse_ids() for b in DataLoader(dataset, batch_size=None, num_workers=2)]
    assert len(alone) == 4 and len(with_workers) == 4
    assert all(torch.equal(a, b) for a, b in zip(alone, with_workers))


def test_drop_last(days):
    assert [b.batch_size for b in CriteoBinaryDataset(days, batch_size=128, drop_last=True)] == [128] * 3


def test_missing_file_is_named(days):
    with pytest.raises(FileNotFoundError, match=r"day_7_dense\.npy"):
        CriteoBinaryDataset([days[0].replace("day_0", "day_7")])
    with pytest.raises(FileNotFoundError, match=r"no file matches .*week_\*_dense\.npy"):
        CriteoBinaryDataset([days[0].replace("day_0", "week_*")])


def test_wrong_columns_and_rows_are_named(days):
    np.save(f"{days[1]}_sparse.npy", np.zeros((200, 25), dtype=np.int64))
    with pytest.raises(ValueError, match=r"day_1_sparse\.npy holds int64 \(200, 25\); expected \[N, 26\] integers"):
        CriteoBinaryDataset(days)
    np.save(f"{days[1]}_sparse.npy", np.zeros((199, 26), dtype=np.int64))
    with pytest.raises(ValueError, match=r"day_1_sparse\.npy has 199 rows but .*day_1_labels\.npy has 200"):
        CriteoBinaryDataset(days)


def test_bad_values_are_named_with_file_row_and_column(days):
    labels = np.load(f"{days[1]}_labels.npy")
    labels[150] = -1
    np.save(f"{days[1]}_labels.npy", labels)
    with pytest.raises(ValueError, match=r"day_1_labels\.npy, row 150: label \[?-1\]? is not 0 or 1"):
        list(CriteoBinaryDataset(days, batch_size=100))
    dense = np.load(f"{days[0]}_dense.npy")
    dense[7, 4] = np.inf
    np.save(f"{days[0]}_dense.npy", dense)
    with pytest.raises(ValueError, match=r"day_0_dense\.npy, row 7, column 4: inf is not a finite number"):
        next(iter(CriteoBinaryDataset(days, batch_size=100)))


def test_datamodule_expands_patterns_in_day_order(tmp_path):
    for day in (0, 2, 10):
        write_torchrec_day(str(tmp_path / f"day_{day}"), synthetic_rows(10, start=10 * day))
    module = CriteoBinaryDataModule(train_files=[str(tmp_path / "day_*")], val_files=[str(tmp_path / "day_10")],
                                    batch_size=10, num_workers=0, val_test_split=False)
    assert module.dataset("train").prefixes == [str(tmp_path / f"day_{d}") for d in (0, 2, 10)]
    labels = [b.labels for b in module.train_dataloader()]
    expected = synthetic_rows(110).labels.astype(np.float32)
    assert [t.tolist() for t in labels] == [expected[10 * d: 10 * d + 10].tolist() for d in (0, 2, 10)]
    assert module.test_dataloader() == [] and len(list(module.val_dataloader())) == 1


def test_torchrec_vocabulary_ids_are_read_as_they_are_and_index_kept_tables(tmp_path):
    """Days from TorchRec's tsv_to_npys + sparse_to_contiguous: ids: raw gives the stored ids row for row, and a
    table kept on the trainers reads their rows directly (none folded); one row too few is named."""
    from lightning_persia.strategy.interception import TableDefaults, intercept
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torch import nn

    prefixes = torchrec_days(tmp_path, [300, 200])
    stored = np.concatenate([np.load(f"{p}_sparse.npy") for p in prefixes]).astype(np.int64)
    assert stored.min() >= 0 and stored.max() < 500  # vocabulary ids, not 32-bit values
    dataset = CriteoBinaryDataset(prefixes, batch_size=128)
    assert dataset.transform.raw_features == tuple(CRITEO_SPARSE_FEATURES)
    batches = list(dataset)
    assert torch.equal(torch.cat([b.sparse_ids() for b in batches]), torch.from_numpy(stored))
    sizes = (stored.max(axis=0) + 1).tolist()
    model = nn.Module()
    model.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f, embedding_dim=4, num_embeddings=n, feature_names=[f])
                                               for f, n in zip(CRITEO_SPARSE_FEATURES, sizes)])
    intercept(model, ["EmbeddingBagCollection"], [], TableDefaults(data_parallel_max_rows=max(sizes),
                                                                   raw_features=dataset.transform.raw_features))
    kjt = batches[0].sparse_features
    assert torch.equal(model.ebc.data_parallel.rows_of(kjt.values(), kjt.length_per_key()), kjt.values())
    small = nn.Module()
    small.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f, embedding_dim=4, num_embeddings=n - (f == "cat_2"),
                                                                  feature_names=[f]) for f, n in zip(CRITEO_SPARSE_FEATURES, sizes)])
    intercept(small, ["EmbeddingBagCollection"], [], TableDefaults(data_parallel_max_rows=max(sizes), raw_features=dataset.transform.raw_features))
    with pytest.raises(ValueError, match=rf"feature 'cat_2': id {sizes[2] - 1} is outside its table of {sizes[2] - 1} rows"):
        for batch in batches:
            small.ebc(batch.sparse_features)


def test_hash_mode_gives_the_tsv_readers_ids_for_torchrecs_32_bit_days(tmp_path):
    """tsv_to_npys's int32 values (wrapped around), hashed: the ids the TSV reader gives the same file."""
    from lightning_persia.data import CriteoIterableDataset

    (prefix,) = torchrec_days(tmp_path, [200], contiguous=False)
    from_npy = torch.cat([b.sparse_ids() for b in CriteoBinaryDataset([prefix], batch_size=64, ids="hash")])
    from_tsv = torch.cat([b.sparse_ids() for b in CriteoIterableDataset([str(tmp_path / "day_0.tsv")], batch_size=64)])
    rows = synthetic_rows(200)
    differ = torch.from_numpy(rows.cat_missing)  # TorchRec writes a missing value as 0, the TSV reader has its own id
    assert torch.equal(from_npy[~differ], from_tsv[~differ]) and differ.any()
    per_feature = CriteoBinaryDataset([prefix], batch_size=64, ids={"cat_0": "hash"}).transform
    assert per_feature.ids[:2] == ("hash", "raw")
    with pytest.raises(ValueError, match=r"ids names features the data has not: \['C1'\]"):
        CriteoBinaryDataset([prefix], ids={"C1": "hash"})


@pytest.fixture
def multi_hot_days(tmp_path):
    """Two MLPerf-layout multi-hot days (300 and 201 rows) made from TorchRec's contiguous days, tables of 50 rows."""
    one_hot = torchrec_days(tmp_path, [300, 201])
    (tmp_path / "multi_hot").mkdir()
    return [write_multi_hot_day(str(tmp_path / "multi_hot" / f"day_{d}"), prefix, MLPERF_MULTI_HOT_SIZES, [50] * 26, seed=d)
            for d, prefix in enumerate(one_hot)]


def test_mlperf_multi_hot_days_give_bags_of_their_ids(multi_hot_days):
    """day_N_sparse_multi_hot.npz (np.savez of 0.npy .. 25.npy, [N, k_f] int32): feature f's bag in a row is its
    k_f stored ids, as TorchRec's MultiHotCriteoIterDataPipe builds the KJT; batches span the days."""
    batches = list(CriteoBinaryDataset(multi_hot_days, batch_size=128))
    assert [b.batch_size for b in batches] == [128, 128, 128, 117]
    members = [np.load(f"{p}_sparse_multi_hot.npz") for p in multi_hot_days]
    for f, (name, k) in enumerate(zip(CRITEO_SPARSE_FEATURES, MLPERF_MULTI_HOT_SIZES)):
        stored = np.concatenate([m[str(f)] for m in members]).astype(np.int64)
        assert stored.shape == (501, k)
        got = [b.sparse_features[name] for b in batches]
        assert all(j.lengths().tolist() == [k] * len(j.lengths()) for j in got)
        assert torch.equal(torch.cat([j.values() for j in got]), torch.from_numpy(stored.reshape(-1)))
    dense = np.concatenate([np.load(f"{p}_dense.npy") for p in multi_hot_days])
    assert torch.equal(torch.cat([b.dense_features for b in batches]), torch.from_numpy(dense))
    hashed = next(iter(CriteoBinaryDataset(multi_hot_days, batch_size=128, ids="hash"))).sparse_features["cat_20"].values()
    assert torch.equal(hashed, hash_feature_ids(batches[0].sparse_features["cat_20"].values(), 20))


def test_multi_hot_bags_are_pooled_by_an_embedding_bag_collection(multi_hot_days):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    (batch, *_) = CriteoBinaryDataset(multi_hot_days, batch_size=4)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f, embedding_dim=3, num_embeddings=50, feature_names=[f])
                                         for f in CRITEO_SPARSE_FEATURES])
    pooled = ebc(batch.sparse_features)["cat_20"]  # 100 ids a row
    ids = torch.from_numpy(np.load(f"{multi_hot_days[0]}_sparse_multi_hot.npz")["20"][:4].astype(np.int64))
    torch.testing.assert_close(pooled, ebc.embedding_bags["cat_20"].weight[ids].sum(1))


def test_the_last_day_is_halved_into_validation_and_test_as_torchrec_does(multi_hot_days, days):
    """val_test_split (the default): validation the first ceil(N / 2) rows of the val days, test the rest; the
    datasets' lengths are the batches each rank runs."""
    module = CriteoBinaryDataModule(train_files=multi_hot_days[:1], val_files=multi_hot_days[1:], batch_size=64,
                                    eval_batch_size=32, num_workers=0)
    labels = np.load(f"{multi_hot_days[1]}_labels.npy")[:, 0].astype(np.float32)
    val = torch.cat([b.labels for b in module.val_dataloader()])
    test = torch.cat([b.labels for b in module.test_dataloader()])
    assert (len(val), len(test)) == (101, 100)  # 201 rows: TorchRec's second_half_start_index = 101
    assert val.tolist() == labels[:101].tolist() and test.tolist() == labels[101:].tolist()
    assert len(module.dataset("val")) == 4 and len(module.dataset("test")) == 4 and len(module.dataset("train")) == 5
    explicit = CriteoBinaryDataModule(train_files=days[:1], val_files=days[1:], test_files=days[1:], num_workers=0)
    assert explicit.dataset("val").num_rows == explicit.dataset("test").num_rows == 200  # test_files given: no halves
    for world_size in (1, 2, 3):
        for drop_last in (False, True):
            per_rank = [CriteoBinaryDataset(days, batch_size=64, rank=r, world_size=world_size, drop_last=drop_last) for r in range(world_size)]
            assert [len(d) for d in per_rank] == [len(list(d)) for d in per_rank]


def test_multi_hot_layout_errors_name_the_archive(tmp_path, multi_hot_days):
    prefix = multi_hot_days[0]
    members = dict(np.load(f"{prefix}_sparse_multi_hot.npz"))
    np.savez_compressed(f"{prefix}_sparse_multi_hot.npz", **members)
    with pytest.raises(ValueError, match=r"day_0_sparse_multi_hot\.npz: member 0\.npy is compressed; write the archive with np\.savez"):
        CriteoBinaryDataset([prefix])
    del members["25"]
    np.savez(f"{prefix}_sparse_multi_hot.npz", **members)
    with pytest.raises(ValueError, match=r"holds members \['0', .*'24'\]; expected 0\.npy \.\. 25\.npy"):
        CriteoBinaryDataset([prefix])
    for part in ("dense", "labels"):
        np.save(str(tmp_path / f"day_7_{part}.npy"), np.zeros((2, 13 if part == "dense" else 1), np.float32))
    with pytest.raises(FileNotFoundError, match=r"neither '.*day_7_sparse\.npy' .* nor '.*day_7_sparse_multi_hot\.npz'"):
        CriteoBinaryDataset([str(tmp_path / "day_7")])
