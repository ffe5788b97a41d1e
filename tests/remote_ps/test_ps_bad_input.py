"""Every malformed request gets the right gRPC status and a message naming the problem; nothing changes.

Requests are built by hand in the client's encoding (every table's ids packed in one buffer) and sent with the
raw stub (the client would refuse most of them before sending).
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import grpc
import pytest
import torch

from lightning_persia.ops import wire
from lightning_persia.ops.shard_map import shard_of
from lightning_persia.remote_ps.protocol import persia_pb2 as pb
from lightning_persia.remote_ps.protocol import persia_pb2_grpc
from lightning_persia.remote_ps.table_config import SGD, Constant, TableConfig

TABLE, OTHER, DIM = "bad_input", "bad_input_other", 4
KNOWN = torch.arange(100)  # admitted before every case
FRESH = torch.arange(1000, 1010)  # never admitted: a training lookup that got through would add them

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def ids(values) -> bytes:
    return wire.encode_ids(torch.as_tensor(values, dtype=torch.int64))


def grads(n: int, dim: int = DIM, dtype: str = "fp32", value: float = 1.0) -> bytes:
    return wire.encode_rows(torch.full((n, dim), value), dtype)


def packed_tables(tables) -> pb.PackedIds:
    """``[(table, id bytes), ...]`` packed as the client packs them (a count per table: its whole ids)."""
    return pb.PackedIds(tables=[t for t, _ in tables], counts=[len(i) // 8 for _, i in tables], ids=b"".join(i for _, i in tables))


def lookup(*tables, train=True, dtype=pb.FP32):
    return "Lookup", pb.LookupRequest(packed=packed_tables(tables), train=train, dtype=dtype)


_SEQ = itertools.count(1)


def update(*tables, client_id="bad-input-test", seq=None):
    """``[(table, id bytes, grad bytes, dtype), ...]`` with one dtype for all, packed as the client packs them."""
    return "Update", pb.UpdateRequest(
        client_id=client_id, seq=next(_SEQ) if seq is None else seq, packed=packed_tables([(t, i) for t, i, _, _ in tables]),
        packed_grads=b"".join(g for _, _, g, _ in tables), packed_dtype=tables[0][3])


def packed(tables, counts, values) -> pb.PackedIds:
    return pb.PackedIds(tables=tables, counts=counts, ids=ids(values))


def packed_lookup(tables, counts, values, **extra):
    return "Lookup", pb.LookupRequest(packed=packed(tables, counts, values), train=True, dtype=pb.FP32, **extra)


def packed_update(tables, counts, values, grad_bytes, dtype=pb.FP32):
    return "Update", pb.UpdateRequest(client_id="bad-input-test", seq=next(_SEQ), packed=packed(tables, counts, values),
                                      packed_grads=grad_bytes, packed_dtype=dtype)


NOT_FOUND, RESOURCE_EXHAUSTED = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED
CASES = {
    "lookup_unknown_table": (lookup(("nope", ids([1]))), NOT_FOUND, "unknown table 'nope'"),
    "lookup_ids_not_multiple_of_8": (lookup((TABLE, b"\x00" * 13)), INVALID, "ids is 13 bytes, not a multiple of 8"),
    "lookup_too_many_ids": (lookup((TABLE, ids(range(4097)))), RESOURCE_EXHAUSTED, "more than 4096 ids"),
    "lookup_too_many_ids_over_tables": (
        lookup((TABLE, ids(range(3000))), (OTHER, ids(range(1100)))), RESOURCE_EXHAUSTED, "more than 4096 ids"),
    "lookup_unknown_dtype": (lookup((TABLE, ids([1])), dtype=7), INVALID, "lookup dtype 7 (unknown) is not one of FP16, FP32"),
    "lookup_table_twice": (lookup((TABLE, ids([1])), (TABLE, ids([2]))), INVALID, "a table appears more than once in one request: ['bad_input']"),
    "lookup_empty_table_name": (lookup(("", ids([1]))), INVALID, "a request names a table with an empty name"),
    "lookup_second_table_unknown": (lookup((TABLE, ids(FRESH)), ("nope", ids([1]))), NOT_FOUND, "unknown table 'nope'"),
    "update_unknown_table": (update(("nope", ids([1]), grads(1), pb.FP32)), NOT_FOUND, "unknown table 'nope'"),
    "update_wrong_dim": (update((TABLE, ids([1, 2, 3]), grads(3, dim=5), pb.FP32)), INVALID,
                         "packed grads hold 15 fp32 values, the ids' counts times their tables' dims ([('bad_input', 3, 4)]) make 12"),
    "update_grads_not_multiple_of_element": (update((TABLE, ids([1]), b"\x00" * 7, pb.FP16)), INVALID,
                                             "grads is 7 bytes, not a multiple of 2 (fp16)"),
    "update_fewer_grads_than_ids": (update((TABLE, ids([1, 2, 3]), grads(2), pb.FP32)), INVALID,
                                    "packed grads hold 8 fp32 values, the ids' counts times their tables' dims ([('bad_input', 3, 4)]) make 12"),
    "update_ids_not_multiple_of_8": (update((TABLE, b"\x01" * 12, grads(1), pb.FP32)), INVALID, "ids is 12 bytes, not a multiple of 8"),
    "update_dtype_unspecified": (update((TABLE, ids([1]), grads(1), pb.WIRE_DTYPE_UNSPECIFIED)), INVALID,
                                 "grads dtype WIRE_DTYPE_UNSPECIFIED is not one of FP16, FP32"),
    "update_unknown_dtype": (update((TABLE, ids([1]), grads(1), 9)), INVALID, "grads dtype 9 (unknown)"),
    "update_fp16_bytes_declared_fp32": (update((TABLE, ids([1, 2]), grads(2, dtype="fp16"), pb.FP32)), INVALID,
                                        "packed grads hold 4 fp32 values, the ids' counts times their tables' dims ([('bad_input', 2, 4)]) make 8"),
    "update_too_many_ids": (update((TABLE, ids(range(5000)), grads(5000), pb.FP32)), RESOURCE_EXHAUSTED, "more than 4096 ids"),
    "update_nan": (update((TABLE, ids([1, 2]), grads(2, value=math.nan), pb.FP32)), INVALID, "NaN or infinity"),
    "update_without_client_id": (update((TABLE, ids([1]), grads(1), pb.FP32), client_id=""), INVALID, "without a client_id"),
    "update_seq_zero": (update((TABLE, ids([1]), grads(1), pb.FP32), seq=0), INVALID, "seq must be >= 1"),
    "update_table_twice": (update((TABLE, ids([1]), grads(1), pb.FP32), (TABLE, ids([2]), grads(1), pb.FP32)), INVALID,
                           "appears more than once"),
    "update_second_table_bad_grads": (
        update((TABLE, ids([1, 2]), grads(2), pb.FP32), (OTHER, ids([1]), grads(1, dim=3), pb.FP32)), INVALID,
        "packed grads hold 11 fp32 values, the ids' counts times their tables' dims ([('bad_input', 2, 4), ('bad_input_other', 1, 2)]) make 10"),
    "update_second_table_nan": (
        update((TABLE, ids([1, 2]), grads(2), pb.FP32), (OTHER, ids([1]), grads(1, dim=2, value=math.inf), pb.FP32)),
        INVALID, "'bad_input_other': gradients contain NaN or infinity"),
    "packed_lookup_counts_do_not_add_up": (packed_lookup([TABLE, OTHER], [2, 2], FRESH[:3]), INVALID,
                                           "packed ids hold 3 ids, their counts [2, 2] add up to 4"),
    "packed_lookup_fewer_counts_than_tables": (packed_lookup([TABLE, OTHER], [3], FRESH[:3]), INVALID,
                                               "packed ids name 2 tables but give 1 counts"),
    "packed_lookup_table_twice": (packed_lookup([TABLE, TABLE], [1, 1], FRESH[:2]), INVALID, "appears more than once"),
    "packed_lookup_unknown_table": (packed_lookup([TABLE, "nope"], [1, 1], FRESH[:2]), NOT_FOUND, "unknown table 'nope'"),
    "packed_lookup_too_many_ids": (packed_lookup([TABLE], [4097], range(4097)), RESOURCE_EXHAUSTED, "more than 4096 ids"),
    "lookup_without_packed_ids": (("Lookup", pb.LookupRequest(train=True)), INVALID, "the request names no tables"),
    "update_without_packed_ids": (("Update", pb.UpdateRequest(client_id="bad-input-test", seq=10**6, packed_dtype=pb.FP32)),
                                  INVALID, "the request names no tables"),
    "packed_update_grads_of_other_dims": (packed_update([TABLE, OTHER], [2, 1], [1, 2, 3], grads(3, dim=4)), INVALID,
                                          "packed grads hold 12 fp32 values, the ids' counts times their tables' dims"),
    "packed_update_dtype_unspecified": (packed_update([TABLE], [1], [1], grads(1), dtype=pb.WIRE_DTYPE_UNSPECIFIED), INVALID,
                                        "packed grads: grads dtype WIRE_DTYPE_UNSPECIFIED is not one of FP16, FP32"),
    "packed_update_second_table_nan": (
        packed_update([TABLE, OTHER], [1, 1], [1, 2], grads(1) + grads(1, dim=2, value=math.nan)), INVALID,
        "'bad_input_other': gradients contain NaN or infinity"),
    "configure_not_json": (("Configure", pb.ConfigureRequest(tables_json=["{nope"])), INVALID, "not valid JSON"),
    "configure_unknown_optimizer": (
        ("Configure", pb.ConfigureRequest(tables_json=[json.dumps({"name": "x", "dim": 2, "optimizer": {"kind": "Lion"}})])),
        INVALID, "unknown optimizer kind 'Lion'"),
    "configure_dim_conflict_in_batch": (
        ("Configure", pb.ConfigureRequest(tables_json=[json.dumps(TableConfig("brand_new", 2).to_dict()),
                                                       json.dumps(TableConfig(TABLE, 9).to_dict())])),
        INVALID, "'bad_input' exists with dim 4, asked for dim 9"),
    "save_relative_directory": (("Save", pb.SaveRequest(directory="relative/dir")), INVALID, "must be an absolute path"),
    "load_missing_checkpoint": (("Load", pb.LoadRequest(directory="/nonexistent/ckpt")), grpc.StatusCode.FAILED_PRECONDITION,
                                "/nonexistent/ckpt"),
}


@pytest.fixture
def shard(ps_cluster1, make_client):
    client = make_client(ps_cluster1.addresses)
    client.configure([TableConfig(TABLE, DIM, optimizer=SGD(lr=1.0)), TableConfig(OTHER, 2, init=Constant(0.5))])
    client.lookup({TABLE: KNOWN, OTHER: KNOWN}, train=True)
    channel = grpc.insecure_channel(ps_cluster1.addresses[0])
    yield client, persia_pb2_grpc.ParameterServerStub(channel)
    channel.close()


def snapshot(client):
    rows = client.lookup({TABLE: torch.cat([KNOWN, FRESH]), OTHER: KNOWN}, train=False, wire_dtype="fp32")
    tables = client.stats()[0]["tables"]
    counts = {name: {k: tables[name][k] for k in ("rows", "inserted", "update_rows")} for name in (TABLE, OTHER)}
    return rows, counts, sorted(client.describe())


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_is_refused_and_changes_nothing(shard, case):
    client, stub = shard
    (method, request), code, message = CASES[case]
    rows, counts, tables = snapshot(client)
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, method)(request, timeout=10)
    assert info.value.code() == code, info.value.details()
    assert message in info.value.details()
    assert info.value.details().startswith("shard 0/1: ")
    rows_after, counts_after, tables_after = snapshot(client)
    assert counts_after == counts and tables_after == tables
    assert all(torch.equal(rows[k], rows_after[k]) for k in rows)


def test_undecodable_message_is_refused_and_the_shard_keeps_serving(shard):
    client, stub = shard
    channel = grpc.insecure_channel(client.addresses[0])
    raw = channel.unary_unary("/persia.ParameterServer/Update")  # no serializers: raw bytes on the wire
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff\xff", timeout=10)
    assert info.value.code() == INVALID
    assert "request bytes are not a valid persia.UpdateRequest message" in info.value.details()
    channel.close()
    rows, _, _ = snapshot(client)
    assert rows[TABLE].shape == (110, DIM)


def test_corrupted_checkpoint_is_refused_and_changes_nothing(shard, tmp_path):
    client, _ = shard
    client.save(tmp_path / "ckpt")
    victim = max(Path(tmp_path / "ckpt").rglob("*.npy"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    client.update({TABLE: (KNOWN, torch.ones(KNOWN.numel(), DIM))})
    rows, counts, tables = snapshot(client)
    with pytest.raises(Exception) as info:
        client.load(tmp_path / "ckpt")
    assert info.value.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS)
    assert victim.name in str(info.value)
    rows_after, counts_after, tables_after = snapshot(client)
    assert counts_after == counts and all(torch.equal(rows[k], rows_after[k]) for k in rows)


def test_id_of_another_shard_is_refused(ps_cluster, make_client):
    client = make_client(ps_cluster.addresses)
    client.configure([TableConfig("ownership", 2, init=Constant(0.0))])
    candidates = torch.arange(64)
    owner = shard_of(candidates, 2)
    mine, foreign = candidates[owner == 0][:3], candidates[owner == 1][:1]
    before = client.stats()[0]["tables"]["ownership"]["rows"]
    with grpc.insecure_channel(ps_cluster.addresses[0]) as channel:
        stub = persia_pb2_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Lookup(pb.LookupRequest(packed=packed(["ownership"], [4], torch.cat([mine, foreign])), train=True))
    assert info.value.code() == INVALID
    assert f"id {int(foreign[0])} belongs to shard 1" in info.value.details()
    assert client.stats()[0]["tables"]["ownership"]["rows"] == before


def test_same_update_sent_twice_is_applied_once(ps_cluster1, make_client):
    client = make_client(ps_cluster1.addresses)
    client.configure([TableConfig("twice", 2, optimizer=SGD(lr=1.0), init=Constant(0.0))])
    client.lookup({"twice": torch.tensor([1, 2, 3])}, train=True)
    request = pb.UpdateRequest(client_id="twice-client", seq=7, packed=packed(["twice"], [3], [1, 2, 3]),
                               packed_grads=grads(3, dim=2), packed_dtype=pb.FP32)
    with grpc.insecure_channel(ps_cluster1.addresses[0]) as channel:
        stub = persia_pb2_grpc.ParameterServerStub(channel)
        first, second = stub.Update(request), stub.Update(request)
        other_client = stub.Update(pb.UpdateRequest(client_id="another-client", seq=7, packed=request.packed,
                                                    packed_grads=request.packed_grads, packed_dtype=request.packed_dtype))
    assert (first.rows_applied, first.duplicate) == (3, False)
    assert (second.rows_applied, second.duplicate) == (3, True)
    assert not other_client.duplicate
    rows = client.lookup({"twice": torch.tensor([1, 2, 3])}, train=False, wire_dtype="fp32")["twice"]
    assert torch.equal(rows, torch.full((3, 2), -2.0))  # once per client
