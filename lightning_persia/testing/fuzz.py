"""Fuzzing of a shard's RPCs: random bytes, mutated and malformed protobufs, huge counts, odd sizes, unknown tables.

:func:`fuzz_cases` is a Hypothesis strategy of ``(method, request bytes, label)``; :class:`FuzzTarget` sends them
raw (no client-side validation) and checks each answer: a clear status (never INTERNAL or UNKNOWN, never
a hang), a message for every refusal, and at the end the *sentinel* table's rows unchanged and the shard
alive. Used by ``tests/remote_ps/test_ps_fuzz.py`` (a fast subset) and ``tools/fuzz_ps.py``.

Hypothesis comes with the ``test`` extra only: :func:`fuzz_cases` imports it when called, so this module
imports without it. Each strategy below is a function of ``(draw, st)``, made a Hypothesis strategy there.

Cases never name the sentinel table and never Load a real checkpoint (Load replaces every table by design);
Save only writes under the given scratch folder.
"""
from __future__ import annotations

import collections
import json
import struct
import time
from typing import Optional

import grpc
import torch

from lightning_persia.ops import wire
from lightning_persia.remote_ps.protocol import SERVICE, SERVICE_NAME, bearer_metadata
from lightning_persia.remote_ps.protocol import persia_pb2 as pb

SENTINEL = "fuzz_sentinel"
FUZZ_TABLES = ["fuzz_t4", "fuzz_t16"]  # created before fuzzing, dims 4 and 16
METHODS = [method.name for method in SERVICE.methods]
# What a refusal may answer; anything else (INTERNAL, UNKNOWN, DEADLINE_EXCEEDED = a hang) is a finding.
ACCEPTED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
}


def fuzz_cases(scratch: str):
    """Strategy of ``(method, request bytes, label)``; Save only writes under ``scratch`` (an absolute path)."""
    try:
        from hypothesis import strategies as st
    except ImportError as err:
        raise ImportError("fuzz_cases needs hypothesis, which the test extra installs: pip install 'lightning-persia[test]'") from err

    def case(function, *args):
        return st.composite(function)(st, *args)

    versions = _versions(st)
    return st.one_of(
        st.tuples(st.sampled_from(METHODS), st.binary(max_size=512), st.just("random_bytes")),
        case(_mutated).map(lambda mb: (mb[0], mb[1], "mutated")),
        case(_lookup).map(lambda b: ("Lookup", b, "lookup")),
        case(_update).map(lambda b: ("Update", b, "update")),
        case(_configure).map(lambda b: ("Configure", b, "configure")),
        case(_describe).map(lambda b: ("Describe", b, "describe")),
        case(_save, scratch).map(lambda b: ("Save", b, "save")),
        case(_load, scratch).map(lambda b: ("Load", b, "load")),
        case(_save_delta, scratch).map(lambda b: ("SaveDelta", b, "save_delta")),
        case(_stage_delta, scratch).map(lambda b: ("StageDelta", b, "stage_delta")),
        versions.map(lambda v: ("CommitDelta", pb.CommitDeltaRequest(version=v).SerializeToString(), "commit_delta")),
    )


# ---- the pieces of requests ------------------------------------------------------------------------------


def _names(st):
    return st.one_of(
        st.sampled_from(FUZZ_TABLES + ["", "nope", "x" * 300, "fuzz_\x00nul", "fuzz_\u00e9\u4e2d", "../etc/passwd"]),
        st.text(alphabet="abc_", min_size=1, max_size=6).map(lambda s: "fz_" + s),  # few distinct new tables
    )


def _id_bytes(st):
    int64 = st.integers(-(1 << 63), (1 << 63) - 1)
    return st.one_of(
        st.lists(int64, max_size=64).map(lambda xs: struct.pack(f"<{len(xs)}q", *xs)),
        st.binary(max_size=200),  # often not a multiple of 8
        st.one_of(st.sampled_from([4096, 4097, 5000]), st.integers(0, 5000)).map(lambda n: struct.pack("<q", 7) * n),  # > max_ids_per_request
    )


def _dtypes(st):
    return st.one_of(st.sampled_from([0, 1, 2]), st.integers(-(1 << 31), (1 << 31) - 1))


def _versions(st):
    return st.one_of(st.integers(0, 3), st.integers(0, (1 << 64) - 1))


def _packed(draw, st) -> Optional[pb.PackedIds]:
    """The packed ids of a request: counts that match the ids or not, as many as the tables or not; or none."""
    if draw(st.integers(0, 9)) == 0:
        return None
    tables = draw(st.lists(_names(st), max_size=4))
    data = draw(_id_bytes(st))
    if draw(st.booleans()):  # counts that add up to the ids there are
        n = len(data) // 8
        cuts = sorted(draw(st.lists(st.integers(0, n), min_size=max(0, len(tables) - 1), max_size=max(0, len(tables) - 1))))
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, n])] if tables else []
    else:
        counts = draw(st.lists(st.one_of(st.integers(0, 70), st.integers(0, (1 << 64) - 1)), max_size=5))
    return pb.PackedIds(tables=tables, counts=counts, ids=data)


