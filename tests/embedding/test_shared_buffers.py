"""The trainer's pool of shared segments: a segment is handed out again only once nothing reads its tensor, a mapping
by name sees the same memory, tensors already in a segment are found there, and closing unlinks every segment."""
from __future__ import annotations

import os
from multiprocessing import resource_tracker

import torch

from lightning_persia.embedding.shared_buffers import MappedSegments, SharedBuffers


def _names_in_dev_shm(prefix: str) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def test_a_segment_is_reused_only_once_nothing_reads_its_tensor():
    pool = SharedBuffers(prefix="persia-test-reuse", pin=False)
    try:
        first = pool.take(1000, torch.float32)
        view = first.tensor[10:20].view(2, 5)  # a view keeps the storage, as a forward's slice of the rows does
        segment = first.segment
        del first
        assert pool.take(10, torch.float32).segment != segment
        del view
        again = pool.take(10, torch.int64)  # the smallest free segment that fits
        assert again.segment == segment and again.offset == 0 and again.tensor.dtype == torch.int64
    finally:
        pool.close()


def test_a_mapping_by_name_reads_and_writes_the_same_memory():
    pool, mapped = SharedBuffers(prefix="persia-test-map", pin=False), MappedSegments()
    try:
        taken = pool.take(8, torch.int64)
        taken.tensor.copy_(torch.arange(8))
        theirs = mapped.tensor(taken.segment, taken.offset, 8, torch.int64)
        # A worker stops tracking what it maps (its creator unlinks it); in one process that was the creator's entry.
        resource_tracker.register(f"/{taken.segment}", "shared_memory")
        assert torch.equal(theirs, torch.arange(8))
        theirs[3] = -7
        assert int(taken.tensor[3]) == -7
        del theirs
    finally:
        mapped.close()
        pool.close()


def test_a_tensor_in_a_segment_is_located_there_and_others_are_not():
    pool = SharedBuffers(prefix="persia-test-locate", pin=False)
    try:
        taken = pool.take(100, torch.int64)
        part = taken.tensor[40:60]
        found = pool.locate(part)
        assert found is not None and found.segment == taken.segment and found.offset == 40 * 8 and found.tensor is part
        assert pool.locate(torch.arange(20)) is None
        assert pool.locate(taken.tensor[::2]) is None  # not contiguous: it would need a copy
    finally:
        pool.close()


def test_close_unlinks_every_segment_and_a_growing_request_replaces_a_free_smaller_one():
    pool = SharedBuffers(prefix="persia-test-close", pin=False)
    small = pool.take(10, torch.float32).segment
    big = pool.take(1 << 20, torch.float32)  # 4 MiB: larger than the 1 MiB segment, which is free and dropped
    assert big.segment != small and len(_names_in_dev_shm("persia-test-close")) == 1
    del big
    pool.close()
    assert _names_in_dev_shm("persia-test-close") == []
