"""What a shard process sets about itself: its priority, its heap, and its end with its parent.

- :func:`prepare_shard_process` runs once before the tables exist: the allocator settings (``allocator.py``),
  torch's threads, ``nice`` and ``SCHED_IDLE``, the native kernels, and the start-up objects frozen out of
  the garbage collector (``gc_freeze.py``).
- :func:`trim_memory_every` hands freed heap memory back to the OS now and then (glibc ``malloc_trim``; not under
  jemalloc, which does so itself).
- :func:`exit_with_parent` stops the shard when the process that owns it is gone (``prctl(PR_SET_PDEATHSIG)``
  and a watchdog).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

import torch

from lightning_persia.ops import native
from lightning_persia.remote_ps.allocator import SYSTEM, keep_freed_memory, running_allocator
from lightning_persia.remote_ps.config import PSConfig
from lightning_persia.remote_ps.gc_freeze import freeze_startup_objects
from lightning_persia.remote_ps.store import native as store_native

log = logging.getLogger("lightning_persia.ps")

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def prepare_shard_process(config: PSConfig) -> None:
    """Settles this process as a shard before its first table (see the module's docstring)."""
    keep_freed_memory()  # before the first request thread has an arena of its own
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    if config.nice:
        os.nice(config.nice)
    if config.scheduling == "idle":
        schedule_idle()
    # Loads the kernels (or warns that it cannot) now, not inside the first request: the store's, and ops' that
    # check which shard owns the ids of a request.
    store_native.available()
    native.available()
    # Before the tables: a frozen object is never collected, and a table a load replaces must be freed.
    freeze_startup_objects()


def schedule_idle() -> None:
    """``SCHED_IDLE`` for every thread of this process (a thread started later inherits its creator's policy).

    A system that refuses it (a sandbox without ``sched_setscheduler``) leaves the shard at its normal priority, with
    a warning: the policy is a courtesy to the processes it shares cores with, not a condition of serving.
    """
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setscheduler(int(task), os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # the thread ended in between
                pass
    except OSError as err:
        log.warning("scheduling 'idle' refused by the system (%s); the shard runs at its normal priority", err)


def trim_memory_every(interval_s: float, stop: threading.Event) -> None:
    """Hands freed heap memory back to the OS every ``interval_s`` seconds (glibc ``malloc_trim``) until ``stop``.

    Every request allocates and frees buffers of megabytes on one of many handler threads; glibc keeps such
    freed memory in per-thread arenas, which would otherwise count as resident memory of the shard.
    """
    if running_allocator() != SYSTEM:
        return  # jemalloc hands back what it freed on its own; glibc's heaps then hold next to nothing
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return  # not glibc

    def loop() -> None:
        while not stop.wait(interval_s):
            trim(0)

    threading.Thread(target=loop, name="persia-ps-malloc-trim", daemon=True).start()


def exit_with_parent(parent_pid: int, stop: threading.Event, poll_s: float = 0.5) -> None:
    """Sets ``stop`` once ``parent_pid`` is gone (and asks the kernel for SIGTERM on the parent's death)."""
    direct = parent_pid == os.getppid()
    if direct and sys.platform.startswith("linux"):
        try:  # SIGTERM when the parent thread that started us exits; the watchdog below covers the rest
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def alive() -> bool:
        if direct:
            return os.getppid() == parent_pid  # re-parented once the parent is gone (immune to pid reuse)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # alive, owned by another user
        return True

    def watch() -> None:
        while not stop.wait(poll_s):
            if not alive():
                log.warning("parent process %d is gone; stopping", parent_pid)
                stop.set()

    if not alive():
        stop.set()
    threading.Thread(target=watch, name="persia-ps-parent-watchdog", daemon=True).start()
