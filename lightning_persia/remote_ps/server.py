"""One parameter-server shard: a gRPC servicer over :class:`ShardStore`, and the process around it.

- :class:`PSServicer` validates every request before it touches the store and answers bad input with a gRPC
  status whose message names the problem; the shard keeps serving and its data is unchanged.
- :class:`ShardServer` binds the servicer and the standard health service, with a token and/or TLS when
  asked; :func:`check_bind_security` refuses a non-loopback address that has neither (nor ``insecure``).
  With ``metrics_port`` set it also serves Prometheus metrics (``remote_ps/metrics.py``).
- :func:`run_shard` is the ``lightning-persia ps serve`` process: prints ``PERSIA_PS_LISTENING host:port``
  (after ``PERSIA_PS_METRICS <url>`` when it serves metrics),
  stops gracefully on SIGTERM/SIGINT, and exits when its parent dies (``parent_pid``).
- :class:`LocalShards` starts N shard processes on loopback and stops them (tests, benchmarks, embedded use).

This module never imports Lightning.
"""
from __future__ import annotations

import collections
import ctypes
import functools
import hmac
import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
import zlib
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, MutableSequence, Optional, Sequence

import grpc
import torch
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lightning_persia.ops import native, wire
from lightning_persia.remote_ps.allocator import keep_freed_memory
from lightning_persia.remote_ps.config import PSConfig
from lightning_persia.remote_ps.gc_freeze import freeze_startup_objects
from lightning_persia.remote_ps import metrics
from lightning_persia.remote_ps.exactly_once import ConflictingDuplicateError, StaleSequenceError, UpdateDeduplicator
from lightning_persia.remote_ps.protocol import SERVICE_NAME, persia_pb2, persia_pb2_grpc
from lightning_persia.remote_ps.served_version import DeltaOrderError, ServedVersion
from lightning_persia.remote_ps.store import CheckpointError, InvalidRequestError, ShardStore, StoreError, UnknownTableError
from lightning_persia.remote_ps.table_config import ConfigError, TableConfig

log = logging.getLogger("lightning_persia.ps")

LISTENING_PREFIX = "PERSIA_PS_LISTENING"
METRICS_PREFIX = "PERSIA_PS_METRICS"  # the line before LISTENING_PREFIX's, with the URL of /metrics
AUTH_METADATA_KEY = "authorization"
INCARNATION_METADATA_KEY = "persia-incarnation"
# Calls that must never land on a restarted shard without the caller knowing (they read or write rows that a
# restart may have lost or rolled back). The others are safe whatever the shard's history.
FENCED_METHODS = frozenset({"Lookup", "Update", "Save", "SaveDelta"})
_DELAYED_METHODS = frozenset({"Lookup", "Update"})

# Wire dtype enum -> codec name. Lookup treats UNSPECIFIED as fp16 (the default); Update refuses it.
_DTYPE_NAMES = {persia_pb2.FP16: "fp16", persia_pb2.FP32: "fp32"}


class BindSecurityError(ValueError):
    """A non-loopback bind address without a token, TLS or an explicit ``insecure``."""


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


def check_bind_security(host: str, *, token: Optional[str], tls: bool, insecure: bool) -> None:
    """Raises :class:`BindSecurityError` unless ``host`` is loopback or the shard is protected (or ``insecure``)."""
    if is_loopback_host(host) or token or tls or insecure:
        return
    raise BindSecurityError(
        f"refusing to serve on non-loopback address {host!r} without protection: anyone who can reach it could "
        "read and overwrite the embedding tables. Pass --token T (clients send 'authorization: Bearer T'), "
        "--tls-cert/--tls-key (and optionally --tls-client-ca), or --insecure to accept the risk"
    )


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


# ---- the servicer --------------------------------------------------------------------------------------


class _Abort(Exception):
    """A request refused before it reached the store."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> _Abort:
    return _Abort(grpc.StatusCode.INVALID_ARGUMENT, message)


def _read_only(what: str) -> _Abort:
    return _Abort(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"{what} refused: this shard serves in read-only mode (an inference shard, started with --read-only); "
        "it answers lookups only",
    )


_STORE_CODES = (
    (UnknownTableError, grpc.StatusCode.NOT_FOUND),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (CheckpointError, grpc.StatusCode.FAILED_PRECONDITION),
    (StoreError, grpc.StatusCode.INTERNAL),
)


@dataclass
class _Undecodable:
    """Stands for a request whose bytes are not a valid message of its type."""

    message_type: str
    error: str


def _tolerant_parser(message_class) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as err:
            return _Undecodable(message_class.DESCRIPTOR.full_name, str(err))

    return parse


def _rpc(method: Callable) -> Callable:
    """Counts the call and turns every refusal or failure into a gRPC status with its message."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: "PSServicer", request, context: grpc.ServicerContext):
        self._count(name)
        try:
            if self.config.fault_delay_s and name in _DELAYED_METHODS:
                time.sleep(self.config.fault_delay_s)
            if name in FENCED_METHODS:
                self._check_incarnation(context)
            if isinstance(request, _Undecodable):
                raise _invalid(f"request bytes are not a valid {request.message_type} message ({request.error})")
            return method(self, request, context)
        except _Abort as err:
            code, message = err.code, str(err)
        except StoreError as err:
            code = next(c for cls, c in _STORE_CODES if isinstance(err, cls))
            message = str(err)
        except (ConfigError, wire.WireFormatError) as err:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(err)
        except (StaleSequenceError, ConflictingDuplicateError, DeltaOrderError) as err:
            code, message = grpc.StatusCode.FAILED_PRECONDITION, str(err)
        except Exception as err:  # a bug: keep serving, tell the caller, keep the traceback in the log
            log.exception("%s failed", name)
            code, message = grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}"
        self._count(f"{name}_errors")
        context.abort(code, f"shard {self.store.shard_index}/{self.store.num_shards}: {message}")

    return wrapper


