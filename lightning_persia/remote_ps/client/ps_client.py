"""The training hot path of the client: lookups and updates of many tables on every shard at once.

Every table of a call travels packed (one ids buffer and one rows or gradients buffer per message, see
``persia.proto``): bucketing by shard and encoding run on the caller's thread in a few vectorised ops whatever
the number of tables (:meth:`PSClient.shard`, whose result a trainer reuses for the update of the same ids),
and decoding writes each shard's rows straight into one output tensor in the caller's id order. The calls
off the hot path are :class:`~lightning_persia.remote_ps.client.admin.ShardAdmin`'s.
"""
from __future__ import annotations

import itertools
import os
import threading
import uuid
from concurrent.futures import Future
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import grpc.aio
import torch

from lightning_persia.ops import wire
from lightning_persia.ops.keyed_ids import KeyedIds, RowLayout
from lightning_persia.remote_ps.client.admin import ShardAdmin
from lightning_persia.remote_ps.client.connection import PathOrPEM
from lightning_persia.remote_ps.client.errors import PSError
from lightning_persia.remote_ps.client.retry import RetryPolicy
from lightning_persia.remote_ps.client.sharding import ShardedIds, Sharder
from lightning_persia.remote_ps.protocol import WIRE_DTYPE_ENUMS, persia_pb2

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
        return Sharder(self.num_shards, self.max_ids_per_message, self._max_message_bytes, max(dims.values(), default=0))

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
        dtype = _wire_enum(wire_dtype)
        requests = []
        for message in sharded.messages:
            request = persia_pb2.LookupRequest(train=train, dtype=dtype)
            request.packed.tables.extend(message.tables)
            request.packed.counts.extend(message.counts)
            request.packed.ids = message.ids
            requests.append(request)
        responses = await self._gather(
            self._call(message.shard, "Lookup", request, self.retry.timeout_s) for message, request in zip(sharded.messages, requests)
        )
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
        ``sender`` make each shard apply every update once, and each of them hears back only after it is
        applied (how ranks push one merged gradient, see ``embedding/rank_merge.py``).

        ``seq_base``: the caller numbers the sender's updates itself (the ``n``-th one takes ``n *
        SEQS_PER_UPDATE``), so that another client (an embedding worker started in place of one that died) can
        send the same update again under the same numbers, which the shards apply once; each shard's messages
        of this update take ``seq_base``, ``seq_base + 1``, ... A sender is numbered one way or the other, never both.
        """
        if seq_base is not None and seq_base < 1:
            raise ValueError(f"seq_base must be >= 1, got {seq_base}")
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
        numbered = [itertools.count(seq_base) for _ in self.addresses] if seq_base is not None else None
        for message in sharded.messages:
            if message.start == message.end:
                continue
            if numbered is not None:
                seq = next(numbered[message.shard])
                if seq - seq_base >= SEQS_PER_UPDATE:
                    raise ValueError(f"an update numbered by its sender sends at most {SEQS_PER_UPDATE} messages to a shard")
            else:
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

    def update(
        self, updates: Mapping[str, Tuple[torch.Tensor, torch.Tensor]], *, wire_dtype: str = "fp16", sender: Optional[str] = None,
    ) -> None:
        """Blocking :meth:`update_async`."""
        self.update_async(updates, wire_dtype=wire_dtype, sender=sender).result()

    async def _update(self, calls) -> None:
        await self._gather(self._call(shard, "Update", request, self.retry.timeout_s) for shard, request in calls)


def _wire_enum(name: str) -> int:
    try:
        return WIRE_DTYPE_ENUMS[name]
    except KeyError:
        raise ValueError(f"wire_dtype must be one of {sorted(WIRE_DTYPE_ENUMS)}, got {name!r}") from None