def _grad_bytes(draw, st, values: int) -> bytes:
    kind = draw(st.sampled_from(["fp32_rows", "fp16_rows", "random", "empty"]))
    if kind == "random":
        return draw(st.binary(max_size=400))
    if kind == "empty":
        return b""
    dim = draw(st.sampled_from([1, 4, 5, 16]))
    value = draw(st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1.0, -1e30])))
    return wire.encode_rows(torch.full((min(values, 1 << 16), dim), value), "fp32" if kind == "fp32_rows" else "fp16")


def _lookup(draw, st) -> bytes:
    request = pb.LookupRequest(train=draw(st.booleans()), dtype=draw(_dtypes(st)))
    packed = _packed(draw, st)
    if packed is not None:
        request.packed.CopyFrom(packed)
    return request.SerializeToString()


def _update(draw, st) -> bytes:
    request = pb.UpdateRequest(
        client_id=draw(st.one_of(st.sampled_from(["fuzz", ""]), st.text(max_size=2000))),
        seq=draw(st.one_of(st.integers(0, 3), st.integers(0, (1 << 64) - 1))),
        packed_dtype=draw(_dtypes(st)),
    )
    packed = _packed(draw, st)
    if packed is not None:
        request.packed.CopyFrom(packed)
        ids = len(packed.ids) // 8 if draw(st.booleans()) else draw(st.integers(0, 70))
        request.packed_grads = _grad_bytes(draw, st, ids)
    return request.SerializeToString()


def _table_json(draw, st) -> str:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=False, allow_infinity=False),
                        st.text(max_size=20))
    kind = draw(st.sampled_from(["config", "junk", "not_json", "not_object"]))
    if kind == "not_json":
        return draw(st.text(max_size=100))
    if kind == "not_object":
        return json.dumps(draw(st.lists(scalars, max_size=3)))
    if kind == "junk":
        return json.dumps(draw(st.dictionaries(st.text(max_size=12), scalars, max_size=6)))
    config = {"name": draw(_names(st)), "dim": draw(st.one_of(st.sampled_from([4, 16, 0, -1, 65536, 65537, 1 << 40]), scalars))}
    for key, values in (
        ("capacity", st.one_of(st.sampled_from([1, 1000, 0, -5, (1 << 31), 1 << 62]), scalars)),
        ("eviction", st.sampled_from(["lru", "lfu", "fifo", 3])),
        ("admit_probability", st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0]), scalars)),
        ("weight_bound", st.one_of(st.none(), st.sampled_from([1.0, 0.0, -1.0]))),
        ("optimizer", st.one_of(
            st.fixed_dictionaries({"kind": st.sampled_from(["SGD", "Adagrad", "Adam", "Lion"]), "lr": scalars}), scalars)),
        ("init", st.one_of(
            st.fixed_dictionaries({"kind": st.sampled_from(["Uniform", "Normal", "Constant", "Eval"]), "low": scalars}), scalars)),
        ("extra_field", scalars),
    ):
        if draw(st.booleans()):
            config[key] = draw(values)
    return json.dumps(config)


def _configure(draw, st) -> bytes:
    return pb.ConfigureRequest(tables_json=[_table_json(draw, st) for _ in range(draw(st.integers(0, 3)))]).SerializeToString()


def _describe(draw, st) -> bytes:
    return pb.DescribeRequest(names=draw(st.lists(_names(st), max_size=3))).SerializeToString()


def _paths(st, scratch: str):
    return st.one_of(
        st.sampled_from(["", "relative/dir", ".", f"{scratch}/nonexistent", "/dev/null", "/proc/self", "/"]),
        st.text(max_size=40),  # Load only: an absolute one that exists holds no checkpoint
        st.text(alphabet="abc/", max_size=12).map(lambda s: f"{scratch}/missing/{s}"),
    )


def _save_directories(st, scratch: str):
    # never an arbitrary absolute path: a Save there would really write (and a later Load would succeed)
    return st.one_of(
        st.sampled_from(["", "relative/dir", ".", "/dev/null", "/proc/self"]),
        st.text(max_size=40).filter(lambda p: not p.startswith("/")),
        st.text(alphabet="abc", min_size=1, max_size=4).map(lambda s: f"{scratch}/save_{s}"),
    )


def _save(draw, st, scratch: str) -> bytes:
    return pb.SaveRequest(directory=draw(_save_directories(st, scratch)), save_id=draw(st.text(max_size=20))).SerializeToString()


def _save_delta(draw, st, scratch: str) -> bytes:
    return pb.SaveDeltaRequest(directory=draw(_save_directories(st, scratch)), save_id=draw(st.text(max_size=20)),
                               base_id=draw(st.text(max_size=20))).SerializeToString()


def _stage_delta(draw, st, scratch: str) -> bytes:
    return pb.StageDeltaRequest(directory=draw(_paths(st, scratch)), version=draw(_versions(st)),
                                base_version=draw(_versions(st))).SerializeToString()


