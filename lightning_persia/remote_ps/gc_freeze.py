"""A shard process keeps the objects of its start-up out of Python's full collections.

Python's cyclic garbage collector now and then runs a full collection, which visits every tracked object of
the process: ~180k after importing torch, gRPC and the package, 35 to 45 ms on the development machine's 2 cores. It
runs inside
whatever allocation crosses its threshold, so in a shard sometimes inside a request that holds its table's lock,
where it adds those ms to what the table's other requests wait. The objects of the start-up (modules, classes,
functions) live as long as the process: :func:`freeze_startup_objects` moves them to the collector's permanent
generation (``gc.freeze``), and a full collection visits only what the requests left since (a fraction of a ms).
"""
from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Exempts every object tracked now from later collections (for good: call it before making anything the
    process will drop, such as a table); returns how many objects that is."""
    gc.collect()  # what start-up left for collection goes now, not frozen in for the process's lifetime
    gc.freeze()
    return gc.get_freeze_count()
