"""When a disk tier compacts a segment, and which records a step moves: a promotion leaves its record behind as
garbage, and compaction writes a sparse segment's live rows anew so that the files do not grow without end."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

COMPACT_BELOW = 0.5
"""A full segment is compacted once fewer than this fraction of its records are live rows ..."""
COMPACT_GARBAGE = 1 / 8
"""... and garbage is more than this fraction of the tier's records. A step moves live rows with the table's lock
held, so the garbage a Zipf stream's promotions leave is let gather to this bound before any is moved: the first
hundreds of requests after a table grew promote from the same few segments, and compacting them at once cost the
requests more time than their reads."""
COMPACT_ANY = 1 / 5
"""Past this fraction of garbage, the sealed segment with the fewest live rows is compacted whatever its live
fraction (it holds at least the tier's average garbage): the files stay within about 1.25x the live records, a
segment or two aside, however long the stream. Below :data:`COMPACT_BELOW` alone, promotions that hit every
segment alike left each above half live while the files grew: 1.41x the live records after 6,300 Zipf requests at
100M rows, which at a billion rows would pass 70 GB."""
_COMPACT_ROWS = 1 << 14  # live rows a compaction step moves at most, the table's lock held: a demotion slice's worth
_COMPACT_SPAN = 1 << 16
"""Records a compaction step reads at most (3 MB at 48 bytes a record), in one ``pread`` from its first live one. Read
a record at a time (a system call each), compaction took 4.46 ms of the demoter's CPU a Zipf request at 100M rows,
more than its promotions or its demotions; read so, 3.18 ms, and 1.55 ms with the id map's entries re-pointed in
place (``DiskMap.move``) instead of removed and inserted anew."""


def sparsest(written: list[int], live: torch.Tensor, has_files: torch.Tensor,
             sealed: Callable[[], torch.Tensor]) -> Optional[int]:
    """The sealed segment with the fewest live rows, if below :data:`COMPACT_BELOW` of its records (or whatever
    its live rows, once the tier's garbage passed :data:`COMPACT_ANY`) and above none (one without any is deleted
    instead), once the tier's garbage passed :data:`COMPACT_GARBAGE`. ``written``: the records written in each
    segment; ``live``: its live rows; ``has_files``: a mask of the segments with files; ``sealed``: makes the mask of
    those written no more (only once garbage passed the bound)."""
    written = torch.tensor(written, dtype=torch.float64)
    live = live.to(torch.float64)
    records = float(written[has_files].sum())  # a deleted segment's number holds none
    garbage = records - float(live.sum())
    if garbage <= COMPACT_GARBAGE * records:
        return None
    below = COMPACT_BELOW * written if garbage <= COMPACT_ANY * records else written
    candidates = torch.nonzero(sealed() & (live > 0) & (live < below)).squeeze(1)
    if not candidates.numel():
        return None
    return int(candidates[torch.argmin(live[candidates])])


def first_live(bits: torch.Tensor, rows: int) -> torch.Tensor:
    """The first :data:`_COMPACT_ROWS` live slots (at least one) among the :data:`_COMPACT_SPAN` that follow a segment's
    first live one, from its live ``bits`` over ``rows`` slots: only the bits of that span are unpacked."""
    flags = bits.numpy()
    start = int(np.argmax(flags != 0)) * 8  # the first live one's byte
    end = min(start + 8 + _COMPACT_SPAN, rows)
    slots = np.flatnonzero(np.unpackbits(flags[start // 8 : (end + 7) // 8], count=end - start, bitorder="little")) + start
    return torch.from_numpy(slots[slots < slots[0] + _COMPACT_SPAN][:_COMPACT_ROWS])