def _load(draw, st, scratch: str) -> bytes:
    return pb.LoadRequest(directory=draw(_paths(st, scratch))).SerializeToString()


def _mutated(draw, st) -> tuple[str, bytes]:
    builders = {"Lookup": _lookup, "Update": _update, "Configure": _configure, "Describe": _describe}
    method = draw(st.sampled_from([*builders, "Stats"]))
    data = bytearray(builders[method](draw, st) if method in builders else b"")
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "varint"]))
        position = draw(st.integers(0, max(0, len(data))))
        if op == "flip" and data:
            data[min(position, len(data) - 1)] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[position:position + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[position:]
        elif op == "varint":  # a length-delimited field claiming a huge (or overflowing) size
            data[position:position] = bytes([0x12]) + b"\xff" * draw(st.integers(1, 11)) + b"\x01"
    return method, bytes(data)


class FuzzTarget:
    """Sends raw request bytes to one shard and keeps the tally; :meth:`check_intact` compares the sentinel."""

    def __init__(self, address: str, timeout_s: float = 10.0, token: Optional[str] = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.token = token
        self.metadata = bearer_metadata(token) or None
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20),
                                                               ("grpc.max_receive_message_length", 64 << 20)])
        self.calls = {m: self.channel.unary_unary(f"/{SERVICE_NAME}/{m}") for m in METHODS}
        self.tally: collections.Counter = collections.Counter()
        self.findings: list[str] = []
        self.cases = 0
        self.slowest_s = 0.0
        self.sentinel_ids = torch.arange(-500, 500) * 7919
        self._sentinel_rows: Optional[torch.Tensor] = None
        self._sentinel_stats: Optional[dict] = None

    def prepare(self) -> None:
        """Creates the fuzz tables and the sentinel (trained a little), and records the sentinel's state."""
        from lightning_persia.remote_ps.client import PSClient
        from lightning_persia.remote_ps.table_config import Adam, Normal, SGD, TableConfig

        with PSClient([self.address], token=self.token) as client:
            client.configure([TableConfig(SENTINEL, 8, optimizer=Adam(lr=0.01), init=Normal(std=0.1)),
                              TableConfig(FUZZ_TABLES[0], 4, optimizer=SGD(lr=0.1)),
                              TableConfig(FUZZ_TABLES[1], 16, optimizer=Adam(lr=0.1), capacity=5000)])
            client.lookup({SENTINEL: self.sentinel_ids}, train=True)
            client.update({SENTINEL: (self.sentinel_ids, torch.randn(self.sentinel_ids.numel(), 8))}, wire_dtype="fp32")
            self._sentinel_rows, self._sentinel_stats = self._sentinel(client)

    def _sentinel(self, client) -> tuple[torch.Tensor, dict]:
        rows = client.lookup({SENTINEL: self.sentinel_ids}, train=False, wire_dtype="fp32")[SENTINEL]
        stats = {k: v for k, v in client.stats()[0]["tables"][SENTINEL].items() if k in ("rows", "updates", "update_rows", "inserted", "evicted")}
        return rows, stats

    def send(self, method: str, data: bytes, label: str) -> grpc.StatusCode:
        self.cases += 1
        started = time.monotonic()
        try:
            self.calls[method](data, timeout=self.timeout_s, metadata=self.metadata)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""
        elapsed = time.monotonic() - started
        self.slowest_s = max(self.slowest_s, elapsed)
        self.tally[(method, code.name)] += 1
        if code not in ACCEPTED:
            self.findings.append(f"{label} {method} ({len(data)} bytes {data[:60]!r}...): {code.name}: {details}")
        elif code != grpc.StatusCode.OK and not details.strip():
            self.findings.append(f"{label} {method}: {code.name} without a message")
        return code

    def check_intact(self) -> None:
        """Raises AssertionError when the shard is not serving or the sentinel's rows or counters changed."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from lightning_persia.remote_ps.client import PSClient

        status = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
        assert status.status == health_pb2.HealthCheckResponse.SERVING, status
        with PSClient([self.address], token=self.token) as client:
            rows, stats = self._sentinel(client)
        assert self._sentinel_rows is not None
        assert torch.equal(rows, self._sentinel_rows), "the sentinel table's rows changed"
        assert stats == self._sentinel_stats, f"the sentinel table's counters changed: {self._sentinel_stats} -> {stats}"

    def summary(self) -> str:
        by_method: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for (method, code), count in self.tally.items():
            by_method[method][code] += count
        lines = [f"{'method':<10} {'cases':>6}  statuses"]
        for method in METHODS:
            counts = by_method.get(method, {})
            lines.append(f"{method:<10} {sum(counts.values()):>6}  " + ", ".join(f"{c}={n}" for c, n in sorted(counts.items())))
        lines.append(f"total {self.cases} cases; slowest answer {self.slowest_s * 1e3:.0f} ms; findings: {len(self.findings)}")
        return "\n".join(lines)

    def close(self) -> None:
        self.channel.close()

