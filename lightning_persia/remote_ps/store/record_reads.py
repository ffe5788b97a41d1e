"""Reads of a disk tier's records, a large read split between the calling thread and a second one.

A lookup's read ahead (``disk_tier.ReadAhead``) runs without the table's lock, but on the request's thread: the
request waits for it. A Zipf lookup over 100M rows reads ~11k records a request, a ``pread`` each where the segment is
not mapped, about a third of the request's CPU in process (2026-11-26 in
``benchmarks/results/2026-11-25-disk-tier.md``). ``native.read_records`` runs without the GIL, so two threads read
at once: the records of the segments past the middle of the sorted slots are read on a second thread while the
caller reads the others. Each thread reads whole segments, so that each segment's count of reads
(``SegmentMapping.reads``) has one writer.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from lightning_persia.ops import native

SPLIT_AT = 4096
"""Records a read splits between two threads, at least: below it, the hand-over costs more than it saves."""

_second: Optional[ThreadPoolExecutor] = None
_second_lock = threading.Lock()


def read_sorted(tables: tuple, shift: int, slots: torch.Tensor, records: torch.Tensor, into: torch.Tensor) -> None:
    """``native.read_records(*tables, shift, slots, records, into=into)`` of ``slots`` sorted, split at a segment's
    edge between this thread and a second one when there are :data:`SPLIT_AT` of them or more. Raises what a read
    raised (the first half's first) once both are done."""
    half = _segment_edge(slots, shift) if slots.numel() >= SPLIT_AT else 0
    if not half:
        native.read_records(*tables, shift, slots, records, into=into)
        return
    later = _second_reader().submit(native.read_records, *tables, shift, slots[half:], records, into=into[half:])
    try:
        native.read_records(*tables, shift, slots[:half], records, into=into[:half])
    finally:
        failure = later.exception()  # waits: the other thread writes into ``records`` until then
    if failure is not None:
        raise failure


def _segment_edge(slots: torch.Tensor, shift: int) -> int:
    """The position in ``slots`` (sorted) of the segment edge nearest their middle; 0 when they lie in one segment."""
    n = slots.numel()
    segments = slots >> shift
    middle = segments[n // 2 : n // 2 + 1]
    edges = [int(torch.searchsorted(segments, middle, right=right)) for right in (False, True)]
    inside = [edge for edge in edges if 0 < edge < n]
    return min(inside, key=lambda edge: abs(edge - n // 2)) if inside else 0


def _second_reader() -> ThreadPoolExecutor:
    global _second
    with _second_lock:
        if _second is None:
            _second = ThreadPoolExecutor(1, thread_name_prefix="persia-ps-read")
        return _second
