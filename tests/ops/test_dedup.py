"""One dedup for every table of a batch gives what per-table ``torch.unique`` gives, for any ids."""
from __future__ import annotations

import pytest
import torch

from lightning_persia.ops import dedup, native
from lightning_persia.ops.native import ids as native_ids
from lightning_persia.ops.dedup import keyed_unique, unique_by_table
from lightning_persia.ops.keyed_ids import KeyedIds


def _per_table(keyed: KeyedIds) -> tuple[list[torch.Tensor], torch.Tensor]:
    uniques, inverses = [], []
    for ids in torch.split(keyed.ids, list(keyed.counts)):
        unique, inverse = torch.unique(ids, return_inverse=True)
        uniques.append(unique)
        inverses.append(inverse)
    return uniques, torch.cat(inverses)


@pytest.fixture(params=["native", "tensor"])
def implementation(request, monkeypatch):
    """keyed_unique through the C kernel (where it is built) and through the tensor ops."""
    if request.param == "native":
        if not native.available():
            pytest.skip("the native kernels are not built here (no C compiler at install time)")
    else:
        monkeypatch.setattr(dedup.native, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("low, high", [(0, 50), (-(2**40), 2**40), (-(2**63), 2**63 - 1)], ids=["small", "wide", "full-int64"])
@pytest.mark.parametrize("counts", [(7,), (30, 0, 12, 45), (0, 0), (5000, 3)])
def test_keyed_unique_equals_torch_unique_per_table(low, high, counts, implementation):
    gen = torch.Generator().manual_seed(sum(counts))
    pool = torch.randint(low, high, (40,), generator=gen, dtype=torch.int64)
    ids = pool[torch.randint(0, 40, (sum(counts),), generator=gen)]  # repeats within and across tables
    keyed = KeyedIds(tuple(f"t{i}" for i in range(len(counts))), counts, ids)
    unique, inverse = keyed_unique(keyed)
    uniques, inverses = _per_table(keyed)
    assert unique.tables == keyed.tables
    assert unique.counts == tuple(u.numel() for u in uniques)
    assert torch.equal(unique.ids, torch.cat(uniques)) and torch.equal(inverse, inverses)


def test_unique_by_table_takes_ids_in_any_order():
    ids = torch.tensor([9, 4, 9, 4, 1])
    table = torch.tensor([1, 0, 1, 1, 0])
    unique, counts, inverse = unique_by_table(ids, table, 3)
    assert unique.tolist() == [1, 4, 4, 9] and counts.tolist() == [2, 2, 0]
    assert inverse.tolist() == [1, 1, 1, 0, 0]  # rows among their own table's unique ids


def test_keyed_ids_check_their_shape():
    with pytest.raises(ValueError, match=r"counts \[2\] do not add up to the 3 ids"):
        KeyedIds(("a",), (2,), torch.arange(3))
    with pytest.raises(ValueError, match="appears more than once"):
        KeyedIds(("a", "a"), (1, 1), torch.arange(2))
    with pytest.raises(ValueError, match="1-d int64"):
        KeyedIds(("a",), (3,), torch.arange(3).float())
    with pytest.raises(ValueError, match="table 'x': ids must be a 1-d int64 tensor"):
        KeyedIds.from_dict({"x": torch.zeros(2, 2, dtype=torch.int64)})


def test_the_native_dedup_refuses_counts_that_do_not_add_up():
    if not native.available():
        pytest.skip("the native kernels are not built here (no C compiler at install time)")
    with pytest.raises(ValueError, match="counts add up to 2 for 3 ids"):
        native_ids.unique_by_table(torch.arange(3), (2,))
