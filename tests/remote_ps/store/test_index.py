"""The id index against a dict, with the native kernels and with the tensor implementation."""
import random

import pytest
import torch

from lightning_persia.remote_ps.store import index as index_module
from lightning_persia.remote_ps.store.index import IdIndex


@pytest.fixture(params=["native", "tensor"])
def implementation(request, monkeypatch):
    if request.param == "native":
        request.getfixturevalue("native_kernels")
    else:
        monkeypatch.setattr(index_module.native, "available", lambda: False)
    return request.param


def test_index_agrees_with_a_dict_through_inserts_removals_and_growth(implementation):
    rng = random.Random(3)
    keys = torch.empty(20000, dtype=torch.int64)
    index, truth, free_rows, next_row = IdIndex(), {}, [], 0
    for _ in range(40):
        fresh = list({rng.randrange(-(1 << 62), 1 << 62) for _ in range(rng.randrange(1, 400))} - set(truth))
        rows = []
        for key in fresh:
            row = free_rows.pop() if free_rows else next_row
            next_row += row == next_row
            rows.append(row)
            keys[row] = key
            truth[key] = row
        index.insert(torch.tensor(fresh), torch.tensor(rows), keys)
        gone = rng.sample(sorted(truth), k=len(truth) // 5)
        index.remove(torch.tensor(gone, dtype=torch.int64), keys)
        for key in gone:
            free_rows.append(truth.pop(key))
        if index.tombstone_ratio() > 0.25:
            index.rebuild(torch.tensor(sorted(truth.values()), dtype=torch.int64), keys)
        probe = sorted(truth)[:500] + gone[:100] + [rng.randrange(1 << 40) for _ in range(50)]
        found = index.find(torch.tensor(probe, dtype=torch.int64), keys)
        assert found.tolist() == [truth.get(key, -1) for key in probe]


def test_both_implementations_read_each_others_slots(native_kernels, monkeypatch):
    keys = torch.randperm(1 << 20)[:3000].to(torch.int64) * 7919
    built = IdIndex()
    built.insert(keys, torch.arange(3000), keys)
    native_rows = built.find(keys.flip(0), keys)
    monkeypatch.setattr(index_module.native, "available", lambda: False)
    assert torch.equal(built.find(keys.flip(0), keys), native_rows)
    assert torch.equal(native_rows, torch.arange(3000).flip(0))
