"""The framing of a write-ahead log: records with a length and a checksum, and a reader that stops at a torn one.

A record on disk is a 12-byte header, ``magic (u32) | length (u32) | crc32 (u32)`` (little-endian), then
``length`` bytes of payload whose CRC-32 is ``crc32``. A process killed in the middle of a write leaves its last
record short or with bytes that do not match the checksum: :func:`read_records` stops there and says how many
bytes it dropped, so that a torn record is never applied. A record that fails its check with more than zeros after
a whole record after it is no torn tail but damage in the middle of the log (:attr:`ReadEnd.damaged`): what follows
it was acknowledged and cannot be read in order. (A torn tail is the last write's prefix: no whole record follows
it.) The payload is opaque here (``changes.py`` gives it its meaning).
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Sequence

MAGIC = 0x5057414C  # "PWAL"
HEADER = struct.Struct("<III")
MAX_RECORD_BYTES = 1 << 31  # a length above it is damage, not a record
_SEARCH_BLOCK = 1 << 24  # bytes read at a time while looking for a whole record after a damaged one


def frame(pieces: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """The buffers that write one record whose payload is ``pieces`` concatenated (written as they are, no copy)."""
    crc, length = 0, 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
        length += memoryview(piece).nbytes
    return [HEADER.pack(MAGIC, length, crc), *pieces]


@dataclass
class ReadEnd:
    """How a reading of a log file ended: ``valid_bytes`` of whole records, then ``dropped_bytes`` of a torn one, or
    of a ``damaged`` one (a whole record follows it)."""

    valid_bytes: int = 0
    dropped_bytes: int = 0
    reason: str = ""
    damaged: bool = False


def read_records(stream: BinaryIO, end: ReadEnd) -> Iterator[bytes]:
    """The payloads of the whole records of ``stream`` in order; fills ``end`` once the stream is read.

    The first record that is short, has another magic number or a wrong checksum ends the reading: it and
    whatever follows it are counted in ``end.dropped_bytes`` with the reason, never returned; ``end.damaged`` says
    whether a whole record follows it.
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
    else:
        end.damaged = _whole_record_after(stream, offset + 1)


def _whole_record_after(stream: BinaryIO, start: int) -> bool:
    """Whether a whole record (its magic, a length that fits, its checksum) begins anywhere from ``start`` on; the
    file is searched a block at a time."""
    magic = struct.pack("<I", MAGIC)
    block_start = start
    while True:
        stream.seek(block_start)
        block = stream.read(_SEARCH_BLOCK)
        if len(block) < HEADER.size:
            return False
        at = block.find(magic)
        while at >= 0:
            if _is_whole_record(stream, block_start + at):
                return True
            at = block.find(magic, at + 1)
        block_start += len(block) - HEADER.size + 1  # a header across two blocks is found in the second


def _is_whole_record(stream: BinaryIO, offset: int) -> bool:
    stream.seek(offset)
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return False
    _, length, crc = HEADER.unpack(header)
    if length > MAX_RECORD_BYTES:
        return False
    payload = stream.read(length)
    return len(payload) == length and zlib.crc32(payload) == crc
