"""The native kernels a disk lookup's misses go through: the records read in file order, checked against their ids
and answered into the request's rows (``native.read_records``, ``records_mismatch``, ``records_hold``,
``answer_records``)."""
import os

import pytest
import torch

from lightning_persia.ops import native
from lightning_persia.remote_ps.store import disk_tier
from lightning_persia.remote_ps.store.chunked_rows import FieldSpec
from lightning_persia.remote_ps.store.disk_tier import DiskTier

pytestmark = pytest.mark.usefixtures("disk_tier_kernels")

DIM = 4


def _records(ids: list[int], width: int = 16) -> torch.Tensor:
    """uint8 records of ``width`` bytes: the id, then its bytes again as the record's other field."""
    ids = torch.tensor(ids, dtype=torch.int64)
    return torch.cat([ids.view(torch.uint8).reshape(-1, 8), (ids + 1000).view(torch.uint8).reshape(-1, 8)], dim=1)[:, :width].contiguous()


def test_records_whose_id_is_not_the_wanted_one_are_named():
    records = _records([5, 6, 7, 8])
    ids, slots = torch.tensor([5, 60, 7, 80]), torch.tensor([0, 1, -1, 3])
    assert native.records_mismatch(ids, slots, records).tolist() == [1, 3]  # slot -1: not read, not checked
    assert native.records_mismatch(torch.tensor([5, 6, 7, 8]), slots, records).numel() == 0
    with pytest.raises(ValueError, match="records must be a contiguous uint8"):
        native.records_mismatch(ids, slots, records[:3])
    with pytest.raises(ValueError, match="4 ids and 3 slots"):
        native.records_mismatch(ids, slots[:3], records)


def test_a_record_holds_where_its_slot_is_live_and_its_id_is_the_wanted_one():
    bits = torch.zeros(128, dtype=torch.uint8)
    pages = torch.tensor([bits.data_ptr()])
    native.set_bits(pages, 10, torch.tensor([0, 1, 3]), True)
    held = native.records_hold(pages, 10, torch.tensor([5, 6, 70, 8, 9]), torch.tensor([0, 1, 3, 2, 2000]), _records([5, 6, 7, 8, 9]))
    assert held.dtype == torch.bool and held.tolist() == [True, True, False, False, False]  # wrong id; not live; no page


def test_the_answer_copies_the_field_of_each_record_read_into_the_unanswered_rows():
    records = _records([10, 11, 12, 13])
    rows = torch.tensor([4, -1, -1, -1, -1, 7])  # positions 0 and 5 found in memory
    out = torch.zeros(6, 8, dtype=torch.uint8)
    positions, slots = torch.tensor([1, 2, 3, 0]), torch.tensor([20, -1, 22, 23])  # position 0 found meanwhile (rows 4)
    at, missing = native.answer_records(slots, records, positions, rows, out, offset=8)
    assert at.tolist() == [0, 2]
    assert rows.tolist() == [4, -2, -1, -2, -1, 7] and missing == 1  # position 2: on no slot; position 4: not asked
    assert out[1].view(torch.int64).item() == 1010 and out[3].view(torch.int64).item() == 1012
    assert out[0].sum() == 0 and out[2].sum() == 0  # left as they were


def test_the_answer_refuses_what_it_would_write_out_of_bounds():
    records, rows, out = _records([1, 2]), torch.full((3,), -1), torch.zeros(3, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="positions must be rows of the request"):
        native.answer_records(torch.tensor([0, 1]), records, torch.tensor([0, 3]), rows, out, offset=8)
    with pytest.raises(ValueError, match="a field of 8 bytes at offset 9 does not fit in records of 16 bytes"):
        native.answer_records(torch.tensor([0, 1]), records, torch.tensor([0, 1]), rows, out, offset=9)
    with pytest.raises(ValueError, match="out must be a contiguous CPU tensor of a row per request position"):
        native.answer_records(torch.tensor([0, 1]), records, torch.tensor([0, 1]), rows, out[:2], offset=8)
    assert rows.tolist() == [-1, -1, -1] and out.sum() == 0  # nothing written


def test_slots_in_any_order_are_read_into_their_rows_and_repeats_are_told(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "SEGMENT_SHIFT", 10)
    monkeypatch.setattr(disk_tier, "SEGMENT_ROWS", 1 << 10)
    specs = {"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float16, DIM)}
    tier = DiskTier(tmp_path / "tier", specs)
    ids = torch.arange(3000) * 3 + 2  # three segments
    tier.write({"ids": ids, "weights": torch.zeros(3000, DIM, dtype=torch.float16)})
    fds = torch.tensor([os.open(tmp_path / "tier" / f"segment-{s:06d}.rows", os.O_RDONLY) for s in range(3)])
    try:
        none, reads = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
        slots = torch.tensor([2999, -1, 5, 1030, 0, 2048 + 900])  # spread over the segments, not in file order
        out = torch.zeros(slots.numel(), tier.record_bytes, dtype=torch.uint8)
        assert native.read_records(fds, none, none, reads, 10, slots, out) is False
        expected = [int(ids[s]) if s >= 0 else 0 for s in slots.tolist()]
        assert tier.unpack(out)["ids"].tolist() == expected and reads.tolist() == [2, 1, 2]
        again = torch.zeros(3, tier.record_bytes, dtype=torch.uint8)
        assert native.read_records(fds, none, none, reads, 10, torch.tensor([7, -1, 7]), again) is True
        assert tier.unpack(again)["ids"].tolist() == [int(ids[7]), 0, int(ids[7])]
    finally:
        for fd in fds.tolist():
            os.close(fd)
