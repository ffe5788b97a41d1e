"""A train dataloader wrapper that plans and starts each batch's embedding lookups ahead of its step.

A background thread reads batches from the wrapped loader, plans their lookups (dedup, bucketing, encoding)
and starts each as soon as the pipeline's scheduler allows, keeping up to ``staleness + 1`` batches ready.
The batch itself is handed to the trainer at once; only the forward waits for the rows.

When the loader is a ``DataLoader`` with worker processes, the planning runs in them instead (its
``collate_fn`` is wrapped for the epoch, see ``planning.py``): the trainer's interpreter only issues the lookups.

A stateful loader (one with ``state_dict``/``load_state_dict``, such as torchdata's ``StatefulDataLoader``) has
read ahead of the trainer by the batches waiting here: its state is taken as each batch is read, and the
wrapper's ``state_dict()`` is the one taken with the last batch handed to the trainer, so a checkpoint saved
mid-epoch resumes at the next batch the trainer had not run, as it does without the strategy.
"""
from __future__ import annotations

import copy
import threading
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Optional

from torch.utils.data import DataLoader

from lightning_persia.embedding.context import StepContext
from lightning_persia.embedding.pipeline import EmbeddingPipeline
from lightning_persia.embedding.planning import PlannedBatch, PlanningCollate
from lightning_persia.embedding.scheduler import LookupStopped

_END = object()


class PrefetchingLoader:
    """Iterable over ``loader``'s batches whose embedding rows are fetched ahead by ``pipeline``.

    Attributes such as ``sampler``, ``batch_size`` or ``dataset`` are those of the wrapped loader, so
    Lightning's sampler and length handling keep working.
    """

    def __init__(self, loader: Iterable, pipeline: EmbeddingPipeline) -> None:
        self.loader = loader
        self.pipeline = pipeline
        self._active: "_PrefetchIterator | None" = None
        self._collate: Optional[Callable[[Any], Any]] = None  # the loader's own, while its workers plan

    def __iter__(self) -> Iterator[Any]:
        self.close()
        loader = self.loader
        if isinstance(loader, DataLoader) and loader.num_workers > 0:
            # With the paths learned so far: a worker forked now plans what the pipeline knows now.
            self._collate = loader.collate_fn
            loader.collate_fn = PlanningCollate(loader.collate_fn, self.pipeline.batch_planner())
        snapshot = getattr(loader, "state_dict", None)
        self._active = _PrefetchIterator(iter(loader), self.pipeline, depth=self.pipeline.staleness + 1, snapshot=snapshot)
        return self._active

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "pipeline", "_active"):
            raise AttributeError(name)
        if name == "state_dict" and hasattr(self.loader, "state_dict"):  # stateful only if the wrapped loader is
            return self._state_dict
        return getattr(self.loader, name)

    def _state_dict(self) -> Any:
        """The wrapped loader's state as of the last batch the trainer took (not of the batches read ahead)."""
        if self._active is not None and self._active.handed_state is not None:
            return self._active.handed_state
        return self.loader.state_dict()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stops the running epoch's thread and releases the batches it planned but the trainer never ran."""
        if self._active is not None:
            self._active.close()
            self._active = None
        if self._collate is not None:
            self.loader.collate_fn = self._collate  # type: ignore[attr-defined]
            self._collate = None


class _PrefetchIterator:
    def __init__(self, batches: Iterator[Any], pipeline: EmbeddingPipeline, depth: int,
                 snapshot: Optional[Callable[[], Any]] = None) -> None:
        self._batches = batches
        self._pipeline = pipeline
        self._depth = depth
        self._snapshot = snapshot
        self.handed_state: Any = None  # the loader's state taken with the last batch handed out
        self._items: deque[Any] = deque()
        self._changed = threading.Condition()  # an item put or taken, or the iterator stopped
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="persia-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> "_PrefetchIterator":
        return self

    def __next__(self) -> Any:
        with self._changed:
            while not self._items:
                if self._stopped:
                    raise StopIteration
                self._changed.wait()
            item = self._items[0]
            if item is _END:  # stays: later calls see the end too
                raise StopIteration
            self._items.popleft()
            self._changed.notify_all()
        if isinstance(item, BaseException):
            raise item
        batch, step, state = item
        self._pipeline.enqueue(step)
        if self._snapshot is not None:
            self.handed_state = state
        return batch

    def _is_stopped(self) -> bool:
        return self._stopped

    def _run(self) -> None:
        try:
            for item in self._batches:
                if self._stopped:
                    return
                if isinstance(item, PlannedBatch):  # planned in a DataLoader worker
                    batch, step = item.batch, self._pipeline.adopt(item)
                else:
                    batch, step = item, self._pipeline.plan(item)
                state = copy.deepcopy(self._snapshot()) if self._snapshot is not None else None
                if not self._put((batch, step, state)):
                    self._pipeline.abandon([step])
                    return
                try:
                    self._pipeline.issue(step, self._is_stopped)
                except LookupStopped:
                    return
            self._put(_END)
        except BaseException as error:  # handed to the trainer's thread, which raises it
            self._put(error)

    def _put(self, item: Any) -> bool:
        with self._changed:
            while len(self._items) >= self._depth and not self._stopped:
                self._changed.wait()
            if self._stopped:
                return False
            self._items.append(item)
            self._changed.notify_all()
            return True

    def close(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        self._pipeline.wake()
        self._thread.join()
        leftovers: list[StepContext] = [item[1] for item in self._items if isinstance(item, tuple)]
        self._items.clear()
        self._pipeline.abandon(leftovers)
        self._pipeline.abandon_ready()
