"""RankMerge: the ranks' embedding gradients summed into one update, identical on every rank."""
from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist

from lightning_persia.embedding.rank_merge import RankMerge, merge_updates


def _part(ids: list[int], value: float, dim: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(ids), torch.full((len(ids), dim), value)


def test_merge_sums_the_rows_of_every_rank_once_per_id():
    rank0 = {"t": _part([5, 1, 5], 1.0)}
    rank1 = {"t": _part([1, 9], 10.0), "u": _part([3], 2.0, dim=3)}
    merged = merge_updates([rank0, rank1])
    assert list(merged) == ["t", "u"]
    ids, grads = merged["t"]
    assert ids.tolist() == [1, 5, 9]
    assert grads[:, 0].tolist() == [11.0, 2.0, 10.0]
    assert merged["u"][0].tolist() == [3] and merged["u"][1].shape == (1, 3)


def test_merge_gives_the_same_bytes_whatever_the_order_of_the_tables_in_a_part():
    a = {"t": _part([4, 2], 1.5), "u": _part([7], 0.25)}
    b = {"u": _part([7], 0.25), "t": _part([4, 2], 1.5)}
    left, right = merge_updates([a, a]), merge_updates([b, b])
    assert list(left) == list(right)
    for name in left:
        assert torch.equal(left[name][0], right[name][0]) and torch.equal(left[name][1], right[name][1])


def test_merge_of_nothing_is_empty():
    assert merge_updates([]) == {}
    assert merge_updates([{}, {}]) == {}


def test_rank_merge_needs_a_sender_and_tables():
    with pytest.raises(ValueError, match="sender"):
        RankMerge("", {"t": 2})
    with pytest.raises(ValueError, match="dims"):
        RankMerge("job-merged", {})


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield


def test_rank_merge_pushes_the_merged_update_and_reports_its_outcome(one_process_group):
    merge = RankMerge("job-merged", {"t": 2, "u": 3})
    pushed = []

    def push(merged):
        pushed.append(merged)
        done = Future()
        done.set_result(None)
        return done

    assert merge.submit({"t": _part([2, 2, 0], 1.0), "u": _part([7], 0.5, dim=3)}, push).result(10) is None
    assert merge.submit({}, push).result(10) is None  # nothing to push: answered without a push
    (merged,) = pushed
    assert merged["t"][0].tolist() == [0, 2] and merged["t"][1][:, 0].tolist() == [1.0, 2.0]
    assert torch.equal(merged["u"][1], torch.full((1, 3), 0.5))

    def refused(merged):
        raise ValueError("shard said no")

    with pytest.raises(ValueError, match="shard said no"):
        merge.submit({"t": _part([1], 1.0)}, refused).result(10)
    assert merge.submit({"t": _part([1], 1.0)}, push).result(10) is None  # a failed push is that step's alone
    merge.close()


def test_rank_merge_refuses_unknown_tables_and_misshapen_gradients(one_process_group):
    merge = RankMerge("job-merged", {"t": 2})
    with pytest.raises(ValueError, match=r"\['v'\]"):
        merge.submit({"v": _part([1], 1.0)}, lambda merged: None)
    with pytest.raises(ValueError, match=r"table 't': expected ids \[n\] and grads \[n, 2\], got \(1,\) and \(1, 3\)"):
        merge.submit({"t": _part([1], 1.0, dim=3)}, lambda merged: None)
    merge.close()
