"""The ``persia.ParameterServer`` service of one shard, over a :class:`ShardStore`.

Every RPC reads its request (``messages.py`` checks it before anything touches the rows), calls the store and
answers. A refusal or failure becomes a gRPC status whose message names the shard and the problem; the shard
keeps serving and its data is unchanged. Calls of :data:`FENCED_METHODS` that name another incarnation of
the shard than this process are refused with ABORTED, unless the shard's write-ahead log holds every write
acknowledged to that incarnation's clients (its replay then restored them: ``store.log.accepted``).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import threading
import time
import uuid
from typing import Callable, Iterator, Optional

import grpc

from lightning_persia.ops import wire
from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps import handover_wire, messages, remote_folder
from lightning_persia.remote_ps.config import PSConfig
from lightning_persia.remote_ps.exactly_once import UpdateDeduplicator
from lightning_persia.remote_ps.handover_delivery import PageDelivery
from lightning_persia.remote_ps.messages import RpcRefusal, invalid, read_only
from lightning_persia.remote_ps.move_settling import MoveSettler, MoveSettlingError
from lightning_persia.remote_ps.move_thread import MoveThread
from lightning_persia.remote_ps.peers import Peers
from lightning_persia.remote_ps.protocol import (
    FENCED_METHODS, INCARNATION_METADATA_KEY, MAP_VERSION_METADATA_KEY, SERVICE, SERVICE_NAME, persia_pb2, persia_pb2_grpc,
)
from lightning_persia.remote_ps.served_version import ServedVersion
from lightning_persia.remote_ps.store import ShardStore, UnknownTableError
from lightning_persia.remote_ps.store.slot_moves import MapMovedError, SlotsMovingError
from lightning_persia.remote_ps.store.wal.changes import Change, TableChange
from lightning_persia.remote_ps.table_config import TableConfig

log = logging.getLogger("lightning_persia.ps")

HANDOVER_WAIT_S = 10.0
"""How long a request for slots being handed over waits for the cut-over (the last changes' copy, about a training
step's worth) before the client hears "moving" and retries."""

HANDOVER_PAGE_BYTES = 16 << 20
"""Rows a handover page holds, at most: a taker decodes and writes a page while the source's step waits for it, and
both serve their trainers meanwhile, so pages stay small enough not to hold either's interpreter for long."""

def _rpc(method: Callable) -> Callable:
    """Counts the call and turns every refusal or failure into a gRPC status with its message."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: "PSServicer", request, context: grpc.ServicerContext):
        self._count(name)
        try:
            if name in FENCED_METHODS:
                self._check_incarnation(context)
                self._check_log()
            if isinstance(request, messages.Undecodable):
                raise invalid(f"request bytes are not a valid {request.message_type} message ({request.error})")
            return method(self, request, context)
        except Exception as err:
            code = messages.status_of(err)
            if code is None:  # a bug: keep serving, tell the caller, keep the traceback in the log
                log.exception("%s failed", name)
                code, message = grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}"
            else:
                message = str(err)
            if isinstance(err, MapMovedError):
                context.set_trailing_metadata(((MAP_VERSION_METADATA_KEY, str(err.version)),))
        self._count(f"{name}_errors")
        context.abort(code, f"shard {self.store.shard_index}/{self.store.num_shards}: {message}")

    return wrapper


def _writes(method: Callable) -> Callable:
    """Refuses the call on a read-only shard (an inference shard), before it reads its request."""

    @functools.wraps(method)
    def wrapper(self: "PSServicer", request, context: grpc.ServicerContext):
        if self.config.read_only:
            raise read_only(method.__name__)
        return method(self, request, context)

    return wrapper


class _PastHandover:
    """The attempts of a request over slots that may be being handed over, run in the caller's own frame::

        for attempt in _PastHandover(store):
            with attempt:
                ...

    An attempt refused because its slots are being handed over (or because it was routed by a map this shard has
    not adopted yet) waits for the handover to end (or the adoption), then runs again (and hears the map moved),
    rather than send its client into a back-off that could outlast a drained shard. After :data:`HANDOVER_WAIT_S`
    the refusal goes to the client, which retries."""

    def __init__(self, store: ShardStore) -> None:
        self._store = store
        self._deadline = time.monotonic() + HANDOVER_WAIT_S
        self._seen_version = 0
        self._done = False

    def __iter__(self) -> Iterator["_PastHandover"]:
        while not self._done:
            self._seen_version = self._store.shard_map.version
            yield self

    def __enter__(self) -> "_PastHandover":
        return self

    def __exit__(self, kind, err, traceback) -> bool:
        if kind is None:
            self._done = True
            return False
        if not issubclass(kind, SlotsMovingError) or time.monotonic() >= self._deadline:
            return False
        self._store.wait_handover(max(0.0, self._deadline - time.monotonic()), self._seen_version)
        return True


class PSServicer(persia_pb2_grpc.ParameterServerServicer):
    """The ``persia.ParameterServer`` service of one shard."""

    def __init__(self, store: ShardStore, config: PSConfig, model_version: int = 0, *, peers: Optional[Peers] = None) -> None:
        self.store = store
        # the other shards, reached with the shard's token and TLS: a move's takers, and whom a move's settling asks
        self._peers = peers if peers is not None else Peers(max_message_bytes=config.max_message_mb << 20)
        # ends a move whose coordinator is gone (the shard server starts its watch)
        self.settler = MoveSettler(store, config.handover_deadline_s, self._peers)
        self.config = config
        self.served = ServedVersion(store, model_version)
        self.watching_deltas: Optional[str] = None  # the folder of deltas this shard applies on its own, if any
        self.max_message_bytes = config.max_message_mb << 20
        self.dedup = UpdateDeduplicator(config.dedup_window, config.dedup_max_clients)
        self._decoder = messages.RequestDecoder(store, config.max_ids_per_request)
        self._counters: collections.Counter[str] = collections.Counter()
        self._counter_lock = threading.Lock()
        # New in every process (and every servicer): a client that saw another one talks to a restarted shard,
        # which refuses it unless its write-ahead log holds every write acknowledged to that client (`accepted`).
        self.incarnation = store.log.incarnation if store.log is not None else uuid.uuid4().hex[:16]
        self.accepted = store.log.accepted if store.log is not None else frozenset({self.incarnation})
        if store.log is not None:
            for client, seqs in store.log.applied_seqs().items():
                self.dedup.remember(client, seqs)
        self.started_at = time.time()
        self.restored_from: Optional[str] = None
        self._handover_rows: Optional[Iterator] = None  # the rows of the handover under way still to give
        self._handover_sightings: Optional[Iterator] = None  # its sightings still to give, once fenced
        self._delivery: Optional[PageDelivery] = None  # sends the handover's pages to its takers
        self._delivery_lock = threading.Lock()  # one page at a time (a step's retry waits for the call it retries)
        # a move's pages, given and taken, below the requests' priority; apart, so that giving never waits on itself
        self._giving, self._taking = MoveThread("ps-give", config.move_nice), MoveThread("ps-take", config.move_nice)

    def close(self) -> None:
        """Takes no more of a move's pages (the one under way, if any, finishes); the server stopped first."""
        self._giving.close()
        self._taking.close()

    def add_to_server(self, server: grpc.Server) -> None:
        """Registers every RPC of the service, like the generated ``add_ParameterServerServicer_to_server``,
        but with request parsing that answers undecodable bytes with INVALID_ARGUMENT instead of INTERNAL."""
        handlers = {}
        for method in SERVICE.methods:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                getattr(self, method.name),
                request_deserializer=messages.tolerant_parser(getattr(persia_pb2, method.input_type.name)),
                response_serializer=getattr(persia_pb2, method.output_type.name).SerializeToString,
            )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        server.add_registered_method_handlers(SERVICE_NAME, handlers)

    # ---- rows ----------------------------------------------------------------------------------------

    @_rpc
    def Lookup(self, request: persia_pb2.LookupRequest, context) -> persia_pb2.LookupResponse:
        dtype = messages.lookup_dtype(request.dtype)
        items = self._decoder.tables(request, with_grads=False)
        response_bytes = sum(item.ids.numel() * item.dim for item in items) * wire.WIRE_DTYPES[dtype].itemsize
        if response_bytes > self.max_message_bytes - (1 << 20):
            raise RpcRefusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the rows asked for would take {response_bytes} bytes, over the {self.max_message_bytes}-byte "
                "message limit (max_message_mb); ask for fewer ids per request",
            )
        # A read-only shard answers a training lookup like an evaluation one: nothing is inserted or touched.
        train = request.train and not self.config.read_only
        for attempt in _PastHandover(self.store):
            with attempt:
                found = self.store.lookup_many([(item.name, item.ids) for item in items], train=train,
                                               dtype=wire.WIRE_DTYPES[dtype], map_version=request.map_version)
        self._count("lookup_rows", sum(item.ids.numel() for item in items))
        response = messages.lookup_response(request, items, found, dtype)
        response.map_version = self.store.shard_map.version
        return response

    @_rpc
    @_writes
    def Update(self, request: persia_pb2.UpdateRequest, context) -> persia_pb2.UpdateResponse:
        if not request.client_id:
            raise invalid("update without a client_id; exactly-once delivery needs (client_id, seq)")
        if request.seq < 1:
            raise invalid("update seq must be >= 1")

        digest = messages.update_digest(request)
        for attempt in _PastHandover(self.store):
            # checked, then applied, in this frame: an update whose (client_id, seq) was applied is answered as then
            with attempt, self.dedup.once(request.client_id, request.seq, digest) as once:
                if not once.duplicate:
                    # Decoded here, not before: a duplicate (a retry, or an update re-routed after a move)
                    # is answered without decoding its gradients again.
                    items = self._decoder.tables(request, with_grads=True)
                    once.result = self.store.update_many([(item.name, item.ids, item.grads) for item in items],
                                                         client=request.client_id, seq=request.seq,
                                                         map_version=request.map_version)
        self._count("update_duplicates" if once.duplicate else "update_rows", 1 if once.duplicate else once.result)
        return persia_pb2.UpdateResponse(rows_applied=once.result, duplicate=once.duplicate,
                                         map_version=self.store.shard_map.version)

    # ---- tables --------------------------------------------------------------------------------------

    @_rpc
    def Configure(self, request: persia_pb2.ConfigureRequest, context) -> persia_pb2.ConfigureResponse:
        configs = [messages.table_config_from_json(text) for text in request.tables_json]
        if self.config.read_only:
            for config in configs:  # confirming a table as it is stays allowed
                try:
                    existing = self.store.describe(config.name)
                except UnknownTableError:
                    raise read_only(f"Configure of the new table {config.name!r}") from None
                if existing != config:
                    raise read_only(f"Configure of table {config.name!r} with another configuration")
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise invalid(f"a table appears more than once in one configure request: {names}")
        for config in configs:  # refuse the whole request if any table clashes with an existing one
            try:
                existing = self.store.describe(config.name)
            except UnknownTableError:
                continue
            if existing.dim != config.dim:
                raise invalid(f"table {config.name!r} exists with dim {existing.dim}, asked for dim {config.dim}")
        existing_count = self.store.table_count()
        new_tables = [c.name for c in configs if c.name not in self.store.tables()]
        if existing_count + len(new_tables) > self.config.max_tables:
            raise RpcRefusal(
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

    # ---- checkpoints and deltas ----------------------------------------------------------------------

    @_rpc
    @_writes
    def Save(self, request: persia_pb2.SaveRequest, context) -> persia_pb2.SaveResponse:
        if remote_folder.is_remote(request.directory):
            with remote_folder.saved_to(self._checkpoint_url(request.directory)) as staging:
                self.store.save(staging, save_id=request.save_id)
        else:
            self.store.save(self._checkpoint_directory(request.directory), save_id=request.save_id)
        return persia_pb2.SaveResponse()

    @_rpc
    @_writes
    def Load(self, request: persia_pb2.LoadRequest, context) -> persia_pb2.LoadResponse:
        if remote_folder.is_remote(request.directory):
            try:
                with remote_folder.loaded_from(self._checkpoint_url(request.directory)) as staging:
                    self.store.load(staging)
            except FileNotFoundError as err:
                raise RpcRefusal(grpc.StatusCode.NOT_FOUND, str(err)) from None
        else:
            self.store.load(self._checkpoint_directory(request.directory))
        return persia_pb2.LoadResponse()

    @_rpc
    @_writes
    def SaveDelta(self, request: persia_pb2.SaveDeltaRequest, context) -> persia_pb2.SaveDeltaResponse:
        if not request.save_id:
            raise invalid("a delta needs a save_id (the next delta names it as its base_id)")
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

    # ---- the shard map and slots moving between live shards -------------------------------------------

    @_rpc
    def GetShardMap(self, request: persia_pb2.GetShardMapRequest, context) -> persia_pb2.ShardMapMessage:
        return handover_wire.map_message(self.store.shard_map, self.store.map_addresses)

    @_rpc
    @_writes
    def Handover(self, request: persia_pb2.HandoverStep, context) -> persia_pb2.HandoverPage:
        step = request.step
        if step == persia_pb2.HandoverStep.SETTLE:
            try:
                version = self.settler.settle()
            except MoveSettlingError as err:
                raise RpcRefusal(grpc.StatusCode.UNAVAILABLE, str(err)) from None
            if self.store.handover is None:
                self._end_delivery()
            return persia_pb2.HandoverPage(map_version=version)
        if step == persia_pb2.HandoverStep.ABORT:
            self._end_delivery()
            to_map = self._map_of(request.map) if request.HasField("map") else None
            return persia_pb2.HandoverPage(map_version=self.store.abort_handover(to_map))
        self.settler.heard_coordinator()
        if step == persia_pb2.HandoverStep.BEGIN:
            shard_map, addresses = self._map_and_addresses(request.map)
            with self._delivery_lock:
                delivery = PageDelivery(self._peers, shard_map, addresses,
                                        sorted({now for _, now in self.store.shard_map.moves(shard_map).values()}))
                try:
                    rows = self.store.begin_handover(shard_map, addresses)
                except BaseException:
                    delivery.close()
                    raise
                self._end_delivery_locked()
                self._handover_rows, self._handover_sightings, self._delivery = rows, None, delivery
            return persia_pb2.HandoverPage()
        if step in (persia_pb2.HandoverStep.ROWS, persia_pb2.HandoverStep.CHANGES, persia_pb2.HandoverStep.SIGHTINGS):
            if self.store.fence is not None:  # requests for the slots wait for this page
                return self._deliver(step, context.time_remaining())
            return self._giving.run(self._deliver, step, context.time_remaining())
        if step == persia_pb2.HandoverStep.FENCE:
            self.store.fence_handover()
        elif step == persia_pb2.HandoverStep.FINISH:
            shard_map, addresses = handover_wire.map_of(request.map) if request.HasField("map") else (None, [])
            if shard_map is not None and shard_map != self.store.handover_map:
                raise invalid(f"FINISH names shard map version {shard_map.version}, the handover under way moves to another")
            self._giving.run(self.store.finish_handover, addresses)  # the map first, then the drop: nothing waits on it
            self._end_delivery()
        else:
            raise invalid(f"unknown handover step {step}")
        return persia_pb2.HandoverPage()

    @_rpc
    @_writes
    def TakeOver(self, request: persia_pb2.TakeOverRequest, context) -> persia_pb2.TakeOverResponse:
        if request.page.fenced or request.adopt:  # requests for the slots wait for it
            return self._take_over(request)
        return self._taking.run(self._take_over, request)

    def _take_over(self, request: persia_pb2.TakeOverRequest) -> persia_pb2.TakeOverResponse:
        configs, changes = messages.handover_contents(request.page)
        to_map = self._map_of(request.to_map)
        self.store.take_changes(configs, changes, to_map)
        for name, slots, counters in messages.sightings_contents(request.page):
            self.store.take_sightings(name, slots, counters, to_map)
        for client, seqs in (json.loads(request.page.applied_json) if request.page.applied_json else {}).items():
            self.dedup.remember(f"{client}@{request.page.source}", seqs)
        if request.adopt:
            self.store.adopt_map(to_map, list(request.to_map.addresses))
        return persia_pb2.TakeOverResponse()

    def _deliver(self, step: int, timeout_s: Optional[float]) -> persia_pb2.HandoverPage:
        """The next page of ``step`` sent to the takers (or, when the last one did not reach them all, that page
        again: ``handover_delivery.py``); the answer holds its counts alone."""
        with self._delivery_lock:
            delivery = self._delivery
            if delivery is None:
                raise invalid("no handover under way here: BEGIN one first")
            if delivery.pending is not None:
                return delivery.resend(step, timeout_s)
            fenced = self.store.fence is not None
            if step == persia_pb2.HandoverStep.ROWS:
                configs, changes, done = self._next_rows()
                return delivery.changes(step, configs, changes, done=done, fenced=fenced, timeout_s=timeout_s)
            if step == persia_pb2.HandoverStep.CHANGES:
                configs, changes = self.store.handover_changes()
                return delivery.changes(step, configs, changes, fenced=fenced,
                                        applied_json=json.dumps(self.dedup.applied()), source=self.store.shard_index,
                                        timeout_s=timeout_s)
            blocks, done = self._next_sightings()
            return delivery.sightings(blocks, done=done, fenced=fenced, timeout_s=timeout_s)

    def _end_delivery(self) -> None:
        with self._delivery_lock:
            self._end_delivery_locked()

    def _end_delivery_locked(self) -> None:
        if self._delivery is not None:
            self._delivery.close()
        self._delivery, self._handover_rows, self._handover_sightings = None, None, None

    def _next_rows(self) -> tuple[list[TableConfig], list[Change], bool]:
        """The next page of the handover's rows: ``(configs, changes, done)``."""
        if self._handover_rows is None:
            raise invalid("no handover's rows to give: BEGIN one first")
        configs: dict[str, TableConfig] = {}
        changes, size = [], 0
        for config, step, rows in self._handover_rows:
            configs[config.name] = config
            if rows:
                changes.append(Change([TableChange(config.name, step, rows=rows)]))
                size += sum(values.numel() * values.element_size() for values in rows.values())
            if size >= min(HANDOVER_PAGE_BYTES, self.max_message_bytes // 4):
                return list(configs.values()), changes, False
        self._handover_rows = None
        return list(configs.values()), changes, True

    def _next_sightings(self) -> tuple[list, bool]:
        """The next page of the handover's sightings: ``(blocks, done)``."""
        if self._handover_sightings is None:
            self._handover_sightings = self.store.handover_sightings()
        blocks, size = [], 0
        for block in self._handover_sightings:
            blocks.append(block)
            size += block[2].numel()
            if size >= min(HANDOVER_PAGE_BYTES, self.max_message_bytes // 4):
                return blocks, False
        self._handover_sightings = None
        return blocks, True

    @staticmethod
    def _map_of(message: persia_pb2.ShardMapMessage) -> ShardMap:
        return PSServicer._map_and_addresses(message)[0]

    @staticmethod
    def _map_and_addresses(message: persia_pb2.ShardMapMessage) -> tuple[ShardMap, list[str]]:
        try:
            return handover_wire.map_of(message)
        except ValueError as err:
            raise invalid(f"not a valid shard map: {err}") from None

    # ---- stats ---------------------------------------------------------------------------------------

    @_rpc
    def Stats(self, request: persia_pb2.StatsRequest, context) -> persia_pb2.StatsResponse:
        with self._counter_lock:
            server = dict(self._counters)
        server["dedup_duplicates"] = self.dedup.duplicates
        server["moves_settled"] = {"finished": self.settler.finished, "rolled_back": self.settler.rolled_back}
        server.update(incarnation=self.incarnation, started_at=self.started_at, restored_from=self.restored_from,
                      model_version=self.served.version, staged_version=self.served.staged_version,
                      watching_deltas=self.watching_deltas, wal=self.log_stats(), background_cpu_s=self.store.background_cpu_s())
        body = {"tables": self.store.stats(), "server": server}
        return persia_pb2.StatsResponse(
            shard_index=self.store.shard_index, num_shards=self.store.num_shards, json=json.dumps(body),
            incarnation=self.incarnation,
        )

    def log_stats(self) -> dict:
        """The write-ahead log's figures and how this process's start replayed it (``durability: none``: only that)."""
        shard_log = self.store.log
        if shard_log is None:
            return {"durability": "none"}
        failure = shard_log.wal.failure()
        return {"durability": shard_log.durability, **dataclasses.asdict(shard_log.wal.stats),
                "replay": dataclasses.asdict(shard_log.report), "accepted_incarnations": sorted(self.accepted),
                "failed": str(failure) if failure else None}

    # ---- helpers -------------------------------------------------------------------------------------

    def _count(self, key: str, amount: int = 1) -> None:
        with self._counter_lock:
            self._counters[key] += amount

    def _check_incarnation(self, context) -> None:
        for key, value in context.invocation_metadata() or ():
            if key == INCARNATION_METADATA_KEY:
                expected = value.decode(errors="replace") if isinstance(value, bytes) else value
                if expected not in self.accepted:
                    restored = f", restored from {self.restored_from}" if self.restored_from else ", with empty tables"
                    raise RpcRefusal(
                        grpc.StatusCode.ABORTED,
                        f"shard restarted: the caller knew incarnation {expected!r}, this process is incarnation "
                        f"{self.incarnation!r} (started {time.time() - self.started_at:.1f} s ago{restored}); rows "
                        "written since the last checkpoint may be lost. Roll back to a checkpoint, then refresh the "
                        "client's incarnations (PSClient.wait_healthy)",
                    )
                return

    def _check_log(self) -> None:
        """After the write-ahead log failed, nothing is served that could expose or extend an unlogged write."""
        failure = self.store.log.wal.failure() if self.store.log is not None else None
        if failure is not None:
            raise failure

    def _check_serving(self, what: str) -> None:
        if not self.config.read_only:
            raise RpcRefusal(grpc.StatusCode.FAILED_PRECONDITION,
                             f"{what} refused: only read-only (inference) shards apply deltas; this is a training shard")
        if self.watching_deltas is not None:
            raise RpcRefusal(grpc.StatusCode.FAILED_PRECONDITION,
                             f"{what} refused: this shard applies the deltas of {self.watching_deltas} on its own (--watch-deltas)")

    def _checkpoint_directory(self, directory: str) -> str:
        return messages.checkpoint_directory(directory, self.config.checkpoint_root)

    def _checkpoint_url(self, url: str) -> str:
        """``url`` if this shard may save and load there: with a ``checkpoint_root``, only under it."""
        root = self.config.checkpoint_root
        if root is not None and not (remote_folder.is_remote(root) and url.startswith(root.rstrip("/") + "/") and ".." not in url.split("/")):
            raise RpcRefusal(grpc.StatusCode.PERMISSION_DENIED, f"checkpoint folder {url!r} is outside this shard's checkpoint_root {root!r}")
        return url
