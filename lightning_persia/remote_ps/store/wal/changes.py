"""What a write-ahead log record holds, and its bytes.

A record is one of:

- ``OPEN``: the first record of every log segment: the shard incarnation that opened it, every incarnation whose
  acknowledged writes the log holds (inherited across restarts that replayed it), the machine's boot id and the
  durability it was written with, the ``(client, seq)`` of the updates applied recently (exactly-once across a
  checkpoint that dropped their records), and the shard map in force;
- ``CONFIGURE``: tables created by a Configure call;
- ``CHANGE``: what one lookup or update changed in its tables, with the update's ``(client, seq)``: per table the
  ids evicted, the ids admitted (their first rows are a pure function of (seed, table, id), so only the ids and
  their access values are kept), and the new values of the rows an update wrote (ids, weights, optimizer state,
  access), plus the table's lookup step. Replaying it writes those values: it never runs the optimizer again;
- ``MAP``: the shard map this shard adopted (slots moved to or from it, ``store/slot_moves.py``);
- ``FENCE``: this shard fenced the slots it hands over under a new map (``{"to_map", "addresses"}``), or (``null``)
  gave that move up: a shard restarted while fenced comes back fenced, and settles the move before serving those
  slots (``store/slot_moves.py``);
- ``GIVEN_UP``: the newest map version a move to this shard was given up from (``ABORT`` with that map, which it had
  not adopted), or ``0`` once that is forgotten (a new coordinator starts over): a restarted shard still never adopts
  that map, nor takes rows for it. Every segment's ``OPEN`` repeats the one in force, as it does the ``FENCE``.

Bytes: ``kind (u8) | meta length (u32) | meta (JSON) | tensors``; the meta lists each tensor's dtype and shape.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

OPEN, CONFIGURE, CHANGE, MAP, FENCE, GIVEN_UP = 1, 2, 3, 4, 5, 6
_PREFIX = struct.Struct("<BI")
_DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32, "float16": torch.float16}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class RecordFormatError(ValueError):
    """A record whose checksum matched but whose content does not parse (a log of another version, or a defect)."""


@dataclass
class TableChange:
    """What one operation changed in one table (see the module docstring)."""

    name: str
    step: int
    removed: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    admitted: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    admitted_access: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))
    rows: dict[str, torch.Tensor] = field(default_factory=dict)  # field -> values of the rows written

    def __bool__(self) -> bool:
        return bool(self.removed.numel() or self.admitted.numel() or (self.rows and self.rows["ids"].numel()))


@dataclass
class Change:
    """One record's worth of changes: an update's (``client``, ``seq``), or a lookup's (no client)."""

    tables: list[TableChange]
    client: str = ""
    seq: int = 0


def encode(kind: int, meta: dict[str, Any], tensors: tuple[torch.Tensor, ...] = ()) -> list[bytes | memoryview]:
    """The payload of a record as buffers (the tensors' memory is referenced, not copied)."""
    arrays = [t.contiguous() for t in tensors]
    meta = {**meta, "tensors": [[_NAMES[a.dtype], list(a.shape)] for a in arrays]}
    text = json.dumps(meta, separators=(",", ":")).encode()
    views = [memoryview(a.view(torch.uint8).numpy() if a.dtype == torch.float16 else a.numpy()).cast("B") for a in arrays if a.numel()]
    return [_PREFIX.pack(kind, len(text)), text, *views]


def decode(payload: bytes) -> tuple[int, dict[str, Any], list[torch.Tensor]]:
    """``(kind, meta, tensors)`` of a record's payload."""
    try:
        kind, length = _PREFIX.unpack_from(payload)
        meta = json.loads(payload[_PREFIX.size : _PREFIX.size + length])
        offset = _PREFIX.size + length
        tensors = []
        for dtype_name, shape in meta.pop("tensors"):
            dtype = _DTYPES[dtype_name]
            count = int(np.prod(shape)) if shape else 1
            nbytes = count * torch.empty(0, dtype=dtype).element_size()
            if offset + nbytes > len(payload):
                raise ValueError(f"tensor of {nbytes} bytes past the record's end")
            raw = torch.frombuffer(bytearray(memoryview(payload)[offset : offset + nbytes]), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            tensors.append(raw.view(dtype).reshape(shape))
            offset += nbytes
    except (struct.error, ValueError, KeyError, TypeError) as err:
        raise RecordFormatError(f"a write-ahead log record does not parse: {err}") from None
    return kind, meta, tensors


def encode_change(change: Change) -> list[bytes | memoryview]:
    tables, tensors = [], []
    for table in change.tables:
        fields = sorted(table.rows)
        tables.append({"name": table.name, "step": table.step, "fields": fields})
        tensors += [table.removed, table.admitted, table.admitted_access, *(table.rows[name] for name in fields)]
    return encode(CHANGE, {"client": change.client, "seq": change.seq, "tables": tables}, tuple(tensors))


def decode_change(meta: dict[str, Any], tensors: list[torch.Tensor]) -> Change:
    tables, position = [], 0
    for entry in meta["tables"]:
        removed, admitted, access = tensors[position : position + 3]
        position += 3
        rows = dict(zip(entry["fields"], tensors[position : position + len(entry["fields"])]))
        position += len(entry["fields"])
        tables.append(TableChange(entry["name"], int(entry["step"]), removed, admitted, access, rows))
    return Change(tables, meta.get("client", ""), int(meta.get("seq", 0)))


@dataclass
class Opening:
    """The ``OPEN`` record of a segment."""

    incarnation: str
    accepted: list[str]
    boot_id: str
    durability: str
    applied: dict[str, list[int]] = field(default_factory=dict)  # client -> seqs applied recently
    base: Optional[str] = None  # the checkpoint the segment's records follow, where a save or load began it
    shard_map: Optional[dict] = None  # ShardMap.to_dict() in force when the segment began (older logs: none)
    fence: Optional[dict] = None  # the FENCE in force when the segment began, if any
    given_up: int = 0  # the GIVEN_UP in force when the segment began (older logs: none)

    def encode(self) -> list[bytes | memoryview]:
        return encode(OPEN, self.__dict__)

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "Opening":
        return cls(**meta)
