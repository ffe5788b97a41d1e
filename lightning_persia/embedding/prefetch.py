"""A train dataloader wrapper that plans and starts each batch's embedding lookups ahead of its step.

A background thread reads batches from the wrapped loader, dedups their ids and starts their lookups as
soon as the staleness window allows, keeping up to ``staleness + 1`` batches ready. The batch itself is
handed to the trainer at once; only the forward waits for the rows.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Iterable, Iterator

from lightning_persia.embedding.worker import EmbeddingWorker, _Step

_END = object()


class PrefetchingLoader:
    """Iterable over ``loader``'s batches whose embedding rows are fetched ahead by ``worker``.

    Attributes such as ``sampler``, ``batch_size`` or ``dataset`` are those of the wrapped loader, so
    Lightning's sampler and length handling keep working.
    """

    def __init__(self, loader: Iterable, worker: EmbeddingWorker) -> None:
        self.loader = loader
        self.worker = worker
        self._active: "_PrefetchIterator | None" = None

    def __iter__(self) -> Iterator[Any]:
        self.close()
        self._active = _PrefetchIterator(iter(self.loader), self.worker, depth=self.worker.window.staleness + 1)
        return self._active

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "worker", "_active"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def close(self) -> None:
        """Stops the running epoch's thread and releases the batches it planned but the trainer never ran."""
        if self._active is not None:
            self._active.close()
            self._active = None


class _PrefetchIterator:
    def __init__(self, batches: Iterator[Any], worker: EmbeddingWorker, depth: int) -> None:
        self._batches = batches
        self._worker = worker
        self._queue: "queue.Queue[Any]" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="persia-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> "_PrefetchIterator":
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # later calls see the end too
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        batch, step = item
        self._worker.enqueue(step)
        return batch

    def _run(self) -> None:
        try:
            for batch in self._batches:
                step = self._worker.plan(batch)
                if not self._put((batch, step)):
                    self._worker.abandon([step])
                    return
                try:
                    self._worker.issue(step, self._stop)
                except BaseException:
                    if self._stop.is_set():
                        return
                    raise
            self._put(_END)
        except BaseException as error:  # handed to the trainer's thread, which raises it
            self._put(error)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        self._stop.set()
        leftovers: list[_Step] = []
        while self._thread.is_alive() or not self._queue.empty():
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(item, tuple):
                leftovers.append(item[1])
        self._thread.join()
        self._worker.abandon(leftovers)
        self._worker.abandon_ready()
