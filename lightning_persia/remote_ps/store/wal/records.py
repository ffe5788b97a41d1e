"""The framing of a write-ahead log: records with a length and a checksum, and a reader that stops at a torn one.

A record on disk is a 12-byte header, ``magic (u32) | length (u32) | crc32 (u32)`` (little-endian), then
``length`` bytes of payload whose CRC-32 is ``crc32``. A process killed in the middle of a write leaves its last
record short or with bytes that do not match the checksum: :func:`read_records` stops there and says how many
bytes it dropped, so that a torn record is never applied. The payload is opaque here (``changes.py`` gives it
its meaning).
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Sequence

MAGIC = 0x5057414C  # "PWAL"
HEADER = struct.Struct("<III")
MAX_RECORD_BYTES = 1 << 31  # a length above it is damage, not a record


def frame(pieces: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """The buffers that write one record whose payload is ``pieces`` concatenated (written as they are, no copy)."""
    crc, length = 0, 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
        length += memoryview(piece).nbytes
    return [HEADER.pack(MAGIC, length, crc), *pieces]


@dataclass
class ReadEnd:
    """How a reading of a log file ended: ``valid_bytes`` of whole records, then ``dropped_bytes`` of a torn one."""

    valid_bytes: int = 0
    dropped_bytes: int = 0
    reason: str = ""


def read_records(stream: BinaryIO, end: ReadEnd) -> Iterator[bytes]:
    """The payloads of the whole records of ``stream`` in order; fills ``end`` once the stream is read.

    The first record that is short, has another magic number or a wrong checksum ends the reading: it and
    whatever follows it are counted in ``end.dropped_bytes`` with the reason, never returned.
    """
    offset = 0
    while True:
        header = stream.read(HEADER.size)
        if not header:
            break
        if len(header) < HEADER.size:
            end.reason = f"a header of {len(header)} of {HEADER.size} bytes at byte {offset}"
            break
        magic, length, crc = HEADER.unpack(header)
        if magic != MAGIC or length > MAX_RECORD_BYTES:
            end.reason = f"no record header at byte {offset} (magic {magic:#x}, length {length})"
            break
        payload = stream.read(length)
        if len(payload) < length:
            end.reason = f"a record of {length} bytes at byte {offset} ends after {len(payload)}"
            break
        if zlib.crc32(payload) != crc:
            end.reason = f"the record of {length} bytes at byte {offset} does not match its checksum"
            break
        offset += HEADER.size + length
        yield payload
    end.valid_bytes = offset
    rest = stream.seek(0, 2) - offset
    end.dropped_bytes = rest
    if not rest:
        end.reason = ""
