"""Fuzzing of a shard's RPCs: random bytes, mutated and malformed protobufs, huge counts, odd sizes, unknown tables.

:func:`fuzz_cases` is a Hypothesis strategy of ``(method, request bytes, label)``; :class:`FuzzTarget` sends them
raw (no client-side validation) and checks each answer: a clear status (never INTERNAL or UNKNOWN, never
a hang), a message for every refusal, and at the end the *sentinel* table's rows unchanged and the shard
alive. Used by ``tests/remote_ps/test_ps_fuzz.py`` (a fast subset) and ``benchmarks/fuzz_ps.py``.

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
from hypothesis import strategies as st

from lightning_persia.ops import wire
from lightning_persia.remote_ps.protocol import persia_pb2 as pb
from lightning_persia.remote_ps.protocol import SERVICE_NAME

SENTINEL = "fuzz_sentinel"
FUZZ_TABLES = ["fuzz_t4", "fuzz_t16"]  # created before fuzzing, dims 4 and 16
METHODS = ["Lookup", "Update", "Configure", "Describe", "Save", "Load", "Stats", "SaveDelta", "StageDelta", "CommitDelta"]
# What a refusal may answer; anything else (INTERNAL, UNKNOWN, DEADLINE_EXCEEDED = a hang) is a finding.
ACCEPTED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
}

_names = st.one_of(
    st.sampled_from(FUZZ_TABLES + ["", "nope", "x" * 300, "fuzz_\x00nul", "fuzz_\u00e9\u4e2d", "../etc/passwd"]),
    st.text(alphabet="abc_", min_size=1, max_size=6).map(lambda s: "fz_" + s),  # few distinct new tables
)
_int64 = st.integers(-(1 << 63), (1 << 63) - 1)
_id_bytes = st.one_of(
    st.lists(_int64, max_size=64).map(lambda xs: struct.pack(f"<{len(xs)}q", *xs)),
    st.binary(max_size=200),  # often not a multiple of 8
    st.one_of(st.sampled_from([4096, 4097, 5000]), st.integers(0, 5000)).map(lambda n: struct.pack("<q", 7) * n),  # > max_ids_per_request
)
_dtypes = st.one_of(st.sampled_from([0, 1, 2]), st.integers(-(1 << 31), (1 << 31) - 1))
_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1.0, -1e30]))


@st.composite
def _grad_bytes(draw, n_ids: int) -> bytes:
    kind = draw(st.sampled_from(["fp32_rows", "fp16_rows", "random", "empty"]))
    if kind == "random":
        return draw(st.binary(max_size=400))
    if kind == "empty":
        return b""
    dim = draw(st.sampled_from([1, 4, 5, 16]))
    value = draw(_floats)
    rows = torch.full((n_ids, dim), value)
    return wire.encode_rows(rows, "fp32" if kind == "fp32_rows" else "fp16")


@st.composite
def _lookup(draw) -> bytes:
    request = pb.LookupRequest(train=draw(st.booleans()), dtype=draw(_dtypes))
    for _ in range(draw(st.integers(0, 4))):
        request.tables.add(table=draw(_names), ids=draw(_id_bytes))
    return request.SerializeToString()


@st.composite
def _update(draw) -> bytes:
    request = pb.UpdateRequest(
        client_id=draw(st.one_of(st.sampled_from(["fuzz", ""]), st.text(max_size=2000))),
        seq=draw(st.one_of(st.integers(0, 3), st.integers(0, (1 << 64) - 1))),
    )
    for _ in range(draw(st.integers(0, 4))):
        ids = draw(_id_bytes)
        n = len(ids) // 8 if draw(st.booleans()) else draw(st.integers(0, 70))
        request.tables.add(table=draw(_names), ids=ids, grads=draw(_grad_bytes(n)), dtype=draw(_dtypes))
    return request.SerializeToString()


_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))


@st.composite
def _table_json(draw) -> str:
    kind = draw(st.sampled_from(["config", "junk", "not_json", "not_object"]))
    if kind == "not_json":
        return draw(st.text(max_size=100))
    if kind == "not_object":
        return json.dumps(draw(st.lists(_json_scalars, max_size=3)))
    if kind == "junk":
        return json.dumps(draw(st.dictionaries(st.text(max_size=12), _json_scalars, max_size=6)))
    config = {"name": draw(_names), "dim": draw(st.one_of(st.sampled_from([4, 16, 0, -1, 65536, 65537, 1 << 40]), _json_scalars))}
    for key, values in (
        ("capacity", st.one_of(st.sampled_from([1, 1000, 0, -5, (1 << 31), 1 << 62]), _json_scalars)),
        ("eviction", st.sampled_from(["lru", "lfu", "fifo", 3])),
        ("admit_probability", st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0]), _json_scalars)),
        ("weight_bound", st.one_of(st.none(), st.sampled_from([1.0, 0.0, -1.0]))),
        ("optimizer", st.one_of(
            st.fixed_dictionaries({"kind": st.sampled_from(["SGD", "Adagrad", "Adam", "Lion"]), "lr": _json_scalars}),
            _json_scalars)),
        ("init", st.one_of(
            st.fixed_dictionaries({"kind": st.sampled_from(["Uniform", "Normal", "Constant", "Eval"]),
                                   "low": _json_scalars}), _json_scalars)),
        ("extra_field", _json_scalars),
    ):
        if draw(st.booleans()):
            config[key] = draw(values)
    return json.dumps(config)


@st.composite
def _configure(draw) -> bytes:
    return pb.ConfigureRequest(tables_json=draw(st.lists(_table_json(), max_size=3))).SerializeToString()


@st.composite
def _describe(draw) -> bytes:
    return pb.DescribeRequest(names=draw(st.lists(_names, max_size=3))).SerializeToString()


def _paths(scratch: str):
    return st.one_of(
        st.sampled_from(["", "relative/dir", ".", f"{scratch}/nonexistent", "/dev/null", "/proc/self", "/"]),
        st.text(max_size=40),  # Load only: an absolute one that exists holds no checkpoint
        st.text(alphabet="abc/", max_size=12).map(lambda s: f"{scratch}/missing/{s}"),
    )


def _save_directories(scratch: str):
    # never an arbitrary absolute path: a Save there would really write (and a later Load would succeed)
    return st.one_of(
        st.sampled_from(["", "relative/dir", ".", "/dev/null", "/proc/self"]),
        st.text(max_size=40).filter(lambda p: not p.startswith("/")),
        st.text(alphabet="abc", min_size=1, max_size=4).map(lambda s: f"{scratch}/save_{s}"),
    )


@st.composite
def _save(draw, scratch: str) -> bytes:
    return pb.SaveRequest(directory=draw(_save_directories(scratch)), save_id=draw(st.text(max_size=20))).SerializeToString()


_versions = st.one_of(st.integers(0, 3), st.integers(0, (1 << 64) - 1))


@st.composite
def _save_delta(draw, scratch: str) -> bytes:
    return pb.SaveDeltaRequest(directory=draw(_save_directories(scratch)), save_id=draw(st.text(max_size=20)),
                               base_id=draw(st.text(max_size=20))).SerializeToString()


@st.composite
def _stage_delta(draw, scratch: str) -> bytes:
    return pb.StageDeltaRequest(directory=draw(_paths(scratch)), version=draw(_versions), base_version=draw(_versions)).SerializeToString()


@st.composite
def _load(draw, scratch: str) -> bytes:
    return pb.LoadRequest(directory=draw(_paths(scratch))).SerializeToString()


@st.composite
def _mutated(draw, scratch: str) -> tuple[str, bytes]:
    method = draw(st.sampled_from(["Lookup", "Update", "Configure", "Describe", "Stats"]))
    base = draw({"Lookup": _lookup(), "Update": _update(), "Configure": _configure(), "Describe": _describe(),
                 "Stats": st.just(b"")}[method])
    data = bytearray(base)
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


def fuzz_cases(scratch: str):
    """Strategy of ``(method, request bytes, label)``; Save only writes under ``scratch`` (an absolute path)."""
    return st.one_of(
        st.tuples(st.sampled_from(METHODS), st.binary(max_size=512), st.just("random_bytes")),
        _mutated(scratch).map(lambda mb: (mb[0], mb[1], "mutated")),
        _lookup().map(lambda b: ("Lookup", b, "lookup")),
        _update().map(lambda b: ("Update", b, "update")),
        _configure().map(lambda b: ("Configure", b, "configure")),
        _describe().map(lambda b: ("Describe", b, "describe")),
        _save(scratch).map(lambda b: ("Save", b, "save")),
        _load(scratch).map(lambda b: ("Load", b, "load")),
        _save_delta(scratch).map(lambda b: ("SaveDelta", b, "save_delta")),
        _stage_delta(scratch).map(lambda b: ("StageDelta", b, "stage_delta")),
        _versions.map(lambda v: ("CommitDelta", pb.CommitDeltaRequest(version=v).SerializeToString(), "commit_delta")),
    )


class FuzzTarget:
    """Sends raw request bytes to one shard and keeps the tally; :meth:`check_intact` compares the sentinel."""

    def __init__(self, address: str, timeout_s: float = 10.0, token: Optional[str] = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
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

        with PSClient([self.address], token=self._token()) as client:
            client.configure([TableConfig(SENTINEL, 8, optimizer=Adam(lr=0.01), init=Normal(std=0.1)),
                              TableConfig(FUZZ_TABLES[0], 4, optimizer=SGD(lr=0.1)),
                              TableConfig(FUZZ_TABLES[1], 16, optimizer=Adam(lr=0.1), capacity=5000)])
            client.lookup({SENTINEL: self.sentinel_ids}, train=True)
            client.update({SENTINEL: (self.sentinel_ids, torch.randn(self.sentinel_ids.numel(), 8))}, wire_dtype="fp32")
            self._sentinel_rows, self._sentinel_stats = self._sentinel(client)

    def _token(self) -> Optional[str]:
        return self.metadata[0][1].split(" ", 1)[1] if self.metadata else None

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
        with PSClient([self.address], token=self._token()) as client:
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

