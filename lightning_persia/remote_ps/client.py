"""Client of a parameter-server cluster: shards ids by hash, talks to every shard at once, retries, reassembles.

All RPCs run on one background thread with a ``grpc.aio`` event loop; the public ``*_async`` methods return
:class:`concurrent.futures.Future` objects, so a trainer can keep several batches in flight. Every table of a
call travels packed (one ids buffer and one rows or gradients buffer per message, see ``persia.proto``):
bucketing by shard and encoding run on the caller's thread in a few vectorised ops whatever the number of
tables (:meth:`PSClient.shard`, whose result a trainer reuses for the update of the same ids), and decoding
writes each shard's rows straight into one output tensor in the caller's id order.

Example::

    client = PSClient(["127.0.0.1:5000", "127.0.0.1:5001"])
    client.wait_healthy(60)
    client.configure([TableConfig("user", dim=16, optimizer=Adagrad(rowwise=True))])
    rows = client.lookup({"user": torch.tensor([3, 7, 11])}, train=True)["user"]      # float32 [3, 16]
    client.update({"user": (torch.tensor([3, 7, 11]), torch.randn(3, 16))})

    sharded = client.shard(KeyedIds(("user",), (3,), torch.tensor([3, 7, 11])))       # once per batch
    flat = client.lookup_sharded_async(sharded, train=True).result()                   # float32 [3 * 16]
    client.update_sharded_async(sharded, torch.randn(3 * 16), dims=[16])
"""
from __future__ import annotations

import asyncio
import atexit
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
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lightning_persia.ops import wire
from lightning_persia.ops.bucketize import bucketize
from lightning_persia.ops.keyed_ids import Block, KeyedIds, RowLayout
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
class _Message:
    """One message's share of a :class:`ShardedIds`: ids ``[start, end)`` of the shard order, with their tables."""

    shard: int
    start: int
    end: int
    tables: Tuple[str, ...]  # the tables it names, and their counts
    counts: Tuple[int, ...]
    table_counts: Tuple[int, ...]  # ids of every table of the KeyedIds in it (0 for the others)
    ids: bytes  # encoded once, sent with the lookup and again with the update of the same ids

    def blocks(self, layout: RowLayout) -> Iterator[Tuple[Block, int, int]]:
        """``(block, first row in shard order, rows)`` of each block of ``layout`` with ids in this message."""
        row = self.start
        for block, count in zip(layout.blocks, layout.block_counts(self.table_counts)):
            if count:
                yield block, row, count
                row += count


@dataclass(frozen=True)
class ShardedIds:
    """Ids of several tables bucketed by shard, split into messages and encoded: what :meth:`PSClient.shard` makes
    once per batch, for its lookup and its update.

    ``order[j]`` is the position in ``keyed`` of the ``j``-th id in shard order (None: one shard, the same order).
    """

    keyed: KeyedIds
    order: Optional[torch.Tensor]
    messages: Tuple[_Message, ...]