@dataclass
class _TableRequest:
    name: str
    dim: int
    ids: torch.Tensor
    grads: Optional[torch.Tensor] = None


class PSServicer(persia_pb2_grpc.ParameterServerServicer):
    """The ``persia.ParameterServer`` service of one shard."""

    def add_to_server(self, server: grpc.Server) -> None:
        """Registers every RPC of the service, like the generated ``add_ParameterServerServicer_to_server``,
        but with request parsing that answers undecodable bytes with INVALID_ARGUMENT instead of INTERNAL."""
        handlers = {}
        for method in persia_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                getattr(self, method.name),
                request_deserializer=_tolerant_parser(getattr(persia_pb2, method.input_type.name)),
                response_serializer=getattr(persia_pb2, method.output_type.name).SerializeToString,
            )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        server.add_registered_method_handlers(SERVICE_NAME, handlers)

    def __init__(self, store: ShardStore, config: PSConfig, model_version: int = 0) -> None:
        self.store = store
        self.config = config
        self.served = ServedVersion(store, model_version)
        self.watching_deltas: Optional[str] = None  # the folder of deltas this shard applies on its own, if any
        self.max_message_bytes = config.max_message_mb << 20
        self.dedup = UpdateDeduplicator(config.dedup_window, config.dedup_max_clients)
        self._counters: collections.Counter[str] = collections.Counter()
        self._counter_lock = threading.Lock()
        # New in every process (and every servicer): a client that saw another one talks to a restarted shard.
        self.incarnation = uuid.uuid4().hex[:16]
        self.started_at = time.time()
        self.restored_from: Optional[str] = None

    def _check_incarnation(self, context) -> None:
        for key, value in context.invocation_metadata() or ():
            if key == INCARNATION_METADATA_KEY:
                expected = value.decode(errors="replace") if isinstance(value, bytes) else value
                if expected != self.incarnation:
                    restored = f", restored from {self.restored_from}" if self.restored_from else ", with empty tables"
                    raise _Abort(
                        grpc.StatusCode.ABORTED,
                        f"shard restarted: the caller knew incarnation {expected!r}, this process is incarnation "
                        f"{self.incarnation!r} (started {time.time() - self.started_at:.1f} s ago{restored}); rows "
                        "written since the last checkpoint may be lost. Roll back to a checkpoint, then refresh the "
                        "client's incarnations (PSClient.wait_healthy)",
                    )
                return

    def _count(self, key: str, amount: int = 1) -> None:
        with self._counter_lock:
            self._counters[key] += amount

    # ---- validation (nothing here touches the rows) -------------------------------------------------

    def _dim(self, name: str) -> int:
        if not name:
            raise _invalid("a table entry has an empty table name")
        return self.store.describe(name).dim  # UnknownTableError -> NOT_FOUND

    def _parse(self, request, with_grads: bool) -> list[_TableRequest]:
        """The tables of a Lookup or Update request, given one entry per table or packed."""
        if not request.HasField("packed"):
            return self._parse_entries(request.tables, with_grads)
        if len(request.tables):
            raise _invalid("a request carries its tables either as entries (`tables`) or packed (`packed`), not both")
        return self._parse_packed(request, with_grads)

    def _check_total(self, total: int) -> None:
        if total > self.config.max_ids_per_request:
            raise _Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request carries more than {self.config.max_ids_per_request} ids (max_ids_per_request); split it",
            )

    def _grads_dtype(self, name: str, value: int) -> str:
        dtype = _DTYPE_NAMES.get(value)
        if dtype is None:
            raise _invalid(f"{name}: grads dtype {_dtype_label(value)} is not one of FP16, FP32")
        return dtype

    def _parse_entries(self, entries, with_grads: bool) -> list[_TableRequest]:
        parsed: list[_TableRequest] = []
        seen: set[str] = set()
        total = 0
        for entry in entries:
            name = entry.table
            if name in seen:
                raise _invalid(f"table {name!r} appears more than once in one request")
            seen.add(name)
            dim = self._dim(name)
            ids = wire.decode_ids(entry.ids, what=f"table {name!r}: ids")
            total += ids.numel()
            self._check_total(total)
            item = _TableRequest(name, dim, ids)
            if with_grads:
                dtype = self._grads_dtype(f"table {name!r}", entry.dtype)
                grads = wire.rows_view(entry.grads, dtype, dim, what=f"table {name!r} (dim {dim}): grads")
                if grads.shape[0] != ids.numel():
                    raise _invalid(f"table {name!r}: {ids.numel()} ids but {grads.shape[0]} rows of grads (dim {dim})")
                item.grads = grads.float()
            parsed.append(item)
        return parsed

    def _parse_packed(self, request, with_grads: bool) -> list[_TableRequest]:
        packed = request.packed
        names, counts = list(packed.tables), [int(c) for c in packed.counts]
        if len(counts) != len(names):
            raise _invalid(f"packed ids name {len(names)} tables but give {len(counts)} counts")
        if len(set(names)) != len(names):
            raise _invalid(f"a table appears more than once in one request: {sorted({n for n in names if names.count(n) > 1})}")
        dims = [self._dim(name) for name in names]
        self._check_total(sum(counts))
        ids = wire.decode_ids(packed.ids, what="packed ids")
        if ids.numel() != sum(counts):
            raise _invalid(f"packed ids hold {ids.numel()} ids, their counts {counts} add up to {sum(counts)}")
        per_table = torch.split(ids, counts)
        grads: Sequence[Optional[torch.Tensor]] = [None] * len(names)
        if with_grads:
            dtype = self._grads_dtype("packed grads", request.packed_dtype)
            sizes = [c * d for c, d in zip(counts, dims)]
            flat = wire.rows_view(request.packed_grads, dtype, 1, what="packed grads").view(-1)
            if flat.numel() != sum(sizes):
                raise _invalid(
                    f"packed grads hold {flat.numel()} {dtype} values, the ids' counts times their tables' dims "
                    f"({list(zip(names, counts, dims))}) make {sum(sizes)}"
                )
            grads = [g.view(c, d) for g, c, d in zip(torch.split(flat.float(), sizes), counts, dims)]
        return [_TableRequest(name, dim, table_ids, table_grads) for name, dim, table_ids, table_grads in zip(names, dims, per_table, grads)]

    # ---- RPCs ----------------------------------------------------------------------------------------

    @_rpc
    def Lookup(self, request: persia_pb2.LookupRequest, context) -> persia_pb2.LookupResponse:
        dtype_enum = request.dtype or persia_pb2.FP16
        dtype = _DTYPE_NAMES.get(dtype_enum)
        if dtype is None:
            raise _invalid(f"lookup dtype {_dtype_label(request.dtype)} is not one of FP16, FP32")
        items = self._parse(request, with_grads=False)
        response_bytes = sum(item.ids.numel() * item.dim for item in items) * wire.WIRE_DTYPES[dtype].itemsize
        if response_bytes > self.max_message_bytes - (1 << 20):
            raise _Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the rows asked for would take {response_bytes} bytes, over the {self.max_message_bytes}-byte "
                "message limit (max_message_mb); ask for fewer ids per request",
            )
        response = persia_pb2.LookupResponse(dtype=dtype_enum)
        # A read-only shard answers a training lookup like an evaluation one: nothing is inserted or touched.
        train = request.train and not self.config.read_only
        found = self.store.lookup_many([(item.name, item.ids) for item in items], train=train, dtype=wire.WIRE_DTYPES[dtype])
        if request.HasField("packed"):
            # One buffer, converted to the wire dtype as it is filled: one encode for every table.
            packed = torch.empty(sum(rows.numel() for rows in found), dtype=wire.WIRE_DTYPES[dtype])
            offset = 0
            for rows in found:
                packed[offset : offset + rows.numel()].copy_(rows.reshape(-1))
                offset += rows.numel()
            response.packed_rows = wire.encode_rows(packed, dtype)
            response.packed_dims.extend(item.dim for item in items)
        else:
            for item, rows in zip(items, found):
                response.tables.add(table=item.name, dim=item.dim, rows=wire.encode_rows(rows, dtype))
        self._count("lookup_rows", sum(item.ids.numel() for item in items))
        return response

    @_rpc
    def Update(self, request: persia_pb2.UpdateRequest, context) -> persia_pb2.UpdateResponse:
        if self.config.read_only:
            raise _read_only("Update")
        if not request.client_id:
            raise _invalid("update without a client_id; exactly-once delivery needs (client_id, seq)")
        if request.seq < 1:
            raise _invalid("update seq must be >= 1")

        def apply() -> int:
            # Parsed here, not before: a duplicate (a retry, or the same merged update from another rank)
            # is answered without decoding its gradients again.
            items = self._parse(request, with_grads=True)
            return self.store.update_many([(item.name, item.ids, item.grads) for item in items])

        rows, duplicate = self.dedup.run(request.client_id, request.seq, apply, digest=_digest(request))
        self._count("update_duplicates" if duplicate else "update_rows", 1 if duplicate else rows)
        return persia_pb2.UpdateResponse(rows_applied=rows, duplicate=duplicate)

    @_rpc
    def Configure(self, request: persia_pb2.ConfigureRequest, context) -> persia_pb2.ConfigureResponse:
        configs = [_table_config_from_json(text) for text in request.tables_json]
        if self.config.read_only:
            for config in configs:  # confirming a table as it is stays allowed
                try:
                    existing = self.store.describe(config.name)
                except UnknownTableError:
                    raise _read_only(f"Configure of the new table {config.name!r}") from None
                if existing != config:
                    raise _read_only(f"Configure of table {config.name!r} with another configuration")
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise _invalid(f"a table appears more than once in one configure request: {names}")
        for config in configs:  # refuse the whole request if any table clashes with an existing one
            try:
                existing = self.store.describe(config.name)
            except UnknownTableError:
                continue
            if existing.dim != config.dim:
                raise _invalid(f"table {config.name!r} exists with dim {existing.dim}, asked for dim {config.dim}")
        existing_count = self.store.table_count()
        new_tables = [c.name for c in configs if c.name not in self.store.tables()]
        if existing_count + len(new_tables) > self.config.max_tables:
            raise _Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"creating {len(new_tables)} more tables would exceed max_tables={self.config.max_tables} "
                f"(the shard holds {existing_count})",
            )
        applied = [self.store.configure(config) for config in configs]
        return persia_pb2.ConfigureResponse(tables_json=[json.dumps(c.to_dict()) for c in applied])

    @_rpc
    def Describe(self, request: persia_pb2.DescribeRequest, context) -> persia_pb2.DescribeResponse:
        names = list(request.names) or self.store.tables()
        return persia_pb2.DescribeResponse(tables_json=[json.dumps(self.store.describe(n).to_dict()) for n in names])

    @_rpc
    def Save(self, request: persia_pb2.SaveRequest, context) -> persia_pb2.SaveResponse:
        if self.config.read_only:
            raise _read_only("Save")
        self.store.save(self._checkpoint_directory(request.directory), save_id=request.save_id)
        return persia_pb2.SaveResponse()

    @_rpc
    def Load(self, request: persia_pb2.LoadRequest, context) -> persia_pb2.LoadResponse:
        if self.config.read_only:
            raise _read_only("Load")
        self.store.load(self._checkpoint_directory(request.directory))
        return persia_pb2.LoadResponse()

    @_rpc
    def SaveDelta(self, request: persia_pb2.SaveDeltaRequest, context) -> persia_pb2.SaveDeltaResponse:
        if self.config.read_only:
            raise _read_only("SaveDelta")
        if not request.save_id:
            raise _invalid("a delta needs a save_id (the next delta names it as its base_id)")
        self.store.save_delta(self._checkpoint_directory(request.directory), request.save_id, request.base_id)
        return persia_pb2.SaveDeltaResponse()

    @_rpc
    def StageDelta(self, request: persia_pb2.StageDeltaRequest, context) -> persia_pb2.StageDeltaResponse:
        self._check_serving("StageDelta")
        rows = self.served.stage(self._checkpoint_directory(request.directory), request.version, request.base_version)
        return persia_pb2.StageDeltaResponse(rows=rows)

    @_rpc
    def CommitDelta(self, request: persia_pb2.CommitDeltaRequest, context) -> persia_pb2.CommitDeltaResponse:
        self._check_serving("CommitDelta")
        self.served.commit(request.version)
        return persia_pb2.CommitDeltaResponse()

    def _check_serving(self, what: str) -> None:
        if not self.config.read_only:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"{what} refused: only read-only (inference) shards apply deltas; this is a training shard")
        if self.watching_deltas is not None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"{what} refused: this shard applies the deltas of {self.watching_deltas} on its own (--watch-deltas)")

    def _checkpoint_directory(self, directory: str) -> str:
        directory = _checkpoint_directory(directory)
        root = self.config.checkpoint_root
        if root is not None:
            real, real_root = os.path.realpath(directory), os.path.realpath(root)
            if os.path.commonpath([real, real_root]) != real_root:
                raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                             f"checkpoint directory {directory!r} is outside this shard's checkpoint_root {root!r}")
        return directory

    @_rpc
    def Stats(self, request: persia_pb2.StatsRequest, context) -> persia_pb2.StatsResponse:
        with self._counter_lock:
            server = dict(self._counters)
        server["dedup_duplicates"] = self.dedup.duplicates
        server.update(incarnation=self.incarnation, started_at=self.started_at, restored_from=self.restored_from,
                      model_version=self.served.version, staged_version=self.served.staged_version,
                      watching_deltas=self.watching_deltas)
        body = {"tables": self.store.stats(), "server": server}
        return persia_pb2.StatsResponse(
            shard_index=self.store.shard_index, num_shards=self.store.num_shards, json=json.dumps(body),
            incarnation=self.incarnation,
        )


