"""Client of a parameter-server cluster: shards ids by hash, talks to every shard at once, retries, reassembles.

All RPCs run on one background thread with a ``grpc.aio`` event loop; the public ``*_async`` methods return
:class:`concurrent.futures.Future` objects, so a trainer can keep several batches in flight. Bucketing and
encoding run on the caller's thread (vectorised torch ops); decoding writes each shard's rows straight into
the output tensor in the caller's id order.

Example::

    client = PSClient(["127.0.0.1:5000", "127.0.0.1:5001"])
    client.wait_healthy(60)
    client.configure([TableConfig("user", dim=16, optimizer=Adagrad(rowwise=True))])
    rows = client.lookup({"user": torch.tensor([3, 7, 11])}, train=True)["user"]      # float32 [3, 16]
    client.update({"user": (torch.tensor([3, 7, 11]), torch.randn(3, 16))})
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lightning_persia.ops import wire
from lightning_persia.ops.hashing import shard_of
from lightning_persia.remote_ps.protocol import SERVICE_NAME, persia_pb2, persia_pb2_grpc
from lightning_persia.remote_ps.table_config import TableConfig

_WIRE_ENUM = {"fp16": persia_pb2.FP16, "fp32": persia_pb2.FP32}
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_FENCED = frozenset({"Lookup", "Update", "Save", "SaveDelta"})  # as remote_ps.server.FENCED_METHODS (no server import here)
_INCARNATION_KEY = "persia-incarnation"

PathOrPEM = Union[str, os.PathLike, bytes]


class PSError(RuntimeError):
    """Base of the errors of a parameter-server call."""


class PSRequestError(PSError):
    """A shard refused or failed a request; carries the shard, its address, the status code and its message."""

    def __init__(self, shard: int, address: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"shard {shard} at {address} answered {code.name}: {details}")
        self.shard, self.address, self.code, self.details = shard, address, code, details


class ShardRestartedError(PSRequestError):
    """A shard restarted since this client learnt its incarnation (``ABORTED``): rows written since the last
    checkpoint may be lost on it, so the call was refused. Roll back to a checkpoint, then call
    :meth:`PSClient.wait_healthy` (or :meth:`PSClient.refresh_incarnations`) to talk to the new incarnation."""


class ShardUnavailableError(PSError):
    """A shard did not answer after every retry."""

    def __init__(self, shard: int, address: str, tries: int, elapsed_s: float, last_error: str) -> None:
        super().__init__(
            f"shard {shard} at {address} did not answer after {tries} tries over {elapsed_s:.1f} s: {last_error}"
        )
        self.shard, self.address, self.tries, self.elapsed_s, self.last_error = shard, address, tries, elapsed_s, last_error


@dataclass(frozen=True)
class ShardWait:
    """What :meth:`PSClient.wait_healthy` reports while a shard has not answered yet."""

    shard: int
    address: str
    waited_s: float
    timeout_s: float
    last_error: str  # why the last health check failed


WaitCallback = Callable[[ShardWait], None]


@dataclass
class _Bucketed:
    """One table's ids grouped by shard: ``ids[order]`` is sorted by shard, shard s owns ``[starts[s], starts[s+1])``."""

    ids: torch.Tensor  # ids in shard order
    order: Optional[torch.Tensor]  # position in the caller's tensor of each id in shard order; None: identity
    starts: List[int]


# (table, start, end) of the shard-ordered ids of a table carried by one message
_Piece = Tuple[str, int, int]


def _read_pem(value: Optional[PathOrPEM]) -> Optional[bytes]:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


