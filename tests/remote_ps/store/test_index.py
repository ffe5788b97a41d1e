"""The id index against a dict, with the native kernels and with the tensor implementation."""
import random

import pytest
import torch

from lightning_persia.remote_ps.store import native
from lightning_persia.remote_ps.store.native.id_index import Index
from lightning_persia.remote_ps.store import index as index_module
from lightning_persia.remote_ps.store import chunked_rows
from lightning_persia.remote_ps.store.chunked_rows import ChunkedRows, FieldSpec


@pytest.fixture(params=["native", "tensor"])
def implementation(request, monkeypatch):
    if request.param == "native":
        request.getfixturevalue("native_kernels")
    else:
        monkeypatch.setattr(native, "available", lambda: False)
    return request.param


def _keys(rows: int, monkeypatch, chunk_bytes: int = 1) -> ChunkedRows:
    """Rows of ids alone, in small chunks (1,024 rows by default), so that the keys of one index span many of them."""
    monkeypatch.setattr(chunked_rows, "CHUNK_BYTES", chunk_bytes)
    keys = ChunkedRows({"ids": FieldSpec(torch.int64)})
    keys.reserve(rows)
    return keys


def test_index_agrees_with_a_dict_through_inserts_removals_and_growth(implementation, monkeypatch):
    rng = random.Random(3)
    keys = _keys(20000, monkeypatch)
    index = index_module.make_index(keys)
    assert isinstance(index, index_module.NativeIdIndex if implementation == "native" else index_module.TensorIdIndex)
    truth, free_rows, next_row = {}, [], 0
    for _ in range(40):
        fresh = list({rng.randrange(-(1 << 62), 1 << 62) for _ in range(rng.randrange(1, 400))} - set(truth))
        rows = []
        for key in fresh:
            row = free_rows.pop() if free_rows else next_row
            next_row += row == next_row
            rows.append(row)
            truth[key] = row
        keys["ids"].scatter(torch.tensor(rows), torch.tensor(fresh))
        index.insert(torch.tensor(fresh), torch.tensor(rows))
        gone = rng.sample(sorted(truth), k=len(truth) // 5)
        index.remove(torch.tensor(gone, dtype=torch.int64))
        for key in gone:
            free_rows.append(truth.pop(key))
        probe = sorted(truth)[:500] + gone[:100] + [rng.randrange(1 << 40) for _ in range(50)]
        found = index.find(torch.tensor(probe, dtype=torch.int64))
        assert found.tolist() == [truth.get(key, -1) for key in probe]


def test_native_index_grows_a_partition_at_a_time(native_kernels, monkeypatch):
    keys = _keys(300_000, monkeypatch, chunk_bytes=1 << 19)
    index = index_module.NativeIdIndex(keys)
    ids = torch.arange(300_000, dtype=torch.int64) * 2654435761 + 17
    keys["ids"].scatter(torch.arange(300_000), ids)
    grown = []
    for start in range(0, 300_000, 30_000):
        index.insert(ids[start : start + 30_000], torch.arange(start, start + 30_000))
        grown.append(index.info().rebuilds)
    # each batch of 30k ids rebuilt some of the 4,096 partitions, never all of them at once
    steps = [b - a for a, b in zip([0] + grown, grown)]
    assert all(0 < s < 4096 for s in steps[1:]), steps
    assert torch.equal(index.find(ids.flip(0)), torch.arange(300_000).flip(0))
    assert torch.equal(index.find(ids + 1), torch.full((300_000,), -1))
    assert index.nbytes < 300_000 * 12  # at most 12 bytes a row at any load the partitions reach


def test_wrong_buffers_are_refused_before_any_c_code_runs(native_kernels, monkeypatch):
    keys = _keys(2048, monkeypatch)
    chunks = keys.layout
    index = Index()
    with pytest.raises(ValueError, match="ids must be a 1-D torch.int64 CPU tensor, got torch.int32"):
        index.find(torch.arange(3, dtype=torch.int32), chunks)
    with pytest.raises(ValueError, match="3 ids but 2 rows"):
        index.insert(torch.arange(3), torch.arange(2), chunks)
    with pytest.raises(ValueError, match="row 5000 is past the 2048 rows"):
        index.insert(torch.arange(2), torch.tensor([0, 5000]), chunks)
    with pytest.raises(ValueError, match="row 2048 is past"):
        chunks.gather(0, torch.tensor([2048]), torch.empty(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous CPU tensor of 2 rows"):
        chunks.scatter(0, torch.tensor([0, 1]), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="16 bytes at offset 0 does not fit in records of 8 bytes"):
        chunks.gather(0, torch.tensor([1]), torch.empty(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not fit"):
        index.find(torch.arange(2), chunks, touch=(6, 1, False))


def test_an_insert_that_would_rehash_too_many_rows_puts_rebuilds_off_and_still_finds_every_id(native_kernels, monkeypatch):
    count, batch = 4_000_000, 500_000
    keys = _keys(count, monkeypatch, chunk_bytes=1 << 24)
    index = index_module.NativeIdIndex(keys)
    ids = torch.arange(count, dtype=torch.int64) * 2654435761 + 17
    keys["ids"].scatter(torch.arange(count), ids)
    for start in range(0, count, batch):
        index.insert(ids[start : start + batch], torch.arange(start, start + batch))
        assert torch.equal(index.find(ids[: start + batch]), torch.arange(start + batch))
    # a 500k-id insert passes the load of more partitions than its budget of rows to rehash (~131k) allows
    assert index.info().put_off > 0
    assert torch.equal(index.find(ids + 1), torch.full((count,), -1))
    assert index.nbytes < count * 12
