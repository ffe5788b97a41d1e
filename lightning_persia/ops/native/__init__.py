"""The trainer's native kernels (``ids.c``, bound in ``ids.py``): each table's unique ids of a batch, and the first
id of a batch that another shard owns.

Compiled into a library in this folder when the package is built, loaded by :mod:`.library`. Without it every
caller keeps its tensor implementation (same results, slower); :func:`available` tells which is in use. The
parameter server's store has kernels of its own (``lightning_persia.remote_ps.store.native``).

Example::

    from lightning_persia.ops import native
    from lightning_persia.ops.native import ids
    if native.available():
        first = ids.first_foreign(ids_of_a_request, ShardMap.uniform(2).table, shard=0)
"""
from __future__ import annotations

from pathlib import Path

from lightning_persia.ops.native.library import Library

LIBRARY = Library(Path(__file__).parent, "the trainer's native kernels", __name__)
"""The library of this folder (``ids.c``)."""


def available() -> bool:
    """True when the trainer's native kernels are loaded (and used by dedup and the shard-ownership check)."""
    return LIBRARY.available()
