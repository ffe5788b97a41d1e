"""A shard process's allocator: memory a request frees stays on the heap for the next request.

A request's temporary tensors (ids, rows, gradients: a few MB each) are allocated and freed by glibc's malloc,
which by default maps the larger ones on their own and unmaps them when freed, and grows and shrinks its
per-thread heaps as requests come and go. Each of those calls (``mmap``, ``munmap``, ``mprotect``, ``brk``)
takes the process's memory-map lock for writing, so it waits for whatever holds it for reading: above all the
store's background commit of a growing table's next rows (``MADV_POPULATE_WRITE``, which may have the kernel
compact memory for a huge page first). A request thread that waits there holds its table's lock. Keeping
freed memory on the heap takes those calls off the request path; what it keeps is bounded (the heaps of two
arenas, each trimmed past :data:`TRIM_THRESHOLD_BYTES` of free memory at its top).

Only the shard server process sets this (``remote_ps/process.py``); a trainer or a test that holds a store in
its own process keeps its allocator as it is.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8

MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations below this come from a heap (glibc's largest accepted value with its default heap size)."""
TRIM_THRESHOLD_BYTES = 256 << 20
"""Free memory at a heap's top kept for reuse (beyond it, the heap gives memory back)."""
TOP_PAD_BYTES = 64 << 20
"""How much more than asked the main heap grows by, so that it grows seldom."""
ARENAS = 2
"""Heaps shared by the process's threads: each keeps its free memory, so their number bounds what is kept."""


def keep_freed_memory() -> bool:
    """Sets this process's malloc as the module docstring says; False (and a log line) where it cannot (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt in this process: request allocations keep the allocator's defaults")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    settings = {"M_ARENA_MAX": (_M_ARENA_MAX, ARENAS), "M_MMAP_THRESHOLD": (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                "M_TRIM_THRESHOLD": (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), "M_TOP_PAD": (_M_TOP_PAD, TOP_PAD_BYTES)}
    refused = [name for name, (parameter, value) in settings.items() if mallopt(parameter, value) != 1]
    if refused:
        log.warning("malloc refused %s: some request allocations may still map and unmap memory", ", ".join(refused))
    return not refused
