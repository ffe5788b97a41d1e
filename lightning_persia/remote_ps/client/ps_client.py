"""The training hot path of the client: lookups and updates of many tables on every shard at once.

Every table of a call travels packed (one ids buffer and one rows or gradients buffer per message, see
``persia.proto``): bucketing by shard and encoding run on the caller's thread in a few vectorised ops whatever
the number of tables (:meth:`PSClient.shard`, whose result a trainer reuses for the update of the same ids),
and decoding writes each shard's rows straight into one output tensor in the caller's id order. The calls
off the hot path are :class:`~lightning_persia.remote_ps.client.admin.ShardAdmin`'s.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from concurrent.futures import Future
from typing import Awaitable, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import grpc
import grpc.aio
import torch

from lightning_persia.ops import wire
from lightning_persia.ops.keyed_ids import KeyedIds, RowLayout
from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.client.admin import ShardAdmin
from lightning_persia.remote_ps.client.connection import PathOrPEM
from lightning_persia.remote_ps.client.errors import PSError, ShardMapMovedError
from lightning_persia.remote_ps.client.retry import RetryPolicy
from lightning_persia.remote_ps.client.sharding import ShardedIds, Sharder
from lightning_persia.remote_ps import handover_wire
from lightning_persia.remote_ps.protocol import WIRE_DTYPE_ENUMS, WIRE_DTYPE_NAMES, persia_pb2

log = logging.getLogger("lightning_persia.ps.client")

SEQS_PER_UPDATE = 1 << 20
"""Sequence numbers an update numbered by its sender may use on each shard (``update_sharded_async(seq_base=...)``):
more than its messages to one shard can be (an update of 2^18 ids per message would need 2^38 ids to fill them)."""


class PSClient(ShardAdmin):
    """Talks to the shards of one parameter-server cluster (``addresses[i]`` is shard ``i``).

    Args:
        addresses: ``host:port`` of every shard, in shard order.
        token: shared secret, sent as ``authorization: Bearer <token>`` on every call.
        tls_root_cert: PEM bytes or path of the CA (or self-signed certificate) that signed the shards'
            certificates; enables TLS.
        tls_client_cert, tls_client_key: PEM bytes or paths of this client's certificate, for shards that
            require client certificates.
        tls_server_name: name to check the shards' certificates against, when it differs from the address.
        retry: deadline of one attempt and retries of a lookup, update or table call (default ``RetryPolicy()``;
            every call is safe to retry: updates carry a sequence number that the shard applies once).
            ``PersiaStrategy`` sets its ``retry_for_s`` to ``RecoveryConfig.wait_for_shards_s``.
        client_id: identity of this client for exactly-once updates; unique by default.
        max_ids_per_message: larger requests to one shard are split into several messages.
        max_message_mb: gRPC message limit; requests are also split to stay under half of it.
        checkpoint_timeout_s: deadline of a save or load.
        interceptors: ``grpc.aio`` client interceptors of every channel (e.g. ``remote_ps.metrics.ClientRpcMetrics``).

    The retry settings are :attr:`retry`, which may be changed while the client is in use.

    Example::

        PSClient(["ps-0:5000", "ps-1:5000"], retry=RetryPolicy(timeout_s=10, max_retries=0))
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
        retry: Optional[RetryPolicy] = None,
        client_id: Optional[str] = None,
        max_ids_per_message: int = 1 << 18,
        max_message_mb: int = 512,
        checkpoint_timeout_s: float = 3600.0,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        if max_ids_per_message < 1:
            raise ValueError(f"PSClient: max_ids_per_message must be >= 1, got {max_ids_per_message}")
        self.client_id = client_id or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.max_ids_per_message = max_ids_per_message
        self.shard_map = ShardMap.uniform(len(addresses))
        """Where ids live: the map this client buckets them by."""
        self._seqs: Dict[str, List[Iterator[int]]] = {}  # per sender, per shard
        self._seq_lock = threading.Lock()
        super().__init__(
            addresses, retry=retry if retry is not None else RetryPolicy(), checkpoint_timeout_s=checkpoint_timeout_s, token=token, tls_root_cert=tls_root_cert,
            tls_client_cert=tls_client_cert, tls_client_key=tls_client_key, tls_server_name=tls_server_name,
            max_message_mb=max_message_mb, interceptors=interceptors,
        )

    @property
    def call_budget_s(self) -> float:
        """The longest a lookup, update or table call can last with its retries before it fails: what a caller
        waiting for one (a staleness window, a forward waiting for its rows) should wait at most."""
        return self.retry.budget_s

    # ---- sharding ------------------------------------------------------------------------------------

    def shard(self, keyed: KeyedIds) -> ShardedIds:
        """Buckets ``keyed``'s ids by shard, splits them into messages under the limits and encodes them.

        The result serves the lookup of these ids (:meth:`lookup_sharded_async`) and the update of the same
        ids (:meth:`update_sharded_async`), so a training step buckets and encodes its ids once.
        """
        return self.sharder(keyed.tables)(keyed)

    def sharder(self, tables: Sequence[str] = ()) -> Sharder:
        """What :meth:`shard` does, as a picklable function of the ids (for processes without a client, such as
        DataLoader workers); ``tables``: those whose dims size its messages (default: every table known)."""
        dims = self._dims if not tables else {t: self._dims.get(t, 0) for t in tables}
        return Sharder(self.shard_map, self.max_ids_per_message, self._max_message_bytes, max(dims.values(), default=0))

    # ---- lookups -------------------------------------------------------------------------------------

    def lookup_sharded_async(
        self, sharded: ShardedIds, *, train: bool, wire_dtype: str = "fp16", out: Optional[torch.Tensor] = None,
    ) -> "Future[torch.Tensor]":
        """Rows of every id of ``sharded`` as one flat float32 tensor in its :class:`KeyedIds` order: table after
        table, ``[count, dim]`` each, row-major (every table's ids unique). ``train=True`` admits unseen ids.
        ``out``: a flat float32 tensor of that size the rows are decoded into (e.g. a buffer another process reads)."""
        _wire_enum(wire_dtype)
        return self._submit(self._lookup(sharded, train, wire_dtype, out))

    def lookup_async(self, ids: Mapping[str, torch.Tensor], *, train: bool, wire_dtype: str = "fp16") -> "Future[Dict[str, torch.Tensor]]":
        """Rows of ``ids`` per table (float32 ``[n, dim]`` on CPU, in the order of ``ids``).

        ``ids`` are int64, unique within each table. ``train=True`` admits unseen ids on the shards.
        """
        _wire_enum(wire_dtype)
        return self._submit(self._lookup_tables(self.shard(KeyedIds.from_dict(ids)), train, wire_dtype))

    def lookup(self, ids: Mapping[str, torch.Tensor], *, train: bool, wire_dtype: str = "fp16") -> Dict[str, torch.Tensor]:
        """Blocking :meth:`lookup_async`."""
        return self.lookup_async(ids, train=train, wire_dtype=wire_dtype).result()

    async def _lookup_tables(self, sharded: ShardedIds, train: bool, wire_dtype: str) -> Dict[str, torch.Tensor]:
        flat = await self._lookup(sharded, train, wire_dtype)
        keyed = sharded.keyed
        dims = [self._dims[t] for t in keyed.tables]
        parts = torch.split(flat, [c * d for c, d in zip(keyed.counts, dims)])
        return {t: part.view(c, d) for t, part, c, d in zip(keyed.tables, parts, keyed.counts, dims)}

    async def _lookup(self, sharded: ShardedIds, train: bool, wire_dtype: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        while True:
            if sharded.map_version != self.shard_map.version:  # routed before this client heard of the map in force
                sharded = self.shard(sharded.keyed)
            try:
                return await self._lookup_routed(sharded, train, wire_dtype, out)
            except ShardMapMovedError as moved:  # a lookup changes nothing a second one would change again
                await self._follow_map(moved.shard, moved.version)

    async def _lookup_routed(self, sharded: ShardedIds, train: bool, wire_dtype: str, out: Optional[torch.Tensor]) -> torch.Tensor:
        dtype = _wire_enum(wire_dtype)
        requests = []
        for message in sharded.messages:
            request = persia_pb2.LookupRequest(train=train, dtype=dtype, map_version=sharded.map_version)
            request.packed.tables.extend(message.tables)
            request.packed.counts.extend(message.counts)
            request.packed.ids = message.ids
            requests.append(request)
        responses = await self._gather(
            self._call(message.shard, "Lookup", request, self.retry.timeout_s, self._moved_away(message.shard, sharded.map_version))
            for message, request in zip(sharded.messages, requests)
        )
        await self._notice_map(responses, [message.shard for message in sharded.messages])
        for message, response in zip(sharded.messages, responses):
            if len(response.packed_dims) != len(message.tables):
                raise PSError(f"shard {message.shard} at {self.addresses[message.shard]} answered {len(response.packed_dims)} "
                              f"tables for {len(message.tables)}")
            self._dims.update(zip(message.tables, response.packed_dims))
        keyed, order = sharded.keyed, sharded.order
        layout = RowLayout(keyed.counts, [self._dims[t] for t in keyed.tables])
        if out is None:
            out = torch.empty(layout.numel, dtype=torch.float32)
        elif out.dtype != torch.float32 or out.dim() != 1 or out.numel() != layout.numel:
            raise ValueError(f"out must be a flat float32 tensor of {layout.numel} values, got {out.dtype} {tuple(out.shape)}")
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

    # ---- updates -------------------------------------------------------------------------------------

    def update_sharded_async(
        self, sharded: ShardedIds, grads: torch.Tensor, dims: Sequence[int], *, wire_dtype: str = "fp16", sender: Optional[str] = None,
        seq_base: Optional[int] = None,
    ) -> "Future[None]":
        """Sends the gradients of ``sharded``'s ids: ``grads`` is flat, in its :class:`KeyedIds` order (table after
        table, ``[count, dims[t]]`` each); each shard applies its part exactly once.

        Ids need not be unique (gradients of duplicates are summed on the shard). Every message carries
        ``sender`` (default: this client's id) and the sender's next sequence number, and is resent with the
        same number on retry. Clients that send the very same updates in the same order under one shared
        ``sender``, routed by the same shard map, make each shard apply every update once, and each of them
        hears back only after it is applied.

        ``seq_base``: the caller numbers the sender's updates itself (the ``n``-th one takes ``n *
        SEQS_PER_UPDATE``), so that another client (an embedding worker started in place of one that died) can
        send the same update again under the same numbers, which the shards apply once; each shard's messages
        of this update take ``seq_base``, ``seq_base + 1``, ... A sender is numbered one way or the other, never both.
        """
        if seq_base is not None and seq_base < 1:
            raise ValueError(f"seq_base must be >= 1, got {seq_base}")
        sender = sender or self.client_id
        dtype = _wire_enum(wire_dtype)
        keyed = sharded.keyed
        if sharded.map_version != self.shard_map.version:  # routed before this client heard of the map in force
            sharded = self.shard(keyed)
        layout = RowLayout(keyed.counts, dims)
        if grads.dim() != 1 or grads.numel() != layout.numel or not grads.is_floating_point():
            raise ValueError(
                f"grads must be a flat float tensor of {layout.numel} values (counts {list(keyed.counts)} x dims {list(dims)}), got "
                f"{grads.dtype} {tuple(grads.shape)}"
            )
        encoded = grads.detach().to(device="cpu", dtype=wire.WIRE_DTYPES[wire_dtype])
        return self._submit(self._update(self._update_calls(sharded, encoded, layout, dtype, wire_dtype, sender, seq_base)))

    def _update_calls(self, sharded: ShardedIds, encoded: torch.Tensor, layout: RowLayout, dtype: int, wire_dtype: str,
                      sender: str, seq_base: Optional[int] = None,
                      resent_seq: Optional[int] = None) -> list[tuple[int, persia_pb2.UpdateRequest]]:
        """The Update request of each message of ``sharded`` (``encoded``: the flat gradients in the wire dtype), each
        under the sender's next seq for its shard, the next from ``seq_base`` (see :meth:`update_sharded_async`), or
        ``resent_seq`` (a re-routed update's)."""
        order = sharded.order
        calls = []
        numbered: dict[int, Iterator[int]] = {}  # per shard, from seq_base
        for message in sharded.messages:
            if message.start == message.end:
                continue
            if resent_seq is not None:
                seq = resent_seq
            elif seq_base is not None:
                seq = next(numbered.setdefault(message.shard, itertools.count(seq_base)))
                if seq - seq_base >= SEQS_PER_UPDATE:
                    raise ValueError(f"an update numbered by its sender sends at most {SEQS_PER_UPDATE} messages to a shard")
            else:
                with self._seq_lock:
                    seqs = self._seqs.setdefault(sender, [])
                    seqs.extend(itertools.count(1) for _ in range(message.shard + 1 - len(seqs)))
                    seq = next(seqs[message.shard])
            request = persia_pb2.UpdateRequest(client_id=sender, seq=seq, packed_dtype=dtype, map_version=sharded.map_version)
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
        return calls

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

    def update(
        self, updates: Mapping[str, Tuple[torch.Tensor, torch.Tensor]], *, wire_dtype: str = "fp16", sender: Optional[str] = None,
    ) -> None:
        """Blocking :meth:`update_async`."""
        self.update_async(updates, wire_dtype=wire_dtype, sender=sender).result()

    async def _update(self, calls) -> None:
        await self._gather(self._update_routed(shard, request) for shard, request in calls)

    async def _update_routed(self, shard: int, request: persia_pb2.UpdateRequest) -> None:
        try:
            await self._notice_map([await self._call(shard, "Update", request, self.retry.timeout_s, self._moved_away(shard, request.map_version))], [shard])
        except ShardMapMovedError as moved:
            # The ids go where the new map puts them, as client "<sender>@<shard>" under the same seq: the shards they
            # go to hold the exactly-once memory of the shard that gave them the slots, so an update it had applied
            # (its answer lost) is answered as a duplicate, and one it had not (refused, or never reached) is applied.
            await self._follow_map(moved.shard, moved.version)
            await self._update(self._rerouted(request, shard))

    def _rerouted(self, request: persia_pb2.UpdateRequest, shard: int) -> list[tuple[int, persia_pb2.UpdateRequest]]:
        wire_dtype = WIRE_DTYPE_NAMES[request.packed_dtype]
        keyed = KeyedIds(tuple(request.packed.tables), tuple(int(c) for c in request.packed.counts), wire.decode_ids(request.packed.ids))
        dims = [self._dims[t] for t in keyed.tables]
        encoded = wire.rows_view(request.packed_grads, wire_dtype, 1).view(-1)
        calls = self._update_calls(self.shard(keyed), encoded, RowLayout(keyed.counts, dims), request.packed_dtype, wire_dtype,
                                   f"{request.client_id}@{shard}", resent_seq=request.seq)
        if len({to for to, _ in calls}) != len(calls):  # one seq, one message per shard: a part never outgrows its whole
            raise PSError(f"an update re-routed from shard {shard} split into several messages to one shard")
        return calls

    def refresh_map(self) -> int:
        """Adopts shard 0's shard map if it is newer than this client's (the shards were scaled since: a client that
        only saves or loads hears of it no other way); returns the version in force."""
        version = self.shard_map_of(0)[0].version
        if version > self.shard_map.version:
            self._wait(self._follow_map(0, version))
        return self.shard_map.version

    def _moved_away(self, shard: int, routed_by: int) -> Callable[[], Awaitable[None]]:
        """What a call to ``shard`` routed by map version ``routed_by`` does before it retries: asks another shard
        whether the map moved since, and ends the call with :class:`ShardMapMovedError` if so (a drained shard may be gone already, and a client that has not talked
        to the shards since the move hears of it no other way)."""
        async def check() -> None:
            other = 1 if shard == 0 else 0
            if other >= self.num_shards:
                return
            try:
                response = await self._stubs[other].GetShardMap(persia_pb2.GetShardMapRequest(), timeout=self.retry.timeout_s,
                                                                metadata=self._metadata or None)
            except grpc.aio.AioRpcError:
                return  # that shard cannot tell either; the call retries as it would have
            if response.version > routed_by:
                raise ShardMapMovedError(other, self._channel_addresses[other], grpc.StatusCode.FAILED_PRECONDITION,
                                         f"shard {shard} did not answer and shard {other} routes by a newer shard map",
                                         response.version)
        return check

    async def _notice_map(self, responses: Sequence, shards: Sequence[int]) -> None:
        """Follows a newer shard map that a shard's answer names (a shard drained of its slots then hears no more)."""
        newest = max(zip((r.map_version for r in responses), shards), default=(0, 0))
        if newest[0] > self.shard_map.version:
            await self._follow_map(newest[1], newest[0])

    async def _follow_map(self, shard: int, version: int) -> None:
        """Adopts the shard map of ``shard`` (one that refused a request, or answered with a newer map ``version``),
        and reaches the shards it adds."""
        if version <= self.shard_map.version:
            return  # another call adopted it meanwhile
        response = await self._call(shard, "GetShardMap", persia_pb2.GetShardMapRequest(), self.retry.timeout_s)
        shard_map, addresses = handover_wire.map_of(response)
        if shard_map.version <= self.shard_map.version:
            return
        if addresses:
            self._reach(addresses)
        elif shard_map.num_shards != self.num_shards:
            raise PSError(f"shard {shard} routes by shard map version {shard_map.version} of {shard_map.num_shards} "
                          f"shards but does not know their addresses; this client knows {self.num_shards}")
        self.shard_map = shard_map
        log.info("shard map version %d: %d shards (%s)", shard_map.version, shard_map.num_shards, ", ".join(self.addresses))


def _wire_enum(name: str) -> int:
    try:
        return WIRE_DTYPE_ENUMS[name]
    except KeyError:
        raise ValueError(f"wire_dtype must be one of {sorted(WIRE_DTYPE_ENUMS)}, got {name!r}") from None
