"""The store's native kernels: one C file and one binding module per subject, sharing ``store.h``.

- ``id_index.c`` / :mod:`.id_index`: a table's id index (id -> row);
- ``rows.c`` / :mod:`.rows`: the fields of a table's rows in chunks, the eviction sweep, initial rows;
- ``jobs.c`` / :mod:`.jobs`: a training request's kernels over many tables (lookups, sparse updates, admission);
- ``disk_map.c`` / :mod:`.disk_map`: the disk tier's id map (id -> slot on disk) and its checkpoint;
- ``records.c`` / :mod:`.records`: the disk tier's record reads (pread and mmap) and its live bits.

A table operation of a training step touches a few hundred ids; in tensor ops its index probe costs a dozen
dispatches per pass and dominated the shard's CPU. The C loop does the same work in microseconds, and on tables far
larger than the caches it keeps many cache misses in flight at once (see ``store.h``).

Compiled into a library in this folder when the package is built, loaded by
:mod:`lightning_persia.ops.native.library`. Without it the id index, the rows and the sparse rules keep their tensor
implementation (same results, slower) and a disk table is refused; :func:`available` tells which is in use.

Example::

    from lightning_persia.remote_ps.store import native
    from lightning_persia.remote_ps.store.native.id_index import Index
    if native.available():
        index = Index()
"""
from __future__ import annotations

from pathlib import Path

from lightning_persia.ops.native.library import Library

LIBRARY = Library(Path(__file__).parent, "the store's native kernels", __name__)
"""The library of this folder (its ``*.c`` files)."""


def available() -> bool:
    """True when the store's native kernels are loaded (and used by the id index, the rows and the disk tier)."""
    return LIBRARY.available()
