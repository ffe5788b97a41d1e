"""Which segments of a disk tier are kept in the shard's page tables, so that a read of their records is a copy.

A ``pread`` of a 48-byte record cost 0.8 to 1.8 us on the development VM; a copy from a segment mapped with its
pages in the process's page tables 0.3 to 0.5 us; a read through a mapping whose page is not there yet costs a
fault, up to 2 us under load. So segments are mapped and populated ahead of
the reads, off the request path (called by the shard's demoter), and the records of the others are read with
``pread``: ``native_records.read_records`` takes the tables of this class. A step chooses what to map and publishes it with
the table's lock held, but reads the pages in without it: where the page cache no longer holds them (a billion
rows on this VM), that read is disk I/O that would otherwise hold every request, and a checkpoint, behind it.

While there is room (:data:`MAPPED_BYTES` of records a tier by default; ``PSConfig.disk_mapped_mb``), every segment is mapped as it is written, the most
read first. Past it, a segment that reads hit more than twice as often as the least read mapped one takes its
place. The mapped pages count in the shard's resident memory; the page cache holds them either way. A shard with a
memory limit (``mapped_budget.py``) moves the budget as its other memory grows and shrinks: a budget that fell below
what is mapped unmaps the least read segments, one a step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lightning_persia.remote_ps.store.native import records as native_records

MAPPED_BYTES = 1 << 30
"""Records of a tier whose pages the shard keeps in its page tables, at most, unless the shard says otherwise."""
_STEP_BYTES = 16 << 20  # populated by one step
_READS_HALVED_AT = 1 << 22  # reads counted in all before the counts halve (recent reads weigh more)
_SHRINK_SLACK = 4 * _STEP_BYTES  # mapped past the budget before a segment is unmapped: a budget that jitters drops none


@dataclass(frozen=True)
class MapJob:
    """One step of mapping: ``nbytes`` from ``address`` to populate, records ``[first, end)`` (bytes) of ``segment``."""

    segment: int
    address: int
    nbytes: int
    first: int
    end: int


class SegmentMapping:
    """The mapping of a tier's segments of ``segment_bytes`` each: ``bases`` (where each is mapped, 0: not),
    ``mapped`` (its records in the page tables) and ``reads`` (records read of it), one int64 a segment; at most
    ``budget`` bytes of records mapped."""

    def __init__(self, record_bytes: int, segment_bytes: int, budget: int = MAPPED_BYTES) -> None:
        self.record_bytes = record_bytes
        self.segment_bytes = segment_bytes
        self._budget = budget
        self.bases = torch.zeros(0, dtype=torch.int64)
        self.mapped = torch.zeros(0, dtype=torch.int64)
        self.reads = torch.zeros(0, dtype=torch.int64)
        self._idle = True  # plan has nothing to do until the next read or write
        self._in_flight: Optional[MapJob] = None
        self._closing = False

    def grow(self, segments: int) -> None:
        """Makes room in the tables for ``segments`` segments in all."""
        more = segments - self.bases.numel()
        if more > 0:
            self.bases, self.mapped, self.reads = (torch.cat([t, torch.zeros(more, dtype=torch.int64)])
                                                   for t in (self.bases, self.mapped, self.reads))

    def changed(self) -> None:
        """Records were read or written: the next :meth:`plan` looks again."""
        self._idle = False

    @property
    def budget(self) -> int:
        """Bytes of records the mapping may hold."""
        return self._budget

    def set_budget(self, nbytes: int) -> None:
        """A new :attr:`budget` (the next :meth:`plan` maps up to it, or unmaps down to it)."""
        if nbytes != self._budget:
            self._budget = nbytes
            self._idle = False

    @property
    def bytes(self) -> int:
        """Bytes of records in the page tables."""
        return int(self.mapped.sum()) * self.record_bytes

    def plan(self, fds: torch.Tensor, written: torch.Tensor) -> Optional[MapJob]:
        """The next up to 16 MB of the segment to map next (``fds``: each segment's file, -1 gone; ``written``: its
        records), mapped but not yet populated, or None (nothing to do, or a step in flight). Call it holding the
        table's lock; then :meth:`populate` without it and :meth:`publish` with it."""
        if self._idle or self._in_flight is not None:
            return None
        if int(self.reads.sum()) > _READS_HALVED_AT:
            self.reads >>= 1
        if self.bytes > self._budget + _SHRINK_SLACK:
            self._unmap(int(self._least_read_mapped()))
            return None
        room = self._budget - self.bytes
        wanted = torch.nonzero((self.mapped < written) & (fds >= 0) & ((self.reads > 0) | (room >= self.record_bytes))).squeeze(1)
        if not wanted.numel():
            self._idle = True
            return None
        segment = int(wanted[torch.argmax(self.reads[wanted])])
        if room < self.record_bytes:
            coldest = self._least_read_mapped()
            if coldest is None:  # a budget below one record: nothing is ever mapped
                self._idle = True
                return None
            if coldest == segment or 2 * int(self.reads[coldest]) >= int(self.reads[segment]):
                self._idle = True
                return None
            self._unmap(coldest)
            room = self._budget - self.bytes
        if not int(self.bases[segment]):
            self.bases[segment] = native_records.map_file(int(fds[segment]), self.segment_bytes)
        first = int(self.mapped[segment]) * self.record_bytes
        start = first & ~4095  # from the page the mapped records end in
        end = min(int(written[segment]) * self.record_bytes, first + min(room, _STEP_BYTES))
        self._in_flight = MapJob(segment, int(self.bases[segment]) + start, end - start, first, end)
        return self._in_flight

    def _least_read_mapped(self) -> Optional[int]:
        mapped = torch.nonzero(self.mapped > 0).squeeze(1)
        return int(mapped[torch.argmin(self.reads[mapped])]) if mapped.numel() else None

    def _unmap(self, segment: int) -> None:
        """Takes ``segment``'s pages out of the page tables; the mapping stays, so a read under way still copies
        from it (a fault brings the page back)."""
        native_records.map_pages(int(self.bases[segment]), int(self.mapped[segment]) * self.record_bytes, drop=True)
        self.mapped[segment] = 0

    @staticmethod
    def populate(job: MapJob) -> None:
        """Reads the job's pages into the page tables: from the disk, where the page cache lacks them. Call it
        without the table's lock (a segment's written records never change; the mapping stays until :meth:`publish`)."""
        native_records.map_pages(job.address, job.nbytes)

    def publish(self, job: MapJob, populated: bool = True) -> int:
        """Makes the populated records of ``job`` readable through the mapping (``populated`` False: a failed
        :meth:`populate`, nothing changes); returns the bytes mapped. Call it holding the table's lock."""
        self._in_flight = None
        if self._closing:
            self._unmap_all()
            return 0
        if not populated:
            return 0
        self.mapped[job.segment] = job.end // self.record_bytes
        return job.end - job.first

    def in_flight(self, segment: int) -> bool:
        """Whether a step of mapping ``segment`` is under way (planned, not yet published)."""
        return self._in_flight is not None and self._in_flight.segment == segment

    def drop(self, segment: int) -> None:
        """Unmaps ``segment`` (deleted; the table's lock held, no read under way)."""
        if int(self.bases[segment]):
            native_records.unmap_file(int(self.bases[segment]), self.segment_bytes)
        self.bases[segment] = self.mapped[segment] = self.reads[segment] = 0

    def close(self) -> None:
        """Unmaps every segment (the table's lock held), or, while a step is in flight, has its :meth:`publish` do it."""
        if self._in_flight is not None:
            self._closing = True
        else:
            self._unmap_all()

    def _unmap_all(self) -> None:
        for base in self.bases.tolist():
            if base:
                native_records.unmap_file(base, self.segment_bytes)
        self.bases = self.mapped = self.reads = torch.zeros(0, dtype=torch.int64)
