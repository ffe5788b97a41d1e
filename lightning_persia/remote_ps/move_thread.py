"""The threads a shard moves slots on, below its requests' CPU priority (``PSConfig.move_nice``): a move then takes
the cores its trainers' requests leave, rather than share them evenly."""
from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

log = logging.getLogger("lightning_persia.ps")

_T = TypeVar("_T")


class MoveThread:
    """Runs calls one at a time on a thread of its own whose nice value is ``nice`` above the process's. The caller
    waits for each call and hears what it raises, as if it had made the call itself.

    A thread of its own, because a thread that lowers its priority cannot raise it again without privileges: a
    gRPC handler thread that did would serve the trainers' next requests at the move's priority."""

    def __init__(self, name: str, nice: int) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=_lower_priority, initargs=(nice,))

    def run(self, call: Callable[..., _T], *args) -> _T:
        return self._executor.submit(call, *args).result()

    def close(self) -> None:
        """Lets the call under way, if any, finish; takes no more."""
        self._executor.shutdown(wait=False)


def _lower_priority(nice: int) -> None:
    # Linux keeps a nice value per thread; elsewhere PRIO_PROCESS with this id would lower the whole process
    if not nice or not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + nice))
    except OSError as err:
        log.warning("a move's thread keeps the shard's CPU priority: the system refused nice +%d (%s)", nice, err)
