"""A lock for many readers or one writer, the writer first: what the standard library lacks.

Predictions read while a serving version switch writes (``serving/predictor.py``); a shard's requests read while a
change of what it owns writes (``remote_ps/store/slot_moves.py``). A few lines, not a dependency.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class ReadWriteLock:
    """Any number of readers, or one writer; a waiting writer goes before readers that come after it."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        with self._condition:
            while self._writing or self._writers_waiting:
                self._condition.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._condition:
                self._readers -= 1
                if not self._readers:
                    self._condition.notify_all()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        with self._condition:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._condition.wait()
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._condition:
                self._writing = False
                self._condition.notify_all()