def _digest(request: persia_pb2.UpdateRequest) -> int:
    """CRC32 of an update's tables: cheap (no decoding), and the same for every copy of the same update."""
    crc = 0
    for entry in request.tables:
        for part in (entry.table.encode(), entry.ids, entry.grads, str(entry.dtype).encode()):
            crc = zlib.crc32(part, crc)
    if request.HasField("packed"):
        packed = request.packed
        for part in ("\0".join(packed.tables).encode(), str(list(packed.counts)).encode(), packed.ids, request.packed_grads,
                     str(request.packed_dtype).encode()):
            crc = zlib.crc32(part, crc)
    return crc


def _dtype_label(value: int) -> str:
    try:
        return persia_pb2.WireDType.Name(value)
    except ValueError:
        return f"{value} (unknown)"


def _table_config_from_json(text: str) -> TableConfig:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise _invalid(f"table config is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise _invalid(f"table config must be a JSON object, got {type(data).__name__}")
    return TableConfig.from_dict(data)  # ConfigError -> INVALID_ARGUMENT


def _checkpoint_directory(directory: str) -> str:
    if not directory or not os.path.isabs(directory):
        raise _invalid(f"checkpoint directory must be an absolute path on the shard's file system, got {directory!r}")
    return directory


# ---- authentication ------------------------------------------------------------------------------------


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <token>`` metadata with UNAUTHENTICATED.

    The health service stays open, so that load balancers and orchestrators can probe the shard; it tells
    nothing but "serving".
    """

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def refuse(message: str):
            def handler(request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

            return grpc.unary_unary_rpc_method_handler(handler)

        self._missing = refuse(f"missing '{AUTH_METADATA_KEY}: Bearer <token>' metadata; this shard requires a token")
        self._wrong = refuse("wrong token")

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                return continuation(handler_call_details) if hmac.compare_digest(given, self._expected) else self._wrong
        return self._missing


# ---- the server ----------------------------------------------------------------------------------------


@dataclass
class TLSFiles:
    """PEM files of a shard's TLS identity; ``client_ca`` makes the shard require client certificates."""

    cert: str
    key: str
    client_ca: Optional[str] = None

    def credentials(self) -> grpc.ServerCredentials:
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        ca = read(self.client_ca) if self.client_ca else None
        return grpc.ssl_server_credentials([(read(self.key), read(self.cert))], root_certificates=ca, require_client_auth=ca is not None)


class ShardServer:
    """The gRPC server of one shard: the PS service, the health service, optional token and TLS."""

    def __init__(
        self,
        store: ShardStore,
        config: PSConfig,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: Optional[str] = None,
        tls: Optional[TLSFiles] = None,
        insecure: bool = False,
        model_version: int = 0,
    ) -> None:
        check_bind_security(host, token=token, tls=tls is not None, insecure=insecure)
        self.servicer = PSServicer(store, config, model_version)
        self.health = health.HealthServicer()
        self._host = host
        self._metrics_port = config.metrics_port
        self.metrics_registry = None if config.metrics_port is None else metrics.shard_registry(self.servicer)
        self.metrics_url: Optional[str] = None
        self._metrics_server = None
        # The metrics interceptor comes first, so it also counts the calls the token interceptor refuses.
        interceptors = ([metrics.ServerRpcMetrics(self.metrics_registry)] if self.metrics_registry is not None else []) + (
            [TokenInterceptor(token)] if token else [])
        max_bytes = config.max_message_mb << 20
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.server_threads, thread_name_prefix="persia-ps"),
            interceptors=interceptors or None,
            options=[
                ("grpc.max_send_message_length", max_bytes),
                ("grpc.max_receive_message_length", max_bytes),
                ("grpc.so_reuseport", 0),  # a busy port is an error, not a silently shared one
            ],
        )
        self.servicer.add_to_server(self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        target = format_address(host, port)
        try:
            if tls is not None:
                bound = self._server.add_secure_port(target, tls.credentials())
            else:
                bound = self._server.add_insecure_port(target)
        except RuntimeError as err:
            raise OSError(f"cannot bind {target}: {err} (is the port in use?)") from None
        if not bound:
            raise OSError(f"cannot bind {target} (is the port in use?)")
        self.address = format_address(host, bound)

    def start(self) -> str:
        """Starts serving (metrics first: a shard whose metrics port is taken never answers a call)."""
        if self.metrics_registry is not None:
            try:
                self._metrics_server = metrics.serve_metrics(self.metrics_registry, self._host, self._metrics_port,
                                                             what=f"shard {self.servicer.store.shard_index} metrics (--metrics-port)")
            except metrics.MetricsPortError:
                self._server.stop(None)  # releases the bound gRPC port
                raise
            self.metrics_url = metrics.metrics_url(self._metrics_server, self._host)
        self._server.start()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self.address

    def stop(self, grace_s: float) -> None:
        """Reports NOT_SERVING, lets in-flight calls finish for up to ``grace_s`` seconds, then stops."""
        self.health.enter_graceful_shutdown()
        self._server.stop(grace_s).wait()
        metrics.stop_metrics(self._metrics_server)


# ---- the shard process ---------------------------------------------------------------------------------


_PR_SET_PDEATHSIG = 1


def _exit_with_parent(parent_pid: int, stop: threading.Event, poll_s: float = 0.5) -> None:
    """Sets ``stop`` once ``parent_pid`` is gone (and asks the kernel for SIGTERM on the parent's death)."""
    direct = parent_pid == os.getppid()
    if direct and sys.platform.startswith("linux"):
        try:  # SIGTERM when the parent thread that started us exits; the watchdog below covers the rest
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def alive() -> bool:
        if direct:
            return os.getppid() == parent_pid  # re-parented once the parent is gone (immune to pid reuse)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # alive, owned by another user
        return True

    def watch() -> None:
        while not stop.wait(poll_s):
            if not alive():
                log.warning("parent process %d is gone; stopping", parent_pid)
                stop.set()

    if not alive():
        stop.set()
    threading.Thread(target=watch, name="persia-ps-parent-watchdog", daemon=True).start()


def _trim_memory_every(interval_s: float, stop: threading.Event) -> None:
    """Hands freed heap memory back to the OS every ``interval_s`` seconds (glibc ``malloc_trim``).

    Every request allocates and frees buffers of megabytes on one of many handler threads; glibc keeps such
    freed memory in per-thread arenas, which would otherwise count as resident memory of the shard.
    """
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return  # not glibc

    def loop() -> None:
        while not stop.wait(interval_s):
            trim(0)

    threading.Thread(target=loop, name="persia-ps-malloc-trim", daemon=True).start()


def _schedule_idle() -> None:
    """``SCHED_IDLE`` for every thread of this process (a thread started later inherits its creator's policy).

    A system that refuses it (a sandbox without ``sched_setscheduler``) leaves the shard at its normal priority, with
    a warning: the policy is a courtesy to the processes it shares cores with, not a condition of serving.
    """
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setscheduler(int(task), os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # the thread ended in between
                pass
    except OSError as err:
        log.warning("scheduling 'idle' refused by the system (%s); the shard runs at its normal priority", err)


def run_shard(
    *,
    shard_index: int,
    num_shards: int,
    config: PSConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    token: Optional[str] = None,
    tls: Optional[TLSFiles] = None,
    insecure: bool = False,
    parent_pid: Optional[int] = None,
    model_version: int = 0,
    before_serving: Optional[Callable[[PSServicer, threading.Event], None]] = None,
) -> int:
    """Serves one shard until SIGTERM/SIGINT (or the parent's death); returns the exit status.

    Prints ``PERSIA_PS_LISTENING <host>:<port>`` on stdout, on a line of its own, once it accepts calls.
    ``model_version``: the version of the model whose tables it restored (a serving bundle's).
    ``before_serving(servicer, stop)`` runs once the tables are restored, before the first call is accepted
    (the serving delta watcher: ``stop`` is set when the shard stops); what it raises stops the shard.
    """
    keep_freed_memory()  # before the first request thread has an arena of its own
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    if config.nice:
        os.nice(config.nice)
    if config.scheduling == "idle":
        _schedule_idle()
    native.available()  # loads the kernels (or warns that it cannot) now, not inside the first request
    # Before the tables: a frozen object is never collected, and a table a load replaces must be freed.
    freeze_startup_objects()
    store = ShardStore(shard_index=shard_index, num_shards=num_shards, seed=config.seed, table_defaults=config.table_configs(),
                       fault_save_delay_s=config.fault_save_delay_s)
    restored = None
    if config.restore_from:  # before binding: a shard that cannot restore never answers with empty tables
        restored = store.load_latest(config.restore_from)  # CheckpointError: refuse to start
        log.info("shard %d/%d restored from %s", shard_index, num_shards, restored)
    server = ShardServer(store, config, host=host, port=port, token=token, tls=tls, insecure=insecure, model_version=model_version)
    server.servicer.restored_from = restored
    stop = threading.Event()
    if before_serving is not None:
        before_serving(server.servicer, stop)
    if insecure and not (is_loopback_host(host) or token or tls):
        log.warning("serving on %s with neither TLS nor a token (--insecure): anyone who reaches it can read and "
                    "overwrite the tables", host)

    signalled: list[int] = []

    def on_signal(signum, frame) -> None:
        # No lock here (not even Event.set): the handler runs on the main thread between two bytecodes, possibly
        # while that thread holds the very lock it would take (a second SIGTERM landing inside the first
        # handler's Event.set deadlocked the shard for good). The main loop below polls the list.
        signalled.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    if parent_pid is not None:
        _exit_with_parent(parent_pid, stop)

    if config.malloc_trim_interval_s > 0:
        _trim_memory_every(config.malloc_trim_interval_s, stop)
    address = server.start()
    protection = " + ".join(name for name, on in (("TLS", tls), ("token", token)) if on) or "no TLS, no token"
    log.info("shard %d/%d serving on %s (%s)", shard_index, num_shards, address, protection)
    if server.metrics_url:
        log.info("shard %d/%d metrics on %s", shard_index, num_shards, server.metrics_url)
        print(f"{METRICS_PREFIX} {server.metrics_url}", flush=True)
    print(f"{LISTENING_PREFIX} {address}", flush=True)
    while not signalled and not stop.wait(0.2):  # a timed wait keeps the main thread responsive to signals
        pass
    log.info("shard %d/%d stopping (grace %.1f s)", shard_index, num_shards, config.grace_s)
    stop.set()
    server.stop(config.grace_s)
    return 0


# ---- local clusters ------------------------------------------------------------------------------------


def read_listening_address(process: subprocess.Popen, lines: MutableSequence[str], deadline: float, thread_name: str) -> Optional[str]:
    """The address a ``ps serve`` process prints on its ``LISTENING`` line, or None if none came by ``deadline``.

    A daemon thread keeps reading the process's (text) stdout afterwards, so a chatty shard never blocks on
    its pipe; every other line is appended to ``lines`` (a bounded ``deque`` keeps only the last ones).
    """
    found: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        for line in process.stdout:
            line = line.rstrip("\n")
            if line.startswith(LISTENING_PREFIX + " ") and not ready.is_set():
                found.append(line.split(" ", 1)[1].strip())
                ready.set()
            else:
                lines.append(line)
        ready.set()

    threading.Thread(target=drain, name=thread_name, daemon=True).start()
    ready.wait(max(0.0, deadline - time.monotonic()))
    return found[0] if found else None


def stop_processes(processes: list[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM to every process still running, then SIGKILL to any still alive after ``timeout_s``."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ShardStartError(RuntimeError):
    """A shard process exited or stayed silent before it printed its address."""


@dataclass
class ShardEvent:
    """Something the supervisor of :class:`LocalShards` saw or did: ``exited``, ``restarted``, ``restart_failed``, ``gave_up``."""

    time: float
    shard: int
    kind: str
    detail: str


class LocalShards:
    """``num_shards`` shard processes on loopback, started with ``lightning-persia ps serve --port 0``.

    Each shard exits when this process dies (``--parent-pid``). Use as a context manager or call
    :meth:`stop`. The shards share this machine with each other and with the caller, so unless told
    otherwise each gets ``cpu_count // (num_shards + 1)`` torch threads (at least one), and OpenMP threads
    that sleep instead of spinning when idle (``OMP_WAIT_POLICY=PASSIVE``): spinning threads of several
    processes on the same cores multiply request latency.

    With ``restart=True`` a supervisor (the thread that forked the shards) checks them every ``poll_s``
    seconds and restarts a shard that died (SIGKILL, OOM, crash) on the same port, at most ``max_restarts``
    times per shard, with ``--restore-from restore_from`` when that is set (assign the attribute after each
    checkpoint). A restarted shard is a new *incarnation*: clients that knew the old one are refused until
    they refresh (see ``PSClient.wait_healthy``). What the supervisor saw and did is in :attr:`events`.

    Example::

        with LocalShards(2, overrides=["seed=7"]) as shards:
            client = PSClient(shards.addresses)
    """

    def __init__(
        self,
        num_shards: int,
        *,
        host: str = "127.0.0.1",
        config_path: Optional[str] = None,
        overrides: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        env: Optional[dict] = None,
        startup_timeout_s: float = 120.0,
        restart: bool = False,
        max_restarts: int = 3,
        restore_from: Optional[str] = None,
        poll_s: float = 0.2,
    ) -> None:
        self.num_shards = num_shards
        self.processes: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.restart = restart
        self.max_restarts = max_restarts
        self.restore_from = restore_from
        self.restarts = [0] * num_shards
        self.events: list[ShardEvent] = []
        self.startup_timeout_s = startup_timeout_s
        self._logs: list[collections.deque] = [collections.deque(maxlen=200) for _ in range(num_shards)]
        self._lock = threading.Lock()
        self._stopping = False
        self._seen_dead: set[int] = set()  # pids whose exit was recorded
        threads = max(1, (os.cpu_count() or 1) // (num_shards + 1))
        overrides = [f"torch_threads={threads}", *overrides]  # a later override of the caller's wins
        self._env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, **(env or {})}
        self._commands = []
        for index in range(num_shards):
            command = [sys.executable, "-m", "lightning_persia.cli", "ps", "serve",
                       "--host", host, "--shard-index", str(index), "--num-shards", str(num_shards),
                       "--parent-pid", str(os.getpid()), *extra_args]
            if config_path:
                command += ["--config", config_path]
            self._commands.append(command + list(overrides))
        # The kernel's parent-death signal follows the *thread* that forked a shard, so the shards are forked
        # by a thread of their own that lives until stop(), whatever thread creates this object. The same
        # thread restarts dead shards.
        self._keeper_done = threading.Event()
        spawned: futures.Future = futures.Future()

        def keeper() -> None:
            try:
                for index in range(num_shards):
                    self.processes.append(self._popen(index, 0, None))
            except BaseException as err:
                spawned.set_exception(err)
                return
            spawned.set_result(None)
            while not self._keeper_done.wait(poll_s):
                if self.restart:
                    try:
                        self._supervise()
                    except Exception:  # never let the supervisor die: the shards' parent-death signal hangs on it
                        log.exception("shard supervisor failed")

        threading.Thread(target=keeper, name="persia-ps-shard-keeper", daemon=True).start()
        try:
            spawned.result()
            deadline = time.monotonic() + startup_timeout_s
            for index, process in enumerate(self.processes):
                self.addresses.append(self._read_address(index, process, deadline))
        except BaseException:
            self.stop()
            raise

    def _popen(self, index: int, port: int, restore_from: Optional[str]) -> subprocess.Popen:
        command = [*self._commands[index][:5], "--port", str(port), *self._commands[index][5:]]
        if restore_from:
            command[5:5] = ["--restore-from", str(restore_from)]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=self._env)

    def _event(self, shard: int, kind: str, detail: str) -> None:
        (log.warning if kind != "restarted" else log.info)("shard %d: %s: %s", shard, kind, detail)
        self.events.append(ShardEvent(time.time(), shard, kind, detail))

    def _supervise(self) -> None:
        for index in range(self.num_shards):
            with self._lock:
                if self._stopping:
                    return
                process = self.processes[index]
            status = process.poll()
            if status is None:
                continue
            if process.pid not in self._seen_dead:
                self._seen_dead.add(process.pid)
                self._event(index, "exited", f"pid {process.pid} exited with status {status}; last output:\n"
                            + "\n".join(list(self._logs[index])[-5:]))
            if self.restarts[index] >= self.max_restarts:
                if self.restarts[index] == self.max_restarts:
                    self.restarts[index] += 1  # report once
                    self._event(index, "gave_up", f"not restarted: max_restarts={self.max_restarts} reached")
                continue
            self._restart(index)

    def _restart(self, index: int) -> None:
        self.restarts[index] += 1
        port = int(self.addresses[index].rsplit(":", 1)[1])
        restore = self.restore_from
        with self._lock:
            if self._stopping:
                return
            process = self._popen(index, port, restore)
            self.processes[index] = process
        try:
            address = self._read_address(index, process, time.monotonic() + self.startup_timeout_s)
        except ShardStartError as err:
            if process.poll() is None:
                process.kill()
                process.wait()
            self._seen_dead.add(process.pid)
            self._event(index, "restart_failed", f"attempt {self.restarts[index]}/{self.max_restarts}: {err}")
            return
        if address != self.addresses[index]:  # cannot happen with a fixed port; a safety net for the clients
            self._event(index, "restart_failed", f"came back on {address}, not {self.addresses[index]}")
            process.kill()
            return
        origin = f"restored from {restore}" if restore else "with empty tables (no checkpoint to restore)"
        self._event(index, "restarted", f"pid {process.pid} on {address}, {origin} (restart {self.restarts[index]}/{self.max_restarts})")

    def _read_address(self, index: int, process: subprocess.Popen, deadline: float) -> str:
        lines = self._logs[index]
        address = read_listening_address(process, lines, deadline, thread_name=f"persia-ps-{index}-output")
        if address is None:
            status = process.poll()
            state = f"exited with status {status}" if status is not None else "did not print its address in time"
            raise ShardStartError(f"shard {index}/{self.num_shards} {state}; its output:\n" + "\n".join(lines))
        return address

    def output(self, index: int) -> str:
        """The last lines a shard printed (its log, across restarts), for error messages."""
        return "\n".join(self._logs[index]) if index < len(self._logs) else ""

    def alive(self) -> list[bool]:
        """Whether each shard process is running now."""
        with self._lock:
            return [p.poll() is None for p in self.processes]

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to every shard, then SIGKILL to any still alive after ``timeout_s``; no restart after this."""
        with self._lock:
            self._stopping = True
            processes = list(self.processes)
        stop_processes(processes, timeout_s)
        self._keeper_done.set()

    def __enter__(self) -> "LocalShards":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
