"""PSClient against real shard processes: optimizers vs PyTorch, init, checkpoints, splitting, retries."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import grpc.aio
import pytest
import torch

from lightning_persia.ops.keyed_ids import KeyedIds
from lightning_persia.ops.shard_map import shard_of
from lightning_persia.remote_ps.client import PSError, PSRequestError, RetryPolicy, ShardUnavailableError, ShardWait
from lightning_persia.remote_ps.client.ps_client import SEQS_PER_UPDATE
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.table_config import SGD, Adagrad, Adam, Constant, Normal, TableConfig, TableSettings, Uniform

DIM = 8


def _ids(n: int, seed: int) -> torch.Tensor:
    """About ``n`` unique ids spread over the whole int64 range, in random order."""
    g = torch.Generator().manual_seed(seed)
    unique = torch.unique(torch.randint(-(2**62), 2**62, (n,), generator=g))
    return unique[torch.randperm(unique.numel(), generator=g)]


def _torch_reference(optimizer, rows: torch.Tensor, grads: list[torch.Tensor], weight_bound=None) -> torch.Tensor:
    """The rows after ``grads`` steps of the matching torch.optim optimizer (or the row-wise Adagrad formula)."""
    param = torch.nn.Parameter(rows.clone())
    kw = dict(lr=optimizer.lr, weight_decay=optimizer.weight_decay)
    if isinstance(optimizer, SGD):
        opt = torch.optim.SGD([param], **kw)
    elif isinstance(optimizer, Adam):
        opt = torch.optim.Adam([param], betas=optimizer.betas, eps=optimizer.eps, **kw)
    elif not optimizer.rowwise:
        opt = torch.optim.Adagrad([param], eps=optimizer.eps, initial_accumulator_value=optimizer.initial_accumulator_value, **kw)
    else:  # FBGEMM's exact row-wise Adagrad: one accumulator per row, s += mean(g^2)
        state = torch.full((rows.shape[0], 1), optimizer.initial_accumulator_value)
        w = rows.clone()
        for g in grads:
            g = g + optimizer.weight_decay * w
            state += g.square().mean(1, keepdim=True)
            w -= optimizer.lr * g / (state.sqrt() + optimizer.eps)
            if weight_bound is not None:
                w.clamp_(-weight_bound, weight_bound)
        return w
    for g in grads:
        param.grad = g.clone()
        opt.step()
        if weight_bound is not None:
            with torch.no_grad():
                param.clamp_(-weight_bound, weight_bound)
    return param.detach()


OPTIMIZERS = {
    "sgd": (SGD(lr=0.5), None),
    "sgd_weight_decay": (SGD(lr=0.5, weight_decay=0.1), None),
    "sgd_weight_bound": (SGD(lr=5.0), 0.05),
    "adagrad": (Adagrad(lr=0.3, initial_accumulator_value=0.1), None),
    "adagrad_weight_decay": (Adagrad(lr=0.3, weight_decay=0.05), None),
    "adagrad_rowwise": (Adagrad(lr=0.3, rowwise=True), None),
    "adagrad_rowwise_decay_bound": (Adagrad(lr=0.3, rowwise=True, weight_decay=0.05), 0.02),
    "adam": (Adam(lr=0.05, betas=(0.8, 0.95)), None),
    "adam_weight_decay": (Adam(lr=0.05, weight_decay=0.1), None),
}


@pytest.mark.parametrize("case", sorted(OPTIMIZERS))
def test_updates_match_pytorch_reference(ps_cluster, make_client, case):
    optimizer, bound = OPTIMIZERS[case]
    client = make_client(ps_cluster.addresses)
    name = f"opt_{case}"
    client.configure([TableConfig(name, DIM, optimizer=optimizer, init=Normal(std=0.05), weight_bound=bound)])
    ids = _ids(600, seed=1)
    assert set(shard_of(ids, 2).tolist()) == {0, 1}
    initial = client.lookup({name: ids}, train=True, wire_dtype="fp32")[name]
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(ids.numel(), DIM, generator=g) for _ in range(3)]
    for step in grads:
        client.update({name: (ids, step)}, wire_dtype="fp32")
    got = client.lookup({name: ids}, train=False, wire_dtype="fp32")[name]
    expected = _torch_reference(optimizer, initial, grads, bound)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if bound is not None:
        assert got.abs().max() <= bound + 1e-7


def test_fp16_wire_default_and_duplicate_ids_summed(ps_cluster, make_client):
    client = make_client(ps_cluster.addresses)
    client.configure([TableConfig("fp16_dups", 4, optimizer=SGD(lr=1.0), init=Uniform(-0.5, 0.5))])
    ids = torch.tensor([11, 12, 13, 14, 15])
    before = client.lookup({"fp16_dups": ids}, train=True, wire_dtype="fp32")["fp16_dups"]
    fp16 = client.lookup({"fp16_dups": ids}, train=False)["fp16_dups"]  # fp16 is the default
    assert fp16.dtype == torch.float32
    torch.testing.assert_close(fp16, before.half().float(), rtol=0, atol=0)
    grads = torch.full((7, 4), 0.25)
    client.update({"fp16_dups": (torch.tensor([11, 11, 11, 12, 13, 14, 15]), grads)})  # id 11 three times
    after = client.lookup({"fp16_dups": ids}, train=False, wire_dtype="fp32")["fp16_dups"]
    torch.testing.assert_close(after - before, torch.tensor([[-0.75] * 4] + [[-0.25] * 4] * 4))


def test_multi_table_lookup_keeps_caller_order(ps_cluster, make_client):
    client = make_client(ps_cluster.addresses)
    client.configure([TableConfig("multi_a", 3, init=Constant(1.0)), TableConfig("multi_b", 5)])
    a, b = _ids(300, seed=3), _ids(200, seed=4)
    rows = client.lookup({"multi_a": a, "multi_b": b}, train=True, wire_dtype="fp32")
    assert rows["multi_a"].shape == (a.numel(), 3) and rows["multi_b"].shape == (b.numel(), 5)
    assert torch.equal(rows["multi_a"], torch.ones(a.numel(), 3))
    # each row is the one of its own id, whatever the order
    perm = torch.randperm(b.numel())
    again = client.lookup({"multi_b": b[perm]}, train=False, wire_dtype="fp32")["multi_b"]
    assert torch.equal(again, rows["multi_b"][perm])
    empty = client.lookup({"multi_b": torch.empty(0, dtype=torch.int64)}, train=False)["multi_b"]
    assert empty.shape == (0, 5)


def test_initial_rows_do_not_depend_on_the_shard_count(ps_cluster1, ps_cluster3, make_client, ps_seed):
    config = TableConfig("determinism", 6, init=Normal(std=0.3))
    ids = _ids(500, seed=5)
    rows = []
    for cluster in (ps_cluster1, ps_cluster3):
        client = make_client(cluster.addresses)
        client.configure([config])
        evaluation = client.lookup({"determinism": ids}, train=False, wire_dtype="fp32")["determinism"]
        training = client.lookup({"determinism": ids.flip(0)}, train=True, wire_dtype="fp32")["determinism"].flip(0)
        assert torch.equal(evaluation, training)
        rows.append(evaluation)
    assert torch.equal(rows[0], rows[1])
    reference = ShardStore(0, 1, seed=ps_seed)
    reference.configure(config)
    assert torch.equal(rows[0], reference.lookup("determinism", ids, train=False))
    assert rows[0].std() > 0.1


def test_save_load_and_reshard_two_to_three(ps_cluster, ps_cluster3, make_client, tmp_path):
    two = make_client(ps_cluster.addresses)
    configs = [TableConfig("ckpt_a", 4, optimizer=Adagrad(lr=0.1, rowwise=True)), TableConfig("ckpt_b", 2, optimizer=Adam())]
    two.configure(configs)
    a, b = _ids(800, seed=6), _ids(100, seed=7)
    two.lookup({"ckpt_a": a, "ckpt_b": b}, train=True)
    two.update({"ckpt_a": (a, torch.randn(a.numel(), 4)), "ckpt_b": (b, torch.randn(b.numel(), 2))})
    saved = two.lookup({"ckpt_a": a, "ckpt_b": b}, train=False, wire_dtype="fp32")
    two.save(tmp_path / "ckpt")

    # same shard count: later updates are rolled back by a load
    two.update({"ckpt_a": (a, torch.ones(a.numel(), 4))})
    two.load(tmp_path / "ckpt")
    restored = two.lookup({"ckpt_a": a, "ckpt_b": b}, train=False, wire_dtype="fp32")
    assert all(torch.equal(restored[k], saved[k]) for k in saved)

    # three shards: every id lands on its new shard with its rows and optimizer state
    three = make_client(ps_cluster3.addresses)
    three.load(tmp_path / "ckpt")
    assert three.describe(["ckpt_a", "ckpt_b"]) == {c.name: c for c in configs}
    resharded = three.lookup({"ckpt_a": a, "ckpt_b": b}, train=False, wire_dtype="fp32")
    assert all(torch.equal(resharded[k], saved[k]) for k in saved)
    counts = [s["tables"]["ckpt_a"]["rows"] for s in three.stats()]
    assert sum(counts) == a.numel() and min(counts) > 0
    grads = torch.randn(a.numel(), 4)
    two.update({"ckpt_a": (a, grads)})
    three.update({"ckpt_a": (a, grads)})
    torch.testing.assert_close(
        three.lookup({"ckpt_a": a}, train=False, wire_dtype="fp32")["ckpt_a"],
        two.lookup({"ckpt_a": a}, train=False, wire_dtype="fp32")["ckpt_a"],
    )


def test_load_of_missing_checkpoint_is_refused_and_changes_nothing(ps_cluster, make_client, tmp_path):
    client = make_client(ps_cluster.addresses)
    client.configure([TableConfig("ckpt_missing", 2)])
    ids = _ids(50, seed=8)
    before = client.lookup({"ckpt_missing": ids}, train=True, wire_dtype="fp32")["ckpt_missing"]
    with pytest.raises(PSRequestError) as info:
        client.load(tmp_path / "nowhere")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "nowhere" in str(info.value)
    assert torch.equal(client.lookup({"ckpt_missing": ids}, train=False, wire_dtype="fp32")["ckpt_missing"], before)


def test_large_requests_are_split_into_several_messages(ps_cluster, make_client):
    client = make_client(ps_cluster.addresses, max_ids_per_message=100)
    client.configure([TableConfig("split", 3, optimizer=SGD(lr=1.0))])
    ids = _ids(2000, seed=9)
    calls_before = [s["server"].get("Lookup", 0) for s in client.stats()]
    rows = client.lookup({"split": ids}, train=True, wire_dtype="fp32")["split"]
    calls = [s["server"]["Lookup"] - b for s, b in zip(client.stats(), calls_before)]
    assert sum(calls) >= ids.numel() // 100
    client.update({"split": (ids, torch.ones(ids.numel(), 3))}, wire_dtype="fp32")
    after = client.lookup({"split": ids}, train=False, wire_dtype="fp32")["split"]
    torch.testing.assert_close(after, rows - 1.0)


def test_tables_of_several_widths_travel_packed_split_and_reordered(ps_cluster, make_client):
    """One sharding serves the lookup and the update of the same ids; tables of widths 4, 8, 4 (one empty) share
    each message, which splits mid-table; the flat rows come back in the caller's order."""
    from lightning_persia.ops.keyed_ids import KeyedIds

    client = make_client(ps_cluster.addresses, max_ids_per_message=37)
    client.configure([TableConfig(n, d, optimizer=SGD(lr=1.0)) for n, d in (("packed_a", 4), ("packed_b", 8), ("packed_c", 4), ("packed_d", 2))])
    ids = {"packed_a": _ids(90, seed=30), "packed_b": _ids(60, seed=31), "packed_d": torch.tensor([], dtype=torch.int64),
           "packed_c": _ids(70, seed=32)}
    per_table = client.lookup(ids, train=True, wire_dtype="fp32")
    assert {name: tuple(rows.shape) for name, rows in per_table.items()} == {
        "packed_a": (ids["packed_a"].numel(), 4), "packed_b": (ids["packed_b"].numel(), 8), "packed_d": (0, 2),
        "packed_c": (ids["packed_c"].numel(), 4)}
    sharded = client.shard(KeyedIds.from_dict(ids))
    assert len(sharded.messages) >= sum(t.numel() for t in ids.values()) // 37
    flat = client.lookup_sharded_async(sharded, train=False, wire_dtype="fp32").result(30)
    torch.testing.assert_close(flat, torch.cat([rows.reshape(-1) for rows in per_table.values()]), rtol=0, atol=0)
    grads = torch.randn(flat.numel())
    client.update_sharded_async(sharded, grads, [4, 8, 2, 4], wire_dtype="fp32").result(30)
    after = client.lookup_sharded_async(sharded, train=False, wire_dtype="fp32").result(30)
    torch.testing.assert_close(after, flat - grads, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"flat float tensor of 1120 values \(counts \[\d+, \d+, 0, \d+\] x dims \[4, 8, 2, 4\]\)"):
        client.update_sharded_async(sharded, grads[:-1], [4, 8, 2, 4])


