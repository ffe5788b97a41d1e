"""What the servicer reads from a request and writes into a response, checked before anything touches the rows.

- :class:`RpcRefusal` is a request refused with a gRPC status and a message (:func:`invalid`, :func:`read_only`);
  :func:`status_of` maps the store's and the codecs' errors to theirs.
- :class:`RequestDecoder` turns a Lookup's or an Update's packed tables into :class:`TableRequest` s, with every
  size, dim and dtype checked against the store.
- :func:`lookup_response` encodes the rows found; :func:`update_digest` fingerprints an update for the
  exactly-once check; :func:`table_config_from_json` and :func:`checkpoint_directory` read the table and
  checkpoint RPCs' arguments.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError

from lightning_persia.ops import wire
from lightning_persia.remote_ps.exactly_once import ConflictingDuplicateError, StaleSequenceError
from lightning_persia.remote_ps.protocol import WIRE_DTYPE_NAMES, persia_pb2
from lightning_persia.remote_ps.served_version import DeltaOrderError
from lightning_persia.remote_ps.store import CheckpointError, InvalidRequestError, ShardStore, StoreError, UnknownTableError
from lightning_persia.remote_ps.store.errors import LogWriteError
from lightning_persia.remote_ps.store.wal import changes as records
from lightning_persia.remote_ps.store.wal.changes import Change
from lightning_persia.remote_ps.store.slot_moves import MapMovedError, SlotsMovingError
from lightning_persia.remote_ps.table_config import ConfigError, TableConfig


class RpcRefusal(Exception):
    """A request refused before it reached the store."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(message: str) -> RpcRefusal:
    return RpcRefusal(grpc.StatusCode.INVALID_ARGUMENT, message)


def read_only(what: str) -> RpcRefusal:
    return RpcRefusal(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"{what} refused: this shard serves in read-only mode (an inference shard, started with --read-only); "
        "it answers lookups only",
    )


_STORE_CODES = (
    (UnknownTableError, grpc.StatusCode.NOT_FOUND),
    (SlotsMovingError, grpc.StatusCode.UNAVAILABLE),  # retried by the client: the handover ends in moments
    (MapMovedError, grpc.StatusCode.FAILED_PRECONDITION),  # with the map's version in the trailing metadata
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (CheckpointError, grpc.StatusCode.FAILED_PRECONDITION),
    (StoreError, grpc.StatusCode.INTERNAL),
)