class PSClient:
    """Talks to the shards of one parameter-server cluster (``addresses[i]`` is shard ``i``).

    Args:
        addresses: ``host:port`` of every shard, in shard order.
        token: shared secret, sent as ``authorization: Bearer <token>`` on every call.
        tls_root_cert: PEM bytes or path of the CA (or self-signed certificate) that signed the shards'
            certificates; enables TLS.
        tls_client_cert, tls_client_key: PEM bytes or paths of this client's certificate, for shards that
            require client certificates.
        tls_server_name: name to check the shards' certificates against, when it differs from the address.
        timeout_s: deadline of one attempt of a lookup, update or table call.
        max_retries: retries of an attempt that failed with UNAVAILABLE or DEADLINE_EXCEEDED (every call is
            safe to retry: updates carry a sequence number that the shard applies once).
        backoff_s, max_backoff_s: exponential back-off between retries (with jitter).
        client_id: identity of this client for exactly-once updates; unique by default.
        max_ids_per_message: larger requests to one shard are split into several messages.
        max_message_mb: gRPC message limit; requests are also split to stay under half of it.
        checkpoint_timeout_s: deadline of a save or load.
        interceptors: ``grpc.aio`` client interceptors of every channel (e.g. ``remote_ps.metrics.ClientRpcMetrics``).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        token: Optional[str] = None,
        tls_root_cert: Optional[PathOrPEM] = None,
        tls_client_cert: Optional[PathOrPEM] = None,
        tls_client_key: Optional[PathOrPEM] = None,
        tls_server_name: Optional[str] = None,
        timeout_s: float = 30.0,
        max_retries: int = 5,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        client_id: Optional[str] = None,
        max_ids_per_message: int = 1 << 18,
        max_message_mb: int = 512,
        checkpoint_timeout_s: float = 3600.0,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        if not addresses:
            raise ValueError("PSClient needs the address of at least one shard")
        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0 or max_ids_per_message < 1:
            raise ValueError("PSClient: timeout_s must be > 0, max_retries and backoff_s >= 0, max_ids_per_message >= 1")
        self.addresses = list(addresses)
        self.num_shards = len(self.addresses)
        self.client_id = client_id or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_ids_per_message = max_ids_per_message
        self.checkpoint_timeout_s = checkpoint_timeout_s
        self._max_message_bytes = max_message_mb << 20
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        # Incarnation of each shard as last seen (wait_healthy / refresh_incarnations); once known, lookups,
        # updates and saves carry it, and a restarted shard refuses them with ShardRestartedError.
        self.incarnations: List[Optional[str]] = [None] * len(self.addresses)
        self._seqs: Dict[str, List[Iterator[int]]] = {}  # per sender, per shard
        self._seq_lock = threading.Lock()
        self._dims: Dict[str, int] = {}

        options = [
            ("grpc.max_send_message_length", self._max_message_bytes),
            ("grpc.max_receive_message_length", self._max_message_bytes),
            ("grpc.enable_retries", 0),  # retries are ours, with the same sequence number
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        credentials = None
        if tls_root_cert is not None or tls_client_cert is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(tls_root_cert),
                private_key=_read_pem(tls_client_key),
                certificate_chain=_read_pem(tls_client_cert),
            )

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="persia-ps-client", daemon=True)
        self._thread.start()
        self._closed = False

        async def connect() -> None:
            chained = list(interceptors) or None
            make = (lambda a: grpc.aio.secure_channel(a, credentials, options, interceptors=chained)) if credentials else (
                lambda a: grpc.aio.insecure_channel(a, options, interceptors=chained))
            self._channels = [make(address) for address in self.addresses]
            self._stubs = [persia_pb2_grpc.ParameterServerStub(c) for c in self._channels]
            self._health = [health_pb2_grpc.HealthStub(c) for c in self._channels]

        self._submit(connect()).result()

    # ---- lookups and updates -----------------------------------------------------------------------

    def lookup_async(self, ids: Mapping[str, torch.Tensor], *, train: bool, wire_dtype: str = "fp16") -> "Future[Dict[str, torch.Tensor]]":
        """Rows of ``ids`` per table (float32 ``[n, dim]`` on CPU, in the order of ``ids``).

        ``ids`` are int64, unique within each table. ``train=True`` admits unseen ids on the shards.
        """
        dtype = _wire_enum(wire_dtype)
        buckets = {name: self._bucket(name, table_ids) for name, table_ids in ids.items()}
        elem = wire.WIRE_DTYPES[wire_dtype].itemsize
        requests: List[Tuple[int, persia_pb2.LookupRequest, List[_Piece]]] = []
        for shard in range(self.num_shards):
            segments = [(name, b.starts[shard], b.starts[shard + 1], 8 + elem * self._dims.get(name, 0)) for name, b in buckets.items()]
            messages = self._pack(segments)
            empty = [(name, 0, 0) for name, b in buckets.items() if b.ids.numel() == 0]
            if shard == 0 and empty:  # shard 0 tells the dim of a table asked for no ids (and that it exists)
                messages = [messages[0] + empty] + messages[1:] if messages else [empty]
            for pieces in messages:
                request = persia_pb2.LookupRequest(train=train, dtype=dtype)
                for name, start, end in pieces:
                    request.tables.add(table=name, ids=wire.encode_ids(buckets[name].ids[start:end]))
                requests.append((shard, request, pieces))
        return self._submit(self._lookup(buckets, requests, wire_dtype))

    async def _lookup(self, buckets: Dict[str, _Bucketed], requests, wire_dtype: str) -> Dict[str, torch.Tensor]:
        responses = await self._gather(
            self._call(shard, "Lookup", request, self.timeout_s) for shard, request, _ in requests
        )
        out: Dict[str, torch.Tensor] = {}
        for (shard, _, pieces), response in zip(requests, responses):
            if len(response.tables) != len(pieces):
                raise PSError(f"shard {shard} at {self.addresses[shard]} answered {len(response.tables)} tables for {len(pieces)}")
            for (name, start, end), rows in zip(pieces, response.tables):
                bucket = buckets[name]
                view = wire.rows_view(rows.rows, wire_dtype, rows.dim, what=f"rows of table {name!r} from shard {shard}")
                if view.shape[0] != end - start:
                    raise PSError(f"shard {shard} answered {view.shape[0]} rows of table {name!r} for {end - start} ids")
                self._dims[name] = rows.dim
                target = out.get(name)
                if target is None:
                    target = out[name] = torch.empty(bucket.ids.numel(), rows.dim, dtype=torch.float32)
                if bucket.order is None:
                    target[start:end].copy_(view)
                else:
                    target.index_copy_(0, bucket.order[start:end], view.to(torch.float32))
        return out

    def update_async(
        self, updates: Mapping[str, Tuple[torch.Tensor, torch.Tensor]], *, wire_dtype: str = "fp16", sender: Optional[str] = None,
    ) -> "Future[None]":
        """Sends gradients ``{table: (ids [n], grads [n, dim])}``; each shard applies its part exactly once.

        Ids need not be unique (gradients of duplicates are summed on the shard). Every message carries
        ``sender`` (default: this client's id) and the sender's next sequence number, and is resent with the
        same number on retry. Clients that send the very same updates in the same order under one shared
        ``sender`` make each shard apply every update once, and each of them hears back only after it is
        applied (how ranks push one merged gradient, see ``embedding/rank_merge.py``)::

            client.update_async({"user": (ids, grads)}, sender="job-42-merged")
        """
        sender = sender or self.client_id
        dtype = _wire_enum(wire_dtype)
        buckets: Dict[str, _Bucketed] = {}
        grads: Dict[str, torch.Tensor] = {}
        for name, (table_ids, table_grads) in updates.items():
            bucket = buckets[name] = self._bucket(name, table_ids)
            if table_grads.dim() != 2 or table_grads.shape[0] != bucket.ids.numel() or not table_grads.is_floating_point():
                raise ValueError(
                    f"table {name!r}: grads must be a float tensor [n_ids={bucket.ids.numel()}, dim], got "
                    f"{table_grads.dtype} {tuple(table_grads.shape)}"
                )
            encoded = table_grads.detach().to(dtype=wire.WIRE_DTYPES[wire_dtype]).cpu()
            grads[name] = encoded if bucket.order is None else encoded.index_select(0, bucket.order)
        elem = wire.WIRE_DTYPES[wire_dtype].itemsize
        calls = []
        for shard in range(self.num_shards):
            segments = [(name, b.starts[shard], b.starts[shard + 1], 8 + elem * grads[name].shape[1]) for name, b in buckets.items()]
            for pieces in self._pack(segments):
                with self._seq_lock:
                    seqs = self._seqs.setdefault(sender, [itertools.count(1) for _ in self.addresses])
                    seq = next(seqs[shard])
                request = persia_pb2.UpdateRequest(client_id=sender, seq=seq)
                for name, start, end in pieces:
                    request.tables.add(
                        table=name, ids=wire.encode_ids(buckets[name].ids[start:end]),
                        grads=wire.encode_rows(grads[name][start:end], wire_dtype), dtype=dtype,
                    )
                calls.append((shard, request))
        return self._submit(self._update(calls))

    async def _update(self, calls) -> None:
        await self._gather(self._call(shard, "Update", request, self.timeout_s) for shard, request in calls)

    def lookup(self, ids: Mapping[str, torch.Tensor], *, train: bool, wire_dtype: str = "fp16") -> Dict[str, torch.Tensor]:
        """Blocking :meth:`lookup_async`."""
        return self.lookup_async(ids, train=train, wire_dtype=wire_dtype).result()

    def update(
        self, updates: Mapping[str, Tuple[torch.Tensor, torch.Tensor]], *, wire_dtype: str = "fp16", sender: Optional[str] = None,
    ) -> None:
        """Blocking :meth:`update_async`."""
        self.update_async(updates, wire_dtype=wire_dtype, sender=sender).result()

    # ---- tables, checkpoints, stats ----------------------------------------------------------------

    def configure(self, tables: Sequence[TableConfig]) -> List[TableConfig]:
        """Creates the tables on every shard (or checks them against existing ones); returns the configs in force."""
        request = persia_pb2.ConfigureRequest(tables_json=[json.dumps(t.to_dict()) for t in tables])
        responses = self._all("Configure", request, self.timeout_s)
        configs = [[TableConfig.from_dict(json.loads(text)) for text in r.tables_json] for r in responses]
        for shard, shard_configs in enumerate(configs[1:], start=1):
            if shard_configs != configs[0]:
                raise PSError(f"shards 0 and {shard} hold different configurations of the same tables: {configs[0]} vs {shard_configs}")
        self._dims.update((c.name, c.dim) for c in configs[0])
        return configs[0]

    def describe(self, names: Optional[Sequence[str]] = None) -> Dict[str, TableConfig]:
        """Configurations of the given tables (default: all tables), as shard 0 holds them."""
        response = self._wait(self._call(0, "Describe", persia_pb2.DescribeRequest(names=list(names or ())), self.timeout_s))
        configs = [TableConfig.from_dict(json.loads(text)) for text in response.tables_json]
        self._dims.update((c.name, c.dim) for c in configs)
        return {c.name: c for c in configs}

    def save(self, directory: Union[str, os.PathLike]) -> None:
        """Every shard writes its part of a checkpoint under ``directory`` (a path all shards can reach).

        Each shard's folder appears atomically; all carry one save id, so a save into the same directory that
        is interrupted half-way leaves a checkpoint that loads refuse. Save into a fresh directory to keep the
        previous checkpoint loadable until this one is complete.
        """
        request = persia_pb2.SaveRequest(directory=os.path.abspath(directory), save_id=uuid.uuid4().hex)
        self._all("Save", request, self.checkpoint_timeout_s)

    def load(self, directory: Union[str, os.PathLike]) -> None:
        """Every shard replaces its tables by its part of the checkpoint under ``directory`` (any shard count)."""
        self._all("Load", persia_pb2.LoadRequest(directory=os.path.abspath(directory)), self.checkpoint_timeout_s)
        self._dims.clear()

    def save_delta(self, directory: Union[str, os.PathLike], save_id: str, base_id: str = "") -> None:
        """Every shard writes under ``directory`` what changed since the delta ``base_id`` (an earlier ``save_id``).

        A shard that does not know ``base_id`` (empty, forgotten, or the shard restarted or loaded a checkpoint
        since) writes its tables whole; its manifest says so per table (``since: 0``). Used by
        ``lightning_persia.serving.PublishDeltas``.
        """
        request = persia_pb2.SaveDeltaRequest(directory=os.path.abspath(directory), save_id=save_id, base_id=base_id)
        self._all("SaveDelta", request, self.checkpoint_timeout_s)

    def stage_delta(self, directory: Union[str, os.PathLike], version: int, base_version: int) -> int:
        """Read-only shards read and check the delta's tables at ``directory`` (from ``base_version`` to ``version``)
        without applying them; returns the rows they will write. Nothing is staged on a shard that refuses it."""
        request = persia_pb2.StageDeltaRequest(directory=os.path.abspath(directory), version=version, base_version=base_version)
        return sum(response.rows for response in self._all("StageDelta", request, self.checkpoint_timeout_s))

    def commit_delta(self, version: int) -> None:
        """Read-only shards apply the delta they staged for ``version`` (a shard at ``version`` already does nothing)."""
        self._all("CommitDelta", persia_pb2.CommitDeltaRequest(version=version), self.checkpoint_timeout_s)

    def stats(self) -> List[Dict[str, Any]]:
        """Per shard: ``{"shard_index", "num_shards", "address", "tables": {...}, "server": {...}}``."""
        out = []
        for shard, response in enumerate(self._all("Stats", persia_pb2.StatsRequest(), self.timeout_s)):
            body = json.loads(response.json)
            out.append({"shard_index": response.shard_index, "num_shards": response.num_shards,
                        "address": self.addresses[shard], "incarnation": response.incarnation, **body})
        return out

    def wait_healthy(
        self, timeout_s: float = 60.0, *, on_wait: Optional[WaitCallback] = None, report_every_s: float = 5.0,
    ) -> None:
        """Waits until every shard reports SERVING and is the shard its position says it is.

        Also records every shard's incarnation: from then on a shard that restarts refuses this client's
        lookups, updates and saves (:class:`ShardRestartedError`) until it is called again.

        Args:
            timeout_s: how long a shard may take to answer; then :class:`ShardUnavailableError`.
            on_wait: called as ``on_wait(ShardWait(...))`` every ``report_every_s`` seconds for each shard that
                has not answered yet (on the client's thread), so that a long wait is never silent.
            report_every_s: seconds between two reports on one shard.
        """
        if report_every_s <= 0:
            raise ValueError(f"report_every_s must be > 0, got {report_every_s}")
        self._wait(self._wait_healthy(timeout_s, on_wait, report_every_s))
        self.refresh_incarnations()

    def refresh_incarnations(self) -> List[str]:
        """Reads every shard's current incarnation and accepts it (after a restart has been dealt with)."""
        stats = self.stats()
        _check_shard_order(self.addresses, [(entry["shard_index"], entry["num_shards"]) for entry in stats])
        self.incarnations = [entry["incarnation"] or None for entry in stats]
        return list(self.incarnations)

    async def _wait_healthy(self, timeout_s: float, on_wait: Optional[WaitCallback], report_every_s: float) -> None:
        start = time.monotonic()

        async def one(shard: int) -> None:
            last = "no answer yet"
            tries = 0
            next_report = report_every_s
            while True:
                tries += 1
                remaining = timeout_s - (time.monotonic() - start)
                try:
                    response = await self._health[shard].Check(
                        health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=max(0.05, min(2.0, remaining)),
                        metadata=self._metadata or None,
                    )
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                    last = f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
                except grpc.aio.AioRpcError as err:
                    last = f"{err.code().name}: {err.details()}"
                waited = time.monotonic() - start
                if waited + 0.1 > timeout_s:
                    raise ShardUnavailableError(shard, self.addresses[shard], tries, waited, last)
                if on_wait is not None and waited >= next_report:
                    next_report += report_every_s
                    on_wait(ShardWait(shard, self.addresses[shard], waited, timeout_s, last))
                await asyncio.sleep(0.1)

        await self._gather(one(shard) for shard in range(self.num_shards))

    def close(self) -> None:
        """Cancels calls still in flight (their futures raise ``CancelledError``), closes the channels and
        stops the client's thread; the client cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True

        async def disconnect() -> None:
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await asyncio.gather(*(channel.close() for channel in self._channels))

        try:
            asyncio.run_coroutine_threadsafe(disconnect(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- plumbing ----------------------------------------------------------------------------------

    def _bucket(self, name: str, ids: torch.Tensor) -> _Bucketed:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
            got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"table {name!r}: ids must be a 1-d int64 tensor, got {got}")
        ids = ids.to(device="cpu", dtype=torch.int64)
        n = ids.numel()
        if self.num_shards == 1:
            return _Bucketed(ids, None, [0, n])
        shards = shard_of(ids, self.num_shards)
        shards, order = torch.sort(shards, stable=True)
        counts = torch.bincount(shards, minlength=self.num_shards)
        starts = [0] + torch.cumsum(counts, 0).tolist()
        return _Bucketed(ids.index_select(0, order), order, starts)

    def _pack(self, segments: List[Tuple[str, int, int, int]]) -> List[List[_Piece]]:
        """Splits one shard's ``(table, start, end, bytes_per_id)`` segments into messages under the limits."""
        limit = self._max_message_bytes // 2
        messages: List[List[_Piece]] = [[]]
        ids = size = 0
        for name, start, end, per_id in segments:
            while start < end:
                room = min(self.max_ids_per_message - ids, (limit - size) // per_id)
                if room <= 0 and messages[-1]:
                    messages.append([])
                    ids = size = 0
                    continue
                take = min(max(room, 1), end - start)
                messages[-1].append((name, start, start + take))
                ids, size, start = ids + take, size + take * per_id, start + take
        return [m for m in messages if m]

    def _submit(self, coroutine: Awaitable) -> Future:
        if self._closed:
            coroutine.close()  # type: ignore[attr-defined]
            raise PSError("this PSClient is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)  # type: ignore[arg-type]

    def _wait(self, coroutine: Awaitable) -> Any:
        return self._submit(coroutine).result()

    def _all(self, method: str, request, timeout_s: float) -> list:
        return self._wait(self._gather(self._call(shard, method, request, timeout_s) for shard in range(self.num_shards)))

    @staticmethod
    async def _gather(coroutines) -> list:
        """Waits for every call (none is abandoned half-way), then raises the first error in shard order."""
        results = await asyncio.gather(*coroutines, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _call(self, shard: int, method: str, request, timeout_s: float):
        """One RPC with deadline and retries on UNAVAILABLE / DEADLINE_EXCEEDED (every PS call is idempotent)."""
        rpc = getattr(self._stubs[shard], method)
        start = time.monotonic()
        for attempt in itertools.count(1):
            metadata = self._metadata
            incarnation = self.incarnations[shard]
            if incarnation is not None and method in _FENCED:
                metadata = metadata + ((_INCARNATION_KEY, incarnation),)
            try:
                return await rpc(request, timeout=timeout_s, metadata=metadata or None)
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code == grpc.StatusCode.ABORTED and method in _FENCED:
                    raise ShardRestartedError(shard, self.addresses[shard], code, err.details() or "") from None
                if code not in _RETRYABLE:
                    raise PSRequestError(shard, self.addresses[shard], code, err.details() or "") from None
                if attempt > self.max_retries:
                    raise ShardUnavailableError(
                        shard, self.addresses[shard], attempt, time.monotonic() - start,
                        f"{method}: {code.name}: {err.details()}",
                    ) from None
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))


def _check_shard_order(addresses: Sequence[str], identities: Sequence[Tuple[int, int]]) -> None:
    """Raises :class:`PSError` unless ``addresses[i]`` is shard ``i`` of ``len(addresses)`` for every ``i``.

    The message names every address that is out of place, what it is, and the list the shards ask for.
    """
    wrong = [(shard, address, index, count) for shard, (address, (index, count)) in enumerate(zip(addresses, identities))
             if (index, count) != (shard, len(addresses))]
    if not wrong:
        return
    listed = len(addresses)
    details = "; ".join(f"{address} is shard {index} of {count}, listed as shard {shard} of {listed}"
                        for shard, address, index, count in wrong)
    counts = sorted({count for _, count in identities})
    if counts != [listed]:
        advice = (f"the shards answering are part of a cluster of {' or '.join(map(str, counts))} shards, but "
                  f"{listed} address{'es are' if listed != 1 else ' is'} listed: list every shard of the cluster, once each")
    else:
        by_index = {index: address for address, (index, _) in zip(addresses, identities)}
        advice = ("pass the addresses in shard order: " + ", ".join(by_index[i] for i in range(listed))
                  if len(by_index) == listed else "an address is listed twice: list every shard of the cluster, once each")
    raise PSError(f"the parameter-server addresses do not match the shards: {details}. {advice} "
                  f"(listed: {', '.join(addresses)})")


def _wire_enum(name: str) -> int:
    try:
        return _WIRE_ENUM[name]
    except KeyError:
        raise ValueError(f"wire_dtype must be one of {sorted(_WIRE_ENUM)}, got {name!r}") from None