def test_futures_overlap_and_stats(ps_cluster, make_client):
    client = make_client(ps_cluster.addresses)
    client.configure([TableConfig("overlap", 2, optimizer=SGD(lr=1.0), init=Constant(0.0))])
    batches = [_ids(200, seed=s) for s in range(10, 16)]
    lookups = [client.lookup_async({"overlap": b}, train=True) for b in batches]
    assert all(f.result(30)["overlap"].shape == (b.numel(), 2) for f, b in zip(lookups, batches))
    updates = [client.update_async({"overlap": (batches[0], torch.ones(batches[0].numel(), 2))}) for _ in range(4)]
    for f in updates:
        assert f.result(30) is None
    got = client.lookup({"overlap": batches[0]}, train=False, wire_dtype="fp32")["overlap"]
    assert torch.equal(got, torch.full_like(got, -4.0))
    stats = client.stats()
    assert [s["shard_index"] for s in stats] == [0, 1]
    assert sum(s["tables"]["overlap"]["rows"] for s in stats) == torch.cat(batches).unique().numel()


def test_clients_sending_one_update_under_a_shared_sender_apply_it_once(ps_cluster, make_client):
    """How merged ranks push: the same updates, in the same order, under one sender id."""
    first, second = make_client(ps_cluster.addresses), make_client(ps_cluster.addresses)
    first.configure([TableConfig("shared", 2, optimizer=SGD(lr=1.0), init=Constant(0.0))])
    ids = _ids(300, seed=21)
    first.lookup({"shared": ids}, train=True)  # the rows exist
    duplicates_before = sum(s["server"].get("update_duplicates", 0) for s in first.stats())
    for step in range(3):
        grads = torch.full((ids.numel(), 2), float(step + 1))
        futures = [c.update_async({"shared": (ids, grads)}, wire_dtype="fp32", sender="job-merged") for c in (first, second)]
        for future in futures:
            assert future.result(30) is None
    got = second.lookup({"shared": ids}, train=False, wire_dtype="fp32")["shared"]
    assert torch.equal(got, torch.full_like(got, -6.0))  # 1 + 2 + 3, each once
    duplicates = sum(s["server"].get("update_duplicates", 0) for s in first.stats()) - duplicates_before
    assert duplicates == 3 * len(ps_cluster.addresses)  # every second copy, on every shard
    first.update({"shared": (ids, torch.ones(ids.numel(), 2))}, wire_dtype="fp32")  # its own sender: applied
    assert torch.equal(first.lookup({"shared": ids}, train=False, wire_dtype="fp32")["shared"], torch.full_like(got, -7.0))
    # Clients that diverge under a shared sender are told so; only the first version is applied.
    first.update({"shared": (ids, torch.ones(ids.numel(), 2))}, wire_dtype="fp32", sender="job-merged")
    with pytest.raises(PSRequestError, match="other content"):
        second.update({"shared": (ids, torch.full((ids.numel(), 2), 5.0))}, wire_dtype="fp32", sender="job-merged")
    assert torch.equal(first.lookup({"shared": ids}, train=False, wire_dtype="fp32")["shared"], torch.full_like(got, -8.0))