def status_of(err: Exception) -> Optional[grpc.StatusCode]:
    """The status that answers ``err``, or None for an error no request should cause (a bug)."""
    if isinstance(err, RpcRefusal):
        return err.code
    if isinstance(err, LogWriteError):  # not retryable: the caller hears why nothing more is acknowledged
        return grpc.StatusCode.RESOURCE_EXHAUSTED if err.disk_full else grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(err, StoreError):
        return next(code for cls, code in _STORE_CODES if isinstance(err, cls))
    if isinstance(err, (ConfigError, wire.WireFormatError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(err, (StaleSequenceError, ConflictingDuplicateError, DeltaOrderError)):
        return grpc.StatusCode.FAILED_PRECONDITION
    return None


@dataclass
class Undecodable:
    """Stands for a request whose bytes are not a valid message of its type."""

    message_type: str
    error: str


def tolerant_parser(message_class) -> Callable[[bytes], object]:
    """``message_class.FromString`` that returns :class:`Undecodable` instead of raising."""

    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as err:
            return Undecodable(message_class.DESCRIPTOR.full_name, str(err))

    return parse


@dataclass
class TableRequest:
    """One table's part of a Lookup or an Update."""

    name: str
    dim: int
    ids: torch.Tensor
    grads: Optional[torch.Tensor] = None


class RequestDecoder:
    """Reads the tables of Lookup and Update requests for one store, within ``max_ids_per_request``."""

    def __init__(self, store: ShardStore, max_ids_per_request: int) -> None:
        self._store = store
        self._max_ids = max_ids_per_request

    def tables(self, request, with_grads: bool) -> list[TableRequest]:
        """The tables of a Lookup or Update request (its ``packed`` ids, and an Update's ``packed_grads``)."""
        if not request.HasField("packed"):
            raise invalid("the request names no tables: its ids travel in `packed` (one buffer and a count per table)")
        packed = request.packed
        names, counts = list(packed.tables), [int(c) for c in packed.counts]
        if len(counts) != len(names):
            raise invalid(f"packed ids name {len(names)} tables but give {len(counts)} counts")
        if len(set(names)) != len(names):
            raise invalid(f"a table appears more than once in one request: {sorted({n for n in names if names.count(n) > 1})}")
        dims = [self._dim(name) for name in names]
        self._check_total(sum(counts))
        ids = wire.decode_ids(packed.ids, what="packed ids")
        if ids.numel() != sum(counts):
            raise invalid(f"packed ids hold {ids.numel()} ids, their counts {counts} add up to {sum(counts)}")
        per_table = torch.split(ids, counts)
        grads: Sequence[Optional[torch.Tensor]] = [None] * len(names)
        if with_grads:
            dtype = grads_dtype("packed grads", request.packed_dtype)
            sizes = [c * d for c, d in zip(counts, dims)]
            flat = wire.rows_view(request.packed_grads, dtype, 1, what="packed grads").view(-1)
            if flat.numel() != sum(sizes):
                raise invalid(
                    f"packed grads hold {flat.numel()} {dtype} values, the ids' counts times their tables' dims "
                    f"({list(zip(names, counts, dims))}) make {sum(sizes)}"
                )
            grads = [g.view(c, d) for g, c, d in zip(torch.split(flat.float(), sizes), counts, dims)]
        return [TableRequest(name, dim, table_ids, table_grads) for name, dim, table_ids, table_grads in zip(names, dims, per_table, grads)]

    def _dim(self, name: str) -> int:
        if not name:
            raise invalid("a request names a table with an empty name")
        return self._store.describe(name).dim  # UnknownTableError -> NOT_FOUND

    def _check_total(self, total: int) -> None:
        if total > self._max_ids:
            raise RpcRefusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"request carries more than {self._max_ids} ids (max_ids_per_request); split it")


def lookup_dtype(value: int) -> str:
    """The codec name of a Lookup's rows (``WIRE_DTYPE_UNSPECIFIED``: fp16)."""
    dtype = WIRE_DTYPE_NAMES.get(value or persia_pb2.FP16)
    if dtype is None:
        raise invalid(f"lookup dtype {_dtype_label(value)} is not one of FP16, FP32")
    return dtype


def grads_dtype(name: str, value: int) -> str:
    """The codec name of an Update's gradients (which must say what they are)."""
    dtype = WIRE_DTYPE_NAMES.get(value)
    if dtype is None:
        raise invalid(f"{name}: grads dtype {_dtype_label(value)} is not one of FP16, FP32")
    return dtype


def lookup_response(request: persia_pb2.LookupRequest, items: Sequence[TableRequest], found: Sequence[torch.Tensor],
                    dtype: str) -> persia_pb2.LookupResponse:
    """The rows ``found`` for ``items``, table after table in one buffer of the wire dtype ``dtype``."""
    # One buffer, converted to the wire dtype as it is filled: one encode for every table.
    packed = torch.empty(sum(rows.numel() for rows in found), dtype=wire.WIRE_DTYPES[dtype])
    offset = 0
    for rows in found:
        packed[offset : offset + rows.numel()].copy_(rows.reshape(-1))
        offset += rows.numel()
    response = persia_pb2.LookupResponse(dtype=request.dtype or persia_pb2.FP16, packed_rows=wire.encode_rows(packed, dtype))
    response.packed_dims.extend(item.dim for item in items)
    return response


def update_digest(request: persia_pb2.UpdateRequest) -> int:
    """CRC32 of an update's tables: cheap (no decoding), and the same for every copy of the same update."""
    crc, packed = 0, request.packed
    for part in ("\0".join(packed.tables).encode(), str(list(packed.counts)).encode(), packed.ids, request.packed_grads,
                 str(request.packed_dtype).encode()):
        crc = zlib.crc32(part, crc)
    return crc


def _dtype_label(value: int) -> str:
    try:
        return persia_pb2.WireDType.Name(value)
    except ValueError:
        return f"{value} (unknown)"


def table_config_from_json(text: str) -> TableConfig:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise invalid(f"table config is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise invalid(f"table config must be a JSON object, got {type(data).__name__}")
    return TableConfig.from_dict(data)  # ConfigError -> INVALID_ARGUMENT


def checkpoint_directory(directory: str, root: Optional[str]) -> str:
    """``directory`` if it is absolute and, with a ``root``, inside it (symlinks and ``..`` resolved)."""
    if not directory or not os.path.isabs(directory):
        raise invalid(f"checkpoint directory must be an absolute path on the shard's file system, got {directory!r}")
    if root is not None:
        real, real_root = os.path.realpath(directory), os.path.realpath(root)
        if os.path.commonpath([real, real_root]) != real_root:
            raise RpcRefusal(grpc.StatusCode.PERMISSION_DENIED,
                             f"checkpoint directory {directory!r} is outside this shard's checkpoint_root {root!r}")
    return directory


def fill_handover_page(page: persia_pb2.HandoverPage, configs: Sequence[TableConfig], changes: Sequence[Change]) -> None:
    """Writes the tables and changes (as CHANGE records) into ``page``, in place: a page is 16 MB, and handing a
    built page to the request that carries it copies it again (23 ms each)."""
    page.tables_json.extend(json.dumps(config.to_dict()) for config in configs)
    page.records.extend(b"".join(records.encode_change(change)) for change in changes)
    page.rows = sum(part.rows["ids"].numel() if part.rows else 0 for change in changes for part in change.tables)


def fill_sightings_page(page: persia_pb2.HandoverPage, blocks: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Writes the moving slots' sighting counters, ``(table, slots, counters [len(slots), per slot])`` blocks, into
    ``page``, in place."""
    page.sightings.extend(
        persia_pb2.SlotSightings(table=name, slots=slots.to(torch.int16).numpy().astype("<i2").tobytes(),
                                 counters=counters.contiguous().numpy().tobytes())
        for name, slots, counters in blocks)


def sightings_contents(message: persia_pb2.HandoverPage) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The ``(table, slots, counters)`` blocks of a page; refuses a block whose counters are not whole slots'."""
    blocks = []
    for block in message.sightings:
        if len(block.slots) % 2:
            raise invalid(f"the sightings of table {block.table!r} name slots as int16: {len(block.slots)} bytes is not "
                          "a whole number of them")
        slots = torch.from_numpy(np.frombuffer(block.slots, dtype="<i2").astype(np.int64))
        if not slots.numel() or not block.counters or len(block.counters) % slots.numel():
            raise invalid(f"the sightings of table {block.table!r}: {len(block.counters)} counters do not split evenly "
                          f"over {slots.numel()} slots")
        counters = torch.frombuffer(bytearray(block.counters), dtype=torch.uint8).reshape(slots.numel(), -1)
        blocks.append((block.table, slots, counters))
    return blocks


def handover_contents(message: persia_pb2.HandoverPage) -> tuple[list[TableConfig], list[Change]]:
    """The tables and changes of a page another shard handed over (rows and changes travel as the write-ahead log's
    CHANGE records, the format a replay applies bit for bit); refuses a record that does not parse."""
    configs = [table_config_from_json(text) for text in message.tables_json]
    changes = []
    try:
        for record in message.records:
            kind, meta, tensors = records.decode(record)
            if kind != records.CHANGE:
                raise records.RecordFormatError(f"a record of kind {kind}, not a change ({records.CHANGE})")
            changes.append(records.decode_change(meta, tensors))
    except (records.RecordFormatError, KeyError, ValueError) as err:
        raise invalid(f"a handed-over page does not parse: {err}") from None
    return configs, changes
