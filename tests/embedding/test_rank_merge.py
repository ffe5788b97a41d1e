"""RankMerge: the ranks' embedding gradients summed into one update, identical on every rank, which rank 0 pushes."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist

from lightning_persia.embedding.context import SparseUpdate
from lightning_persia.embedding.rank_merge import RankMerge, merge_updates
from lightning_persia.ops.keyed_ids import KeyedIds


def _update(**tables: tuple[list[int], float, int]) -> SparseUpdate:
    """``name=(ids, value, dim)``: every gradient row of the table filled with ``value``."""
    keyed = KeyedIds.from_dict({name: torch.tensor(ids, dtype=torch.int64) for name, (ids, _, _) in tables.items()})
    grads = torch.cat([torch.full((len(ids) * dim,), value) for ids, value, dim in tables.values()])
    return SparseUpdate(keyed, grads, tuple(dim for _, _, dim in tables.values()))


def _rows(update: SparseUpdate, table: str) -> tuple[list[int], torch.Tensor]:
    position = update.keyed.tables.index(table)
    start = sum(update.keyed.counts[:position])
    offset = sum(c * d for c, d in zip(update.keyed.counts[:position], update.dims))
    count, dim = update.keyed.counts[position], update.dims[position]
    return update.keyed.ids[start : start + count].tolist(), update.grads[offset : offset + count * dim].view(count, dim)


def test_merge_sums_the_rows_of_every_rank_once_per_id_tables_ordered_by_width():
    rank0 = _update(t=([5, 1, 5], 1.0, 2))
    rank1 = _update(u=([3], 2.0, 3), t=([1, 9], 10.0, 2))
    merged = merge_updates([rank0, rank1])
    assert merged.keyed.tables == ("t", "u") and merged.dims == (2, 3)
    ids, grads = _rows(merged, "t")
    assert ids == [1, 5, 9] and grads[:, 0].tolist() == [11.0, 2.0, 10.0]
    ids, grads = _rows(merged, "u")
    assert ids == [3] and grads.tolist() == [[2.0, 2.0, 2.0]]


def test_merge_gives_the_same_bytes_whatever_the_order_of_the_tables_in_a_part():
    a = _update(t=([4, 2], 1.5, 2), u=([7], 0.25, 2))
    b = _update(u=([7], 0.25, 2), t=([4, 2], 1.5, 2))
    left, right = merge_updates([a, a]), merge_updates([b, b])
    assert left.keyed.tables == right.keyed.tables and left.keyed.counts == right.keyed.counts
    assert torch.equal(left.keyed.ids, right.keyed.ids) and torch.equal(left.grads, right.grads)


def test_merge_of_nothing_is_nothing():
    assert merge_updates([]) is None
    assert merge_updates([None, _update(t=([], 1.0, 2))]) is None


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

    assert merge.submit(_update(t=([2, 2, 0], 1.0, 2), u=([7], 0.5, 3)), push).result(10) is None
    assert merge.submit(None, push).result(10) is None  # nothing to push: answered without a push
    (merged,) = pushed
    ids, grads = _rows(merged, "t")
    assert ids == [0, 2] and grads[:, 0].tolist() == [1.0, 2.0]
    assert torch.equal(_rows(merged, "u")[1], torch.full((1, 3), 0.5))

    def refused(merged):
        raise ValueError("shard said no")

    with pytest.raises(ValueError, match="shard said no"):
        merge.submit(_update(t=([1], 1.0, 2)), refused).result(10)
    assert merge.submit(_update(t=([1], 1.0, 2)), push).result(10) is None  # a failed push is that step's alone
    merge.close()


def test_rank_merge_refuses_unknown_tables_and_misshapen_gradients(one_process_group):
    merge = RankMerge("job-merged", {"t": 2})
    with pytest.raises(ValueError, match=r"\['v'\]"):
        merge.submit(_update(v=([1], 1.0, 2)), lambda merged: None)
    with pytest.raises(ValueError, match=r"table 't': gradient rows of dim 3, the rank merge was set up with dim 2"):
        merge.submit(_update(t=([1], 1.0, 3)), lambda merged: None)
    bad = _update(t=([1, 2], 1.0, 2))
    with pytest.raises(ValueError, match=r"flat with 4 values"):
        merge.submit(SparseUpdate(bad.keyed, bad.grads[:3], bad.dims), lambda merged: None)
    merge.close()


# Two ranks exit while their merge threads are still merging (all-gathers and sums of 50k rows): unless the merge
# is closed at exit, each thread is ended by pthread_exit as it takes the GIL back during finalization, and the
# unwinding through torch's C++ frames aborts the process (every run of this script did).
_EXIT_WHILE_MERGING = textwrap.dedent(
    """\
    import sys, torch, torch.distributed as dist
    from concurrent.futures import Future
    from lightning_persia.embedding.context import SparseUpdate
    from lightning_persia.embedding.rank_merge import RankMerge
    from lightning_persia.ops.keyed_ids import KeyedIds
    rank, init = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    merge = RankMerge("exit-merged", {"t": 16})
    def push(merged):
        done = Future()
        done.set_result(None)
        return done
    ids = torch.arange(rank, 100_000, 2)
    update = SparseUpdate(KeyedIds(("t",), (ids.numel(),), ids), torch.ones(ids.numel() * 16), (16,))
    merge.submit(update, push).result()
    merge.submit(update, push)
    merge.submit(update, push)
    if rank == 1:
        merge.submit(update, push)  # one step more than rank 0: it waits in an all-gather for a rank that is gone
    """
)


def test_ranks_that_exit_while_merging_end_cleanly_and_a_lone_step_does_not_hold_them(tmp_path):
    processes = [subprocess.Popen([sys.executable, "-c", _EXIT_WHILE_MERGING, str(rank), f"file://{tmp_path / 'pg'}"],
                                  stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    for process in processes:
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-2000:]


# Two ranks merge three steps: rank 0 alone pushes, and every rank hears its push's outcome, its errors included
# (a client's error arrives as itself, so that every rank's recovery sees the same failure).
_RANK_ZERO_PUSHES = textwrap.dedent(
    """\
    import json, sys, torch, torch.distributed as dist, grpc
    from concurrent.futures import Future
    from lightning_persia.embedding.context import SparseUpdate
    from lightning_persia.embedding.rank_merge import RankMerge
    from lightning_persia.ops.keyed_ids import KeyedIds
    from lightning_persia.remote_ps.client.errors import PSRequestError
    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    merge = RankMerge("two-merged", {"t": 2})
    pushed = []
    class Unpicklable(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a} {b}")
    outcomes = [Future(), Future()]
    outcomes[0].set_result(None)
    outcomes[1].set_exception(PSRequestError(2, "ps-2:5000", grpc.StatusCode.FAILED_PRECONDITION, "refused"))
    def push(merged):
        pushed.append(merged.keyed.ids.tolist())
        if len(pushed) == 3:
            raise Unpicklable(1, 2)
        return outcomes[len(pushed) - 1]
    ids = torch.tensor([rank, 5])
    update = SparseUpdate(KeyedIds(("t",), (2,), ids), torch.ones(4), (2,))
    heard = []
    for step in range(3):
        error = merge.submit(update, push).exception(60)
        heard.append(None if error is None else [type(error).__name__, str(error)])
    merge.close()
    json.dump({"pushed": pushed, "heard": heard}, open(out, "w"))
    """
)


def test_rank_zero_pushes_the_merged_update_and_every_rank_hears_its_outcome(tmp_path):
    outs = [tmp_path / f"rank{rank}.json" for rank in (0, 1)]
    processes = [subprocess.Popen([sys.executable, "-c", _RANK_ZERO_PUSHES, str(rank), f"file://{tmp_path / 'pg'}", str(outs[rank])],
                                  stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    for process in processes:
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-2000:]
    zero, one = (json.loads(out.read_text()) for out in outs)
    assert zero["pushed"] == [[0, 1, 5]] * 3 and one["pushed"] == []
    refused = ["PSRequestError", "shard 2 at ps-2:5000 answered FAILED_PRECONDITION: refused"]
    assert zero["heard"] == [None, refused, ["Unpicklable", "1 2"]]
    assert one["heard"] == [None, refused, ["RuntimeError", "Unpicklable: 1 2"]]


def test_close_ends_the_thread_and_destroys_the_merge_group(one_process_group, monkeypatch, tmp_path):
    groups = []

    def new_group(**kwargs):
        groups.append(create(**kwargs))
        return groups[-1]

    create = dist.new_group
    monkeypatch.setattr(dist, "new_group", new_group)
    def merge_threads() -> int:
        return sum(t.name.startswith("persia-rank-merge") for t in threading.enumerate())

    merge = RankMerge("job-merged", {"t": 2})
    running = merge_threads()
    assert [dist.get_rank(group) for group in groups] == [0, 0]  # the gathers' and the outcomes'
    merge.close()
    assert merge_threads() == running - 2
    for group in groups:
        with pytest.raises(ValueError, match="not registered"):
            dist.get_rank(group)
    merge.close()  # a second close changes nothing
    late, later = RankMerge("job-merged", {"t": 2}), RankMerge("job-merged", {"t": 2})
    dist.destroy_process_group()  # and every group with it: closing a merge afterwards is no error
    late.close()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg-again'}", rank=0, world_size=1)
    later.close()  # nor with another default group (of which its group is not one)


# A merge's gloo groups run collectives on worker threads of their own, which destroy_process_group leaves running:
# close() must join them, or one may free a collective's tensors while Python finalizes, which aborts the process.
_OS_THREADS_AFTER_CLOSE = textwrap.dedent(
    """\
    import os, sys, torch, torch.distributed as dist
    from concurrent.futures import Future
    from lightning_persia.embedding.context import SparseUpdate
    from lightning_persia.embedding.rank_merge import RankMerge, merge_updates
    from lightning_persia.ops.keyed_ids import KeyedIds
    def os_threads():
        return len(os.listdir("/proc/self/task"))
    def push(merged):
        done = Future()
        done.set_result(None)
        return done
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
    ids = torch.arange(0, 100_000, 3)
    update = SparseUpdate(KeyedIds(("t",), (ids.numel(),), ids), torch.ones(ids.numel() * 4), (4,))
    merge_updates([update, update])  # torch's own pool of threads starts with the first ops
    before = os_threads()
    merge = RankMerge("threads-merged", {"t": 4})
    merge.submit(update, push).result()
    merging = os_threads()
    merge.close()
    print(before, merging, os_threads())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts a process's threads in /proc/self/task, which only Linux has; close() releases the groups on "
                    "every system, only this count of it needs Linux")
def test_close_joins_the_worker_threads_of_the_merge_groups(tmp_path):
    done = subprocess.run([sys.executable, "-c", _OS_THREADS_AFTER_CLOSE, f"file://{tmp_path / 'pg'}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    before, merging, after = map(int, done.stdout.split())
    assert merging >= before + 2 + 2 * 2  # the merge's two threads, and at least two workers per group
    assert after == before