def test_an_update_numbered_by_its_sender_is_applied_once_from_any_client(ps_cluster, make_client):
    """How an embedding worker started in place of a dead one resends its updates: same sender, same seq_base."""
    first, second = make_client(ps_cluster.addresses), make_client(ps_cluster.addresses)
    first.configure([TableConfig("numbered", 2, optimizer=SGD(lr=1.0), init=Constant(0.0))])
    ids = _ids(300, seed=22)
    first.lookup({"numbered": ids}, train=True)
    keyed = KeyedIds(("numbered",), (ids.numel(),), ids)
    grads = torch.ones(ids.numel() * 2)
    for client in (first, second, first):  # the second client and a second try of the first: duplicates
        client.update_sharded_async(client.shard(keyed), grads, (2,), wire_dtype="fp32", sender="worker-7", seq_base=SEQS_PER_UPDATE).result(30)
    second.update_sharded_async(second.shard(keyed), grads, (2,), wire_dtype="fp32", sender="worker-7", seq_base=2 * SEQS_PER_UPDATE).result(30)
    got = first.lookup({"numbered": ids}, train=False, wire_dtype="fp32")["numbered"]
    assert torch.equal(got, torch.full_like(got, -2.0))  # updates 1 and 2, once each
    with pytest.raises(ValueError, match="seq_base must be >= 1, got 0"):
        first.update_sharded_async(first.shard(keyed), grads, (2,), seq_base=0)