@dataclass(frozen=True)
class Sharder:
    """Buckets ids by shard, splits them into messages under the limits and encodes them (see :meth:`PSClient.shard`)."""

    num_shards: int
    max_ids_per_message: int
    max_message_bytes: int
    max_dim: int  # the widest table's: sizes the messages

    def __call__(self, keyed: KeyedIds) -> ShardedIds:
        buckets = bucketize(keyed, self.num_shards)
        per_id = 8 + max(w.itemsize for w in wire.WIRE_DTYPES.values()) * self.max_dim
        step = max(1, min(self.max_ids_per_message, (self.max_message_bytes // 2) // per_id))
        messages = []
        for shard in range(self.num_shards):
            first, last = buckets.starts[shard], buckets.starts[shard + 1]
            ends = np.cumsum(buckets.counts[shard])
            starts = ends - np.asarray(buckets.counts[shard])
            for start in range(first, max(last, first + 1), step):
                end = min(start + step, last)
                # shard 0's first message names every table, so that a table asked for no ids still gets its
                # dim (and unknown tables their NOT_FOUND)
                everything = shard == 0 and start == first
                counts = np.clip(ends, start - first, end - first) - np.clip(starts, start - first, end - first)
                keep = np.ones(len(counts), dtype=bool) if everything else counts > 0
                if not keep.any():
                    continue
                tables = tuple(t for t, k in zip(keyed.tables, keep) if k)
                messages.append(_Message(shard, start, end, tables, tuple(counts[keep].tolist()), tuple(counts.tolist()),
                                         wire.encode_ids(buckets.ids[start:end])))
        return ShardedIds(keyed, buckets.order, tuple(messages))


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
        retry_for_s: a failed attempt is also retried, beyond ``max_retries``, until the call has lasted this
            long: how long a shard may take to come back (a restart, a paused host) before the call fails.
            ``PersiaStrategy`` sets it to ``RecoveryConfig.wait_for_shards_s``.
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
        retry_for_s: float = 0.0,
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
        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0 or retry_for_s < 0 or max_ids_per_message < 1:
            raise ValueError("PSClient: timeout_s must be > 0, max_retries, retry_for_s and backoff_s >= 0, max_ids_per_message >= 1")
        self.addresses = list(addresses)
        self.num_shards = len(self.addresses)
        self.client_id = client_id or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_for_s = retry_for_s
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
        # A client left open is closed before the interpreter finalizes: its thread decodes rows with torch ops,
        # which release the GIL, and a daemon thread that takes the GIL back once finalization has begun is
        # ended by pthread_exit, whose unwinding through torch's C++ frames aborts the process (``terminate
        # called without an active exception``). atexit runs while every thread may still finish its call.
        atexit.register(self.close)

    @property
    def call_budget_s(self) -> float:
        """The longest a lookup, update or table call can last with its retries before it fails: what a caller
        waiting for one (a staleness window, a forward waiting for its rows) should wait at most."""
        retries = self.max_retries * (self.timeout_s + self.max_backoff_s)
        return max(retries, self.retry_for_s + self.max_backoff_s) + self.timeout_s

    # ---- lookups and updates -----------------------------------------------------------------------

    def shard(self, keyed: KeyedIds) -> ShardedIds:
        """Buckets ``keyed``'s ids by shard, splits them into messages under the limits and encodes them.

        The result serves the lookup of these ids (:meth:`lookup_sharded_async`) and the update of the same
        ids (:meth:`update_sharded_async`), so a training step buckets and encodes its ids once.
        """
        return self.sharder(keyed.tables)(keyed)

    def sharder(self, tables: Sequence[str] = ()) -> "Sharder":
        """What :meth:`shard` does, as a picklable function of the ids (for processes without a client, such as
        DataLoader workers); ``tables``: those whose dims size its messages (default: every table known)."""
        dims = self._dims if not tables else {t: self._dims.get(t, 0) for t in tables}
        return Sharder(self.num_shards, self.max_ids_per_message, self._max_message_bytes, max(dims.values(), default=0))

    def lookup_sharded_async(self, sharded: ShardedIds, *, train: bool, wire_dtype: str = "fp16") -> "Future[torch.Tensor]":
        """Rows of every id of ``sharded`` as one flat float32 tensor in its :class:`KeyedIds` order: table after
        table, ``[count, dim]`` each, row-major (every table's ids unique). ``train=True`` admits unseen ids."""
        _wire_enum(wire_dtype)
        return self._submit(self._lookup(sharded, train, wire_dtype))

    def lookup_async(self, ids: Mapping[str, torch.Tensor], *, train: bool, wire_dtype: str = "fp16") -> "Future[Dict[str, torch.Tensor]]":
        """Rows of ``ids`` per table (float32 ``[n, dim]`` on CPU, in the order of ``ids``).

        ``ids`` are int64, unique within each table. ``train=True`` admits unseen ids on the shards.
        """
        _wire_enum(wire_dtype)
        return self._submit(self._lookup_tables(self.shard(KeyedIds.from_dict(ids)), train, wire_dtype))

    async def _lookup_tables(self, sharded: ShardedIds, train: bool, wire_dtype: str) -> Dict[str, torch.Tensor]:
        flat = await self._lookup(sharded, train, wire_dtype)
        keyed = sharded.keyed
        dims = [self._dims[t] for t in keyed.tables]
        parts = torch.split(flat, [c * d for c, d in zip(keyed.counts, dims)])
        return {t: part.view(c, d) for t, part, c, d in zip(keyed.tables, parts, keyed.counts, dims)}

    async def _lookup(self, sharded: ShardedIds, train: bool, wire_dtype: str) -> torch.Tensor:
        dtype = _wire_enum(wire_dtype)
        requests = []
        for message in sharded.messages:
            request = persia_pb2.LookupRequest(train=train, dtype=dtype)
            request.packed.tables.extend(message.tables)
            request.packed.counts.extend(message.counts)
            request.packed.ids = message.ids
            requests.append(request)
        responses = await self._gather(
            self._call(message.shard, "Lookup", request, self.timeout_s) for message, request in zip(sharded.messages, requests)
        )
        for message, response in zip(sharded.messages, responses):
            if len(response.packed_dims) != len(message.tables):
                raise PSError(f"shard {message.shard} at {self.addresses[message.shard]} answered {len(response.packed_dims)} "
                              f"tables for {len(message.tables)}")
            self._dims.update(zip(message.tables, response.packed_dims))
        keyed, order = sharded.keyed, sharded.order
        layout = RowLayout(keyed.counts, [self._dims[t] for t in keyed.tables])
        out = torch.empty(layout.numel, dtype=torch.float32)
        for message, response in zip(sharded.messages, responses):
            where = f"rows of tables {list(message.tables)} from shard {message.shard}"
            values = wire.rows_view(response.packed_rows, wire_dtype, 1, what=where).view(-1)
            expected = sum(c * self._dims[t] for t, c in zip(message.tables, message.counts))
            if values.numel() != expected:
                raise PSError(f"shard {message.shard} answered {values.numel()} values of {where} for {expected}")
            taken = 0
            for block, row, count in message.blocks(layout):
                rows = values[taken : taken + count * block.dim].view(count, block.dim)
                taken += count * block.dim
                if order is None:
                    block.of(out)[row - block.first_row : row - block.first_row + count].copy_(rows)
                else:
                    block.of(out).index_copy_(0, order[row : row + count] - block.first_row, rows.float())
        return out

    def update_sharded_async(
        self, sharded: ShardedIds, grads: torch.Tensor, dims: Sequence[int], *, wire_dtype: str = "fp16", sender: Optional[str] = None,
    ) -> "Future[None]":
        """Sends the gradients of ``sharded``'s ids: ``grads`` is flat, in its :class:`KeyedIds` order (table after
        table, ``[count, dims[t]]`` each); each shard applies its part exactly once.

        Ids need not be unique (gradients of duplicates are summed on the shard). Every message carries
        ``sender`` (default: this client's id) and the sender's next sequence number, and is resent with the
        same number on retry. Clients that send the very same updates in the same order under one shared
        ``sender`` make each shard apply every update once, and each of them hears back only after it is
        applied (how ranks push one merged gradient, see ``embedding/rank_merge.py``).
        """
        sender = sender or self.client_id
        dtype = _wire_enum(wire_dtype)
        keyed, order = sharded.keyed, sharded.order
        layout = RowLayout(keyed.counts, dims)
        if grads.dim() != 1 or grads.numel() != layout.numel or not grads.is_floating_point():
            raise ValueError(
                f"grads must be a flat float tensor of {layout.numel} values (counts {list(keyed.counts)} x dims {list(dims)}), got "
                f"{grads.dtype} {tuple(grads.shape)}"
            )
        encoded = grads.detach().to(device="cpu", dtype=wire.WIRE_DTYPES[wire_dtype])
        calls = []
        for message in sharded.messages:
            if message.start == message.end:
                continue
            with self._seq_lock:
                seqs = self._seqs.setdefault(sender, [itertools.count(1) for _ in self.addresses])
                seq = next(seqs[message.shard])
            request = persia_pb2.UpdateRequest(client_id=sender, seq=seq, packed_dtype=dtype)
            named = [(t, c) for t, c in zip(message.tables, message.counts) if c]
            request.packed.tables.extend(t for t, _ in named)
            request.packed.counts.extend(c for _, c in named)
            request.packed.ids = message.ids
            parts = []
            for block, row, count in message.blocks(layout):
                rows = block.of(encoded)
                if order is None:
                    parts.append(rows[row - block.first_row : row - block.first_row + count])
                else:
                    parts.append(rows.index_select(0, order[row : row + count] - block.first_row))
            request.packed_grads = wire.encode_rows(parts[0] if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts]), wire_dtype)
            calls.append((message.shard, request))
        return self._submit(self._update(calls))

    def update_async(
        self, updates: Mapping[str, Tuple[torch.Tensor, torch.Tensor]], *, wire_dtype: str = "fp16", sender: Optional[str] = None,
    ) -> "Future[None]":
        """Sends gradients ``{table: (ids [n], grads [n, dim])}`` (see :meth:`update_sharded_async`)::

            client.update_async({"user": (ids, grads)}, sender="job-42-merged")
        """
        dims = []
        for name, (table_ids, table_grads) in updates.items():
            n = table_ids.numel() if isinstance(table_ids, torch.Tensor) else -1
            if not isinstance(table_grads, torch.Tensor) or table_grads.dim() != 2 or table_grads.shape[0] != n or not table_grads.is_floating_point():
                got = f"{table_grads.dtype} {tuple(table_grads.shape)}" if isinstance(table_grads, torch.Tensor) else type(table_grads).__name__
                raise ValueError(f"table {name!r}: grads must be a float tensor [n_ids={n}, dim], got {got}")
            dims.append(table_grads.shape[1])
        keyed = KeyedIds.from_dict({name: table_ids for name, (table_ids, _) in updates.items()})
        self._dims.update(zip(keyed.tables, dims))  # sizes the messages
        grads = [g.detach().reshape(-1) for _, g in updates.values()]
        flat = torch.cat(grads) if grads else torch.empty(0)
        return self.update_sharded_async(self.shard(keyed), flat, dims, wire_dtype=wire_dtype, sender=sender)

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
        stops the client's thread; the client cannot be used afterwards. Runs at interpreter exit if not called
        before."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)

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
        """One RPC with deadline and retries on UNAVAILABLE / DEADLINE_EXCEEDED (every PS call is idempotent):
        at least ``max_retries`` of them, and more until the call has lasted ``retry_for_s``."""
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
                if attempt > self.max_retries and time.monotonic() - start >= self.retry_for_s:
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
