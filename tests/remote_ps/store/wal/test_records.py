"""Framing of write-ahead log records: a torn or damaged last record is detected and never returned."""
import io

import pytest
import torch

from lightning_persia.remote_ps.store.wal import changes
from lightning_persia.remote_ps.store.wal.records import HEADER, ReadEnd, frame, read_records


def _log(*payloads: bytes) -> bytes:
    return b"".join(b"".join(bytes(piece) for piece in frame([payload])) for payload in payloads)


def _read(data: bytes) -> tuple[list[bytes], ReadEnd]:
    end = ReadEnd()
    return list(read_records(io.BytesIO(data), end)), end


def test_whole_records_come_back_in_order():
    payloads, end = _read(_log(b"one", b"", b"three" * 1000))
    assert payloads == [b"one", b"", b"three" * 1000]
    assert end.dropped_bytes == 0 and end.reason == ""


@pytest.mark.parametrize("cut", [1, HEADER.size - 1, HEADER.size, HEADER.size + 3])
def test_a_torn_last_record_is_dropped_and_counted(cut):
    whole = _log(b"first", b"second")
    torn = whole + _log(b"the record being written")[:cut]
    payloads, end = _read(torn)
    assert payloads == [b"first", b"second"]
    assert end.valid_bytes == len(whole) and end.dropped_bytes == cut and end.reason


def test_a_record_whose_bytes_changed_is_dropped_with_everything_after_it():
    data = bytearray(_log(b"first", b"second", b"third"))
    data[len(_log(b"first")) + HEADER.size + 2] ^= 0xFF  # a byte of "second"
    payloads, end = _read(bytes(data))
    assert payloads == [b"first"]
    assert "checksum" in end.reason and end.dropped_bytes == len(_log(b"second", b"third"))


def test_a_change_survives_its_bytes():
    table = changes.TableChange("t", 7, torch.tensor([5, 6]), torch.tensor([9]), torch.tensor([3], dtype=torch.int32),
                                {"ids": torch.tensor([1, 2]), "weights": torch.randn(2, 4).half(), "state": torch.rand(2, 1)})
    kind, meta, tensors = changes.decode(b"".join(bytes(p) for p in changes.encode_change(changes.Change([table], "c", 42))))
    back = changes.decode_change(meta, tensors)
    assert kind == changes.CHANGE and (back.client, back.seq) == ("c", 42)
    (got,) = back.tables
    assert (got.name, got.step) == ("t", 7)
    for name in ("removed", "admitted", "admitted_access"):
        assert torch.equal(getattr(got, name), getattr(table, name))
    assert got.rows.keys() == table.rows.keys() and all(torch.equal(got.rows[k], table.rows[k]) for k in table.rows)


def test_a_payload_that_does_not_parse_names_the_problem():
    with pytest.raises(changes.RecordFormatError, match="does not parse"):
        changes.decode(b"\x03\xff\xff\x00\x00{")