def test_retried_update_is_applied_once(ps_cluster, make_client):
    """The first attempts reach the shard but their answers are lost: the client resends the same seq."""
    lost = {"count": 0}

    class LoseFirstAnswers(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            call = await continuation(details, request)
            if details.method == b"/persia.ParameterServer/Update" and lost["count"] < 2:
                await call  # the shard applied it; its answer is lost on the way back
                lost["count"] += 1
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "answer lost")
            return call

    client = make_client(ps_cluster.addresses, interceptors=[LoseFirstAnswers()], retry=RetryPolicy(backoff_s=0.01))
    client.configure([TableConfig("retry", 2, optimizer=SGD(lr=1.0), init=Constant(0.0))])
    ids = torch.arange(100)
    client.lookup({"retry": ids}, train=True)
    dups = sum(s["server"].get("dedup_duplicates", 0) for s in client.stats())
    client.update({"retry": (ids, torch.ones(100, 2))}, wire_dtype="fp32")
    assert lost["count"] == 2
    got = client.lookup({"retry": ids}, train=False, wire_dtype="fp32")["retry"]
    assert torch.equal(got, torch.full((100, 2), -1.0))
    assert sum(s["server"]["dedup_duplicates"] for s in client.stats()) == dups + 2


def test_unreachable_shard_raises_after_retries(make_client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = make_client([f"127.0.0.1:{port}"], retry=RetryPolicy(max_retries=2, backoff_s=0.01, timeout_s=2))
    with pytest.raises(ShardUnavailableError, match=rf"shard 0 at 127\.0\.0\.1:{port} did not answer after 3 tries"):
        client.lookup({"t": torch.arange(3)}, train=False)
    with pytest.raises(ShardUnavailableError):
        client.wait_healthy(0.5)


def test_a_call_keeps_retrying_for_retry_for_s_and_answers_once_the_shard_is_back(make_client, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = make_client([f"127.0.0.1:{port}"], retry=RetryPolicy(max_retries=0, retry_for_s=1.0, backoff_s=0.01, max_backoff_s=0.05, timeout_s=2))
    started = time.monotonic()
    with pytest.raises(ShardUnavailableError) as info:
        client.stats()
    assert info.value.tries > 2 and 1.0 <= info.value.elapsed_s and time.monotonic() - started < 1.0 + 2 + 0.5, info.value
    assert client.call_budget_s == pytest.approx(1.0 + 0.05 + 2)

    # A shard that starts on that port while the call retries (as a restarted one does) answers it.
    client.retry.retry_for_s = 60.0
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.stats)
        time.sleep(0.5)
        assert not call.done()
        shards = LocalShards(1, extra_args=["--port", str(port)])  # the last --port wins
        try:
            assert call.result(timeout=60)[0]["num_shards"] == 1
        finally:
            shards.stop()


def test_wait_healthy_checks_the_shard_order_and_count(ps_cluster, make_client):
    a0, a1 = ps_cluster.addresses
    make_client([a0, a1]).wait_healthy(10)
    with pytest.raises(PSError) as info:
        make_client([a1, a0]).wait_healthy(10)
    assert str(info.value) == (
        f"the parameter-server addresses do not match the shards: {a1} is shard 1 of 2, listed as shard 0 of 2; {a0} is "
        f"shard 0 of 2, listed as shard 1 of 2. pass the addresses in shard order: {a0}, {a1} (listed: {a1}, {a0})")
    with pytest.raises(PSError, match=rf"{a0} is shard 0 of 2, listed as shard 0 of 1\. the shards answering are part "
                       r"of a cluster of 2 shards, but 1 address is listed: list every shard of the cluster, once each"):
        make_client([a0]).wait_healthy(10)
    with pytest.raises(PSError, match=rf"{a0} is shard 0 of 2, listed as shard 1 of 2\. an address is listed twice"):
        make_client([a0, a0]).wait_healthy(10)
    with pytest.raises(PSError, match=r"cluster of 2 shards, but 3 addresses are listed"):
        make_client([a0, a1, a0]).wait_healthy(10)


def test_wait_healthy_reports_every_shard_that_keeps_it_waiting(ps_cluster, make_client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    silent = f"127.0.0.1:{port}"
    reports: list[ShardWait] = []
    client = make_client([ps_cluster.addresses[0], silent])
    with pytest.raises(ShardUnavailableError, match=rf"shard 1 at 127\.0\.0\.1:{port} did not answer"):
        client.wait_healthy(1.0, on_wait=reports.append, report_every_s=0.3)
    assert {(r.shard, r.address, r.timeout_s) for r in reports} == {(1, silent, 1.0)}  # the healthy shard is not reported
    assert 2 <= len(reports) <= 3
    waits = [r.waited_s for r in reports]
    assert waits == sorted(waits) and waits[0] >= 0.3 and waits[-1] < 1.0
    assert all(r.last_error.startswith("UNAVAILABLE") for r in reports)
    answered: list[ShardWait] = []
    make_client(ps_cluster.addresses).wait_healthy(10, on_wait=answered.append, report_every_s=1.0)
    assert answered == []
    with pytest.raises(ValueError, match="report_every_s must be > 0"):
        client.wait_healthy(1.0, report_every_s=0)


def test_configure_conflict_and_client_side_errors(ps_cluster, make_client):
    client = make_client(ps_cluster.addresses)
    client.configure([TableConfig("conflict", 4)])
    assert client.configure([TableConfig("conflict", 4, optimizer=Adam())])[0].optimizer == TableSettings().optimizer  # the existing (default) one wins
    with pytest.raises(PSRequestError, match="exists with dim 4, asked for dim 5") as info:
        client.configure([TableConfig("conflict", 5)])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValueError, match="ids must be a 1-d int64 tensor"):
        client.lookup({"conflict": torch.zeros(2, 2, dtype=torch.int64)}, train=False)
    with pytest.raises(ValueError, match=r"grads must be a float tensor \[n_ids=2, dim\]"):
        client.update({"conflict": (torch.arange(2), torch.zeros(3, 4))})
    with pytest.raises(ValueError, match="wire_dtype"):
        client.lookup({"conflict": torch.arange(2)}, train=False, wire_dtype="bf16")


def test_close_cancels_calls_in_flight(ps_cluster, make_client):
    client = make_client(ps_cluster.addresses)
    client.configure([TableConfig("closing", 2)])
    futures = [client.lookup_async({"closing": _ids(2000, seed=s)}, train=True) for s in range(20, 30)]
    client.close()
    for future in futures:
        assert future.done()
        assert future.cancelled() or future.result()["closing"].shape[1] == 2
    with pytest.raises(PSError, match="closed"):
        client.lookup({"closing": torch.arange(2)}, train=False)


# Exits with lookups in flight and the client open: its thread is decoding rows (torch ops, GIL released) as the
# interpreter finalizes. Unless the client is closed at exit, that thread is ended by pthread_exit as it takes the
# GIL back, and the unwinding through torch's C++ frames aborts the process (most runs of this script did).
_LEFT_OPEN = textwrap.dedent(
    """\
    import sys, torch
    from lightning_persia.remote_ps.client import PSClient
    from lightning_persia.remote_ps.table_config import TableConfig
    client = PSClient(sys.argv[1:])
    client.configure([TableConfig("left_open", dim=128)])
    ids = {"left_open": torch.arange(50_000)}
    client.lookup(ids, train=True)
    calls = [client.lookup_async(ids, train=False) for _ in range(40)]
    calls[0].result()
    """
)


def test_a_client_left_open_with_calls_in_flight_lets_the_interpreter_exit_cleanly(ps_cluster):
    processes = [subprocess.Popen([sys.executable, "-c", _LEFT_OPEN, *ps_cluster.addresses], stderr=subprocess.PIPE, text=True)
                 for _ in range(3)]
    for process in processes:
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-2000:]


def test_rows_are_decoded_into_a_given_buffer_of_their_size_and_another_is_refused(ps_cluster, make_client):
    from lightning_persia.ops.keyed_ids import KeyedIds

    client = make_client(ps_cluster.addresses)
    client.configure([TableConfig("out_t", 3, init=Constant(0.25))])
    sharded = client.shard(KeyedIds(("out_t",), (4,), torch.tensor([9, 1, 5, 2])))
    out = torch.full((12,), -1.0)
    assert client.lookup_sharded_async(sharded, train=True, wire_dtype="fp32", out=out).result(30) is out
    assert torch.equal(out, torch.full((12,), 0.25))
    with pytest.raises(ValueError, match=r"out must be a flat float32 tensor of 12 values, got torch.float32 \(11,\)"):
        client.lookup_sharded_async(sharded, train=True, out=torch.empty(11)).result(30)
