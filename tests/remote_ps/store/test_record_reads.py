"""A large read of a tier's records is split at a segment's edge between two threads; it reads what one thread would."""
import errno
import threading

import pytest
import torch

from lightning_persia.remote_ps.store import disk_tier, record_reads
from lightning_persia.remote_ps.store.chunked_rows import FieldSpec
from lightning_persia.remote_ps.store.disk_tier import DiskTier
from lightning_persia.remote_ps.store.record_reads import _segment_edge

pytestmark = pytest.mark.usefixtures("disk_tier_kernels")

DIM = 4


@pytest.fixture
def small_segments(monkeypatch):
    """Segments of 1,024 records, and reads of 16 records or more split."""
    monkeypatch.setattr(disk_tier, "SEGMENT_SHIFT", 10)
    monkeypatch.setattr(disk_tier, "SEGMENT_ROWS", 1 << 10)
    monkeypatch.setattr(record_reads, "SPLIT_AT", 16)


def _tier(tmp_path, rows=5000):
    specs = {"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float16, DIM), "access": FieldSpec(torch.int32)}
    lock = threading.Lock()
    tier = DiskTier(tmp_path / "tier", specs, lock)
    ids = torch.arange(rows) * 3 + 1
    tier.write({"ids": ids, "weights": ids[:, None].half().expand(rows, DIM) / 8, "access": torch.ones(rows, dtype=torch.int32)})
    return tier, ids, lock


def _read_ahead(tier, lock, ids):
    with lock:
        ahead = tier.begin_read(torch.arange(ids.numel()), ids)
    ahead.read()
    with lock:
        tier.end_read()
    return ahead


def test_the_edge_is_the_segment_boundary_nearest_the_middle():
    assert _segment_edge(torch.tensor([0, 1, 2, 3]), 10) == 0  # one segment: not split
    assert _segment_edge(torch.tensor([0, 1, 1024, 1025, 1026, 2048]), 10) == 2
    assert _segment_edge(torch.tensor([0, 1, 2, 1024, 2048, 2049]), 10) == 3
    assert _segment_edge(torch.tensor([5, 1024, 1025, 1026, 1027, 1028]), 10) == 1  # the middle segment is the last


def test_a_split_read_gives_the_records_one_read_gives(tmp_path, small_segments, monkeypatch):
    tier, ids, lock = _tier(tmp_path)
    wanted = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))[:3000]]
    _, expected = tier.find(wanted)
    threads = []
    real = disk_tier.native.read_records

    def read_records(*args, **kwargs):
        threads.append(threading.current_thread().name)
        real(*args, **kwargs)

    monkeypatch.setattr(record_reads.native, "read_records", read_records)
    ahead = _read_ahead(tier, lock, wanted)
    assert torch.equal(ahead.records, expected)
    assert sorted(name.startswith("persia-ps-read") for name in threads) == [False, True]  # this thread and the other


def test_a_failure_on_the_second_thread_is_raised_once_both_halves_are_done(tmp_path, small_segments, monkeypatch):
    done = []

    def read_records(*args, **kwargs):
        if threading.current_thread().name.startswith("persia-ps-read"):
            raise OSError(errno.EIO, "the record of disk slot 1024 could not be read whole")
        done.append(args[-2].numel())  # the slots this thread read

    monkeypatch.setattr(record_reads.native, "read_records", read_records)
    slots = torch.arange(0, 2048, 32)  # two segments of 32 slots each
    with pytest.raises(OSError, match="slot 1024"):
        record_reads.read_sorted((), 10, slots, torch.empty(64, 8, dtype=torch.uint8), torch.arange(64))
    assert done == [32]


def test_a_read_ahead_whose_second_half_failed_leaves_its_records_unread(tmp_path, small_segments, monkeypatch):
    tier, ids, lock = _tier(tmp_path)
    real = disk_tier.native.read_records

    def read_records(*args, **kwargs):
        if threading.current_thread().name.startswith("persia-ps-read"):
            raise OSError(errno.EIO, "the record of disk slot 4096 could not be read whole")
        real(*args, **kwargs)

    monkeypatch.setattr(record_reads.native, "read_records", read_records)
    assert _read_ahead(tier, lock, ids).records is None  # the lookup then reads under the lock, which reports it
