"""The streaming Criteo TSV reader: parsing, missing values, gzip, malformed lines, rank split, stable ids."""
from __future__ import annotations

import gzip
import math

import pytest
import torch

from lightning_persia.data import (
    CRITEO_SPARSE_FEATURES,
    CriteoBatch,
    CriteoDataModule,
    CriteoIterableDataset,
    hash_categorical,
    hash_feature_ids,
    missing_ids,
    parse_criteo_lines,
)


def _line(label="1", dense=None, cats=None) -> str:
    dense = dense if dense is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    assert len(dense) == 13 and len(cats) == 26
    return "\t".join([label, *dense, *cats]) + "\n"


def _rows(n: int) -> list[str]:
    """``n`` valid lines; row ``i`` has C1 = hex(i) and I1 = i, so rows can be told apart."""
    return [_line(str(i % 2), [str(i)] + ["1"] * 12, [f"{i:08x}"] + ["abcdef01"] * 25) for i in range(n)]


def _write(path, lines, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt") as out:
        out.writelines(lines)
    return str(path)


def _all(dataset) -> list[CriteoBatch]:
    return list(iter(dataset))


def _cat(batches, attr="labels"):
    return torch.cat([getattr(b, attr) for b in batches])


def test_values_and_missing_fields(tmp_path):
    dense = ["5", "", "-3", "0", "100"] + [""] * 8
    cats = ["68fd1e64", "", "0", "ABCDEF01"] + [""] * 22
    path = _write(tmp_path / "day_0", [_line("1", dense, cats), _line("0", [""] * 13, [""] * 26)])
    (first, *rest) = _all(CriteoIterableDataset([path], batch_size=8))
    assert not rest and isinstance(first, CriteoBatch)
    assert first.labels.tolist() == [1.0, 0.0] and first.labels.dtype == torch.float32
    assert first.dense_features.dtype == torch.float32 and first.dense_features.shape == (2, 13)
    expected = torch.zeros(2, 13)
    expected[0, 0], expected[0, 4] = math.log(6), math.log(101)  # -3 -> max(-3, 0) = 0; missing -> 0
    torch.testing.assert_close(first.dense_features, expected)
    kjt = first.sparse_features
    assert kjt.keys() == CRITEO_SPARSE_FEATURES
    assert kjt.lengths().tolist() == [1] * (2 * 26)  # missing values still have one id
    ids = first.sparse_ids()
    missing = missing_ids(26)
    assert torch.equal(ids[1], missing)
    assert ids[0, 1] == missing[1] and ids[0, 4:].tolist() == missing[4:].tolist()
    assert ids[0, 0] == hash_categorical(torch.tensor([[0x68FD1E64]]))[0, 0]
    # the hex case does not matter; a value of 0 is not "missing"
    assert ids[0, 3] == hash_categorical(torch.tensor([[0, 0, 0, 0xABCDEF01]]))[0, 3]
    assert ids[0, 2] != missing[2]
    assert bool((ids >= 0).all())


def test_gzip_is_read_transparently(tmp_path):
    lines = _rows(50)
    plain = _all(CriteoIterableDataset([_write(tmp_path / "a.tsv", lines)], batch_size=16))
    # compressed, and named without .gz: detected from the content
    packed = _all(CriteoIterableDataset([_write(tmp_path / "b.bin", lines, gz=True)], batch_size=16))
    assert [len(b) for b in plain] == [16, 16, 16, 2] == [len(b) for b in packed]
    for x, y in zip(plain, packed):
        assert torch.equal(x.sparse_ids(), y.sparse_ids())
        assert torch.equal(x.dense_features, y.dense_features) and torch.equal(x.labels, y.labels)


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ("1\t2\t3\n", "fields"),
        (_line("1", ["1.5"] + ["0"] * 12), "I1"),
        (_line("1", ["0"] * 12 + ["x"]), "I13"),
        (_line("1", cats=["0"] * 25 + ["xyz"]), "C26"),
        (_line("1", cats=["123456789"] + ["0"] * 25), "C1"),
        (_line("2"), "label"),
        (_line(""), "label"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, reason):
    first = _write(tmp_path / "first.tsv", _rows(5))
    second = _write(tmp_path / "second.tsv", _rows(2) + [bad_line] + _rows(3))
    with pytest.raises(ValueError) as err:
        _all(CriteoIterableDataset([first, second], batch_size=4))
    message = str(err.value)
    assert "second.tsv" in message and "line 3" in message and reason in message
    assert message.endswith("(skip_malformed=True skips and counts such lines)")  # and the remedy


def test_skip_malformed_counts_and_keeps_batches_full(tmp_path):
    lines = _rows(20)
    lines[3] = "garbage\n"
    lines[11] = _line("1", cats=["zz"] * 26)
    dataset = CriteoIterableDataset([_write(tmp_path / "d.tsv", lines)], batch_size=6, skip_malformed=True)
    batches = _all(dataset)
    assert dataset.malformed_lines == 2
    assert [len(b) for b in batches] == [6, 6, 6]
    kept = _cat(batches, "dense_features")[:, 0]
    expected = torch.log1p(torch.tensor([i for i in range(20) if i not in (3, 11)], dtype=torch.float32))
    torch.testing.assert_close(kept, expected)
    # the counter is per pass
    _all(dataset)
    assert dataset.malformed_lines == 2


def test_drop_last(tmp_path):
    path = _write(tmp_path / "d.tsv", _rows(10))
    assert [len(b) for b in _all(CriteoIterableDataset([path], batch_size=4, drop_last=True))] == [4, 4]


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_split_is_disjoint_and_complete(tmp_path, world_size):
    files = [_write(tmp_path / "a.tsv", _rows(7)), _write(tmp_path / "b.tsv.gz", _rows(13)[7:], gz=True)]
    everything = _cat(_all(CriteoIterableDataset(files, batch_size=5)), "dense_features")[:, 0]
    parts = []
    for rank in range(world_size):
        batches = _all(CriteoIterableDataset(files, batch_size=5, rank=rank, world_size=world_size))
        parts.append(_cat(batches, "dense_features")[:, 0])
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    merged = torch.cat(parts)
    assert len(merged) == len(everything) == 13
    assert torch.equal(merged.sort().values, everything.sort().values)  # disjoint and complete


def test_dataloader_workers_split_within_a_rank(tmp_path):
    files = [_write(tmp_path / "a.tsv", _rows(30))]
    dm = CriteoDataModule(train_files=files, batch_size=4, num_workers=2)
    rows = _cat(list(dm.train_dataloader()), "dense_features")[:, 0]
    assert len(rows) == 30
    assert torch.equal(rows.sort().values, torch.log1p(torch.arange(30, dtype=torch.float32)))


def test_stable_hashing_across_runs_and_features():
    values = torch.tensor([[0x68FD1E64, 0x68FD1E64, 0]])
    # pinned: these ids must never change (the PS stores rows under them)
    assert hash_categorical(values).tolist() == [[6863199212804522528, 6331488391595034993, 7988944499368322040]]
    # the same hex in different features gives different ids; each feature's missing id is its own
    ids = hash_categorical(torch.arange(1000).repeat(26, 1).t())
    assert len(set(ids.flatten().tolist())) == 26 * 1000
    assert len(set(missing_ids(26).tolist()) | set(ids.flatten().tolist())) == 26 * 1000 + 26
    # any int64 (ids of 2**32 and more, negative ones such as Spark's signed xxhash64) has ids of its own per feature
    wide = torch.tensor([[1 << 32, -1, -(1 << 63), (1 << 63) - 1]]).repeat(2, 1)
    wide[1] = torch.tensor([5, 6, 7, 8])
    ids = hash_categorical(wide)
    assert (ids >= 0).all() and len(set(ids.flatten().tolist()) | set(missing_ids(4).tolist())) == 12
    assert hash_categorical(wide[:, [1, 0]])[0].tolist() != ids[0, [0, 1]].tolist()  # another feature, another id
    assert hash_categorical(wide)[0, 1] == hash_feature_ids(torch.tensor([-1, -1]), 1)[0]
    with pytest.raises(ValueError, match="expected \\[B, F\\] values"):
        hash_categorical(torch.tensor([1, 2]))


def test_datamodule_splits_and_globs(tmp_path):
    _write(tmp_path / "train_0.tsv", _rows(9))
    _write(tmp_path / "train_1.tsv", _rows(3))
    val = _write(tmp_path / "val.tsv", _rows(5))
    dm = CriteoDataModule(train_files=[str(tmp_path / "train_*.tsv")], val_files=[val], batch_size=4, eval_batch_size=8)
    assert [len(b) for b in dm.train_dataloader()] == [4, 4, 4]
    assert [len(b) for b in dm.val_dataloader()] == [5]
    assert dm.test_dataloader() == []
    with pytest.raises(FileNotFoundError):
        CriteoDataModule(train_files=[str(tmp_path / "nothing_*.tsv")]).train_dataloader()


def test_pyarrow_tokenising_gives_the_line_parsers_rows(tmp_path):
    """The pyarrow.csv path and the line-by-line parser agree (missing fields, upper-case hex, negative counts,
    CRLF endings); a malformed chunk is left to the line parser, which names the line."""
    from lightning_persia.data.criteo import _HASHED, _tokenised, tsv_transform

    lines = [line.encode() for line in _rows(40)]
    lines[3] = _line("0", ["", "-7"] + ["3"] * 11, ["", "ABCDEF01"] + ["0"] * 24).encode()
    lines[5] = lines[5].replace(b"\n", b"\r\n")
    lines.append(_line("1", [""] * 13, [""] * 26).encode())
    for transform in (_HASHED, tsv_transform("raw")):
        fast, (slow, bad) = _tokenised(lines, transform), parse_criteo_lines(lines, transform)
        assert fast is not None and not bad
        assert all(torch.equal(a, b) for a, b in zip(fast.ids.values, slow.ids.values))
        assert torch.equal(fast.ids.lengths, slow.ids.lengths) and torch.equal(fast.dense, slow.dense) and torch.equal(fast.labels, slow.labels)
    assert _tokenised(lines + [b"1\t2\n"], _HASHED) is None and _tokenised(lines + [_line("2").encode()], _HASHED) is None
    assert _tokenised([_line("1", cats=["123456789"] + ["0"] * 25).encode()], _HASHED) is None
