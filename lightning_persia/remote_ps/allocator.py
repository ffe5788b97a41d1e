"""A shard process's allocator: jemalloc where the system has it; else glibc's malloc, keeping what a request frees.

**Which allocator.** A shard's request threads allocate and free a few tensors of every size per request, while its
demoter frees and allocates others beside them. Under glibc's malloc the free chunks of such a heap pile up, and a
request thread's allocations search them: ``_int_malloc`` was 14% of a disk table's request threads' CPU at the steady
state of a Zipf stream over 100M rows, 40M in memory, against 2.6% for an all-in-memory table. jemalloc allocates
from size classes instead. It cannot be chosen from inside a running process (it
must be loaded before anything allocates), so the launchers start shards with it preloaded
(:func:`shard_environment`: ``LD_PRELOAD``), where the system has it (Debian, Ubuntu: ``libjemalloc2``), and the
shard says which one it runs with (:func:`running_allocator`).

**glibc's malloc**, where jemalloc is absent or not wanted: memory a request frees stays on the heap for the next.

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
import ctypes.util
import logging
from typing import Mapping

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


JEMALLOC, SYSTEM = "jemalloc", "system"
"""What :func:`running_allocator` says; also two of a launcher's :data:`ALLOCATORS`."""
ALLOCATORS = ("auto", JEMALLOC, SYSTEM)
"""A launcher's choices: jemalloc where the system has it (``auto``), jemalloc or an error, the process's own."""
_PRELOAD = "LD_PRELOAD"


class AllocatorError(RuntimeError):
    """The allocator asked for is not on this system."""


def shard_environment(allocator: str, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a shard process started with ``allocator`` (one of :data:`ALLOCATORS`): jemalloc's library put
    first in ``LD_PRELOAD`` (kept where it is there already), or ``env`` as it is."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}; got {allocator!r}")
    if allocator == SYSTEM or preloads_jemalloc(env):
        return dict(env)
    library = ctypes.util.find_library(JEMALLOC)
    if library is None:
        if allocator == JEMALLOC:
            raise AllocatorError("allocator 'jemalloc': no libjemalloc on this system (Debian, Ubuntu: apt install "
                                 "libjemalloc2); or start the shards with allocator 'auto' or 'system'")
        return dict(env)
    return {**env, _PRELOAD: f"{library} {env.get(_PRELOAD, '')}".strip()}


def preloads_jemalloc(env: Mapping[str, str]) -> bool:
    """Whether a process started with ``env`` runs on jemalloc (its ``LD_PRELOAD`` names it)."""
    return JEMALLOC in env.get(_PRELOAD, "")


def running_allocator() -> str:
    """``"jemalloc"`` where this process's ``malloc`` is jemalloc's (it exports ``mallctl``), else ``"system"``."""
    try:
        ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return SYSTEM
    return JEMALLOC


def keep_freed_memory() -> bool:
    """Sets this process's malloc as the module docstring says; False (and a log line) where it cannot (not glibc).
    Under jemalloc there is nothing to set."""
    if running_allocator() == JEMALLOC:
        log.info("malloc is jemalloc's")
        return True
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
