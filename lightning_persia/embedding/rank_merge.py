"""One embedding update per step for all trainer ranks, as if one rank had trained on the global batch.

Without merging, every rank pushes the gradient of its own share of the batch and the shards apply each as a
step of their own: N ranks take N optimizer steps on a row that one rank would step once. For SGD that is the
same thing; for Adagrad and Adam it is not (the second step is taken with the state the first one left), so
the model would depend on the number of ranks. And a rank's acknowledgement would cover its own update only,
so a lookup of the next batch could miss another rank's part of the previous one, even at staleness 0.

:class:`RankMerge` makes the ranks push one update: after the backward (where DDP all-reduces the dense
gradients) the ranks all-gather their embedding gradients and each sums them into the same update (unique ids,
summed rows). Rank 0 pushes it under one sender id, and tells every other rank its outcome (a broadcast, in step
order) once the shards have applied it. So:

- N ranks train the tables like one rank on the global batch, the way DDP trains the dense weights (and the
  way TorchRec's sharded tables, which reduce gradients before the optimizer, behave);
- an acknowledged update is the whole step's update on every rank, and the staleness window counts steps of
  the job, not of one rank;
- the update is routed by one rank's shard map. Ranks that each sent a copy under the shared sender would route
  it by the map each had heard of, and while the shards are scaled (``docs/elastic.md``) two maps split it into
  different messages under the same sequence numbers, which the shards refuse as conflicting duplicates.

The cost: two all-gathers of the embedding gradients per step (sizes, then the bytes), and a broadcast of each
push's outcome from rank 0. They run on threads of their own with gloo groups of their own, so the trainer goes
on to the optimizer step and the next forward as it does without merging.
"""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from concurrent.futures import CancelledError, Future
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_persia.embedding.phases import MERGE
from lightning_persia.embedding.context import SparseUpdate
from lightning_persia.embedding.embedding_worker import portable_error
from lightning_persia.ops.dedup import unique_by_table
from lightning_persia.ops.keyed_ids import KeyedIds, RowLayout

log = logging.getLogger(__name__)


class RankMerge:
    """Sums the ranks' embedding gradients of each step into one update that rank 0 pushes as ``sender``.

    Every rank submits one update (or None) per step, in the same order (as DDP's backward does), and hears the
    outcome of rank 0's push of the merged update. Needs an initialised default process group; creates two gloo
    groups of its own (collectives: every rank constructs the merge together).

    Example::

        merge = RankMerge(sender="job-42-merged", dims={"user": 16, "item": 16})
        future = merge.submit(update, lambda merged: client.update_sharded_async(client.shard(merged.keyed), merged.grads,
                                                                                  merged.dims, sender=merge.sender))
        future.result()   # this step's merged update is applied on every shard (``push`` runs on rank 0 only)
    """

    def __init__(self, sender: str, dims: dict[str, int], timeout: Optional[timedelta] = None) -> None:
        if not sender:
            raise ValueError("RankMerge needs a sender id shared by every rank")
        if not dims:
            raise ValueError("RankMerge needs the remote tables' dims (there is nothing to merge without a table)")
        self.sender = sender
        self.dims = dict(dims)
        self._tables = sorted(self.dims)
        self._index = {name: i for i, name in enumerate(self._tables)}
        # The ranks meet here once a step, so the timeout bounds how far apart they may drift (as DDP's does).
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        # Rank 0's outcomes go on a group of their own: their broadcast waits for a push while the next step gathers.
        self._outcomes = dist.new_group(backend="gloo", timeout=timeout)
        self._world = dist.get_world_size()
        self._pushes = dist.get_rank() == 0
        self._queue: queue.Queue = queue.Queue()
        self._pushed: queue.Queue = queue.Queue()  # (rank 0's push, or None on the other ranks; the step's future)
        self._thread = threading.Thread(target=self._run, name="persia-rank-merge", daemon=True)
        self._answers = threading.Thread(target=self._answer, name="persia-rank-merge-outcomes", daemon=True)
        self._thread.start()
        self._answers.start()
        # The strategy leaves its merge open after fit (it stays set up for a later test()): the merge is then
        # closed before the interpreter finalizes, while its threads may still finish a step (see close()).
        atexit.register(self.close)

    def submit(self, update: Optional[SparseUpdate], push: Callable[[SparseUpdate], "Future[None]"]) -> "Future[None]":
        """Merges ``update`` with the other ranks' of the same step; rank 0 then calls ``push(merged)``. Returns the
        outcome of that push, on every rank."""
        if update is not None:
            unknown = sorted(set(update.keyed.tables) - set(self.dims))
            if unknown:
                raise ValueError(f"gradients of tables the rank merge was not set up for: {unknown}")
            for name, dim in zip(update.keyed.tables, update.dims):
                if dim != self.dims[name]:
                    raise ValueError(f"table {name!r}: gradient rows of dim {dim}, the rank merge was set up with dim {self.dims[name]}")
            expected = RowLayout(update.keyed.counts, update.dims).numel
            if update.grads.dim() != 1 or update.grads.numel() != expected:
                raise ValueError(f"gradients must be flat with {expected} values (ids x dims), got shape {tuple(update.grads.shape)}")
        done: Future = Future()
        self._queue.put((update, push, done))
        return done

    def close(self, timeout_s: float = 5.0) -> None:
        """Lets the merge threads end after the steps submitted so far, waiting up to ``timeout_s`` for them (not
        longer: another rank may be gone), then destroys the merge's process groups and joins their threads.

        Runs at interpreter exit if not called before. A daemon thread inside a collective or a torch op when
        the interpreter finalizes is ended by ``pthread_exit`` as it takes the GIL back, and that unwinding
        through torch's C++ frames aborts the process (``terminate called without an active exception``).
        """
        atexit.unregister(self.close)
        self._queue.put(None)  # the merge thread passes it on to the outcomes' thread when it ends
        deadline = time.monotonic() + timeout_s
        for thread in (self._thread, self._answers):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():  # still inside a collective: its group must outlive it
                log.warning("RankMerge: the thread %s did not end within %.0f s of close(); another rank is gone or "
                            "out of step", thread.name, timeout_s)
                return
        self._release_groups()

    def _release_groups(self) -> None:
        """Destroys the merge's groups and drops the last references to them.

        destroy_process_group leaves a gloo group's worker threads running until the group's last reference goes;
        its destructor then joins them (with the GIL released). Dropped here, they end while Python is alive. Left
        to finalization, a worker that frees the last collective's tensors after the interpreter began to finalize
        takes the GIL, is ended by pthread_exit and aborts the process (5 of 8 exits of a script that kept its
        destroyed group did, 0 of 8 that dropped it).
        """
        groups = [group for group in (self._group, self._outcomes) if group is not None]
        self._group = self._outcomes = None
        if dist.is_initialized():
            for group in groups:
                try:
                    dist.destroy_process_group(group)
                except ValueError:  # already gone: destroying the default group destroys every group
                    pass

    def _run(self) -> None:
        failure: Optional[BaseException] = None
        while (item := self._queue.get()) is not None:
            update, push, done = item
            if failure is not None:  # a failed collective leaves the ranks out of step: every later one fails too
                done.set_exception(failure)
                continue
            try:
                with record_function(MERGE):
                    parts = self._gather(update)
            except BaseException as error:  # noqa: BLE001 - handed to the step's future
                failure = error
                done.set_exception(error)
                continue
            try:
                with record_function(MERGE):
                    merged = merge_updates(parts)
            except BaseException as error:  # noqa: BLE001 - the same parts fail the same way on every rank
                done.set_exception(error)
                continue
            if merged is None:  # the same on every rank: no push, no outcome to hear
                done.set_result(None)
            else:
                self._pushed.put((_started(push, merged) if self._pushes else None, done))
        self._pushed.put(None)

    def _answer(self) -> None:
        """Hands every rank the outcome of rank 0's push of each step, in step order."""
        failure: Optional[BaseException] = None
        while (item := self._pushed.get()) is not None:
            pushed, done = item
            if failure is not None:  # a failed broadcast leaves the ranks out of step: every later one fails too
                done.set_exception(failure)
                continue
            try:
                error = self._outcome(pushed)
            except BaseException as broken:  # noqa: BLE001 - handed to the step's future
                failure = broken
                done.set_exception(broken)
                continue
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

    def _outcome(self, pushed: Optional["Future[None]"]) -> Optional[BaseException]:
        """The error of rank 0's push (``pushed`` there, None elsewhere), or None once the shards applied it."""
        error: Optional[BaseException] = None
        if pushed is not None:
            try:
                error = pushed.exception()
            except CancelledError as cancelled:  # the client closed with the update in flight
                error = cancelled
        failed = torch.tensor([error is not None], dtype=torch.int64)
        dist.broadcast(failed, src=0, group=self._outcomes)
        if not failed.item():
            return None
        told = [portable_error(error) if error is not None else None]
        dist.broadcast_object_list(told, src=0, group=self._outcomes)
        return error if pushed is not None else told[0]

    def _gather(self, update: Optional[SparseUpdate]) -> list[SparseUpdate]:
        """Every rank's update (its tables as the indices of :attr:`_tables`, their counts, ids and gradients)."""
        num = len(self._tables)
        header = torch.full((2 * num,), -1, dtype=torch.int64)
        if update is not None:
            k = len(update.keyed.tables)
            header[:k] = torch.tensor([self._index[t] for t in update.keyed.tables], dtype=torch.int64)
            header[num : num + k] = torch.tensor(update.keyed.counts, dtype=torch.int64)
        headers = [torch.empty_like(header) for _ in range(self._world)]
        dist.all_gather(headers, header, group=self._group)
        layouts = [self._layout(h) for h in headers]
        size = max(8 * layout.rows + 4 * layout.numel for _, layout in layouts)
        mine = torch.zeros(size, dtype=torch.uint8)
        if update is not None:
            ids = update.keyed.ids.view(torch.uint8)
            grads = update.grads.to(torch.float32).contiguous().view(torch.uint8)
            mine[: ids.numel()] = ids
            mine[ids.numel() : ids.numel() + grads.numel()] = grads
        gathered = [torch.empty(size, dtype=torch.uint8) for _ in range(self._world)]
        dist.all_gather(gathered, mine, group=self._group)
        parts = []
        for raw, (tables, layout) in zip(gathered, layouts):
            ids = raw[: 8 * layout.rows].clone().view(torch.int64)  # clone: a view as int64 / float32 needs an aligned start
            grads = raw[8 * layout.rows : 8 * layout.rows + 4 * layout.numel].clone().view(torch.float32)
            parts.append(SparseUpdate(KeyedIds(tables, layout.counts, ids), grads, layout.dims))
        return parts

    def _layout(self, header: torch.Tensor) -> tuple[tuple[str, ...], RowLayout]:
        num = len(self._tables)
        indices = [i for i in header[:num].tolist() if i >= 0]
        tables = tuple(self._tables[i] for i in indices)
        return tables, RowLayout(header[num : num + len(indices)].tolist(), [self.dims[t] for t in tables])


def _started(push: Callable[[SparseUpdate], "Future[None]"], merged: SparseUpdate) -> "Future[None]":
    """``push(merged)``, or a future holding the error it raised."""
    try:
        return push(merged)
    except BaseException as error:  # noqa: BLE001 - the step's outcome, told to every rank
        failed: Future = Future()
        failed.set_exception(error)
        return failed


def merge_updates(parts: list[Optional[SparseUpdate]]) -> Optional[SparseUpdate]:
    """Sums several updates into one with unique ids, deterministically; None when they hold no ids.

    The result depends only on ``parts`` and their order (tables sorted by width then name, ids sorted), so
    ranks that merge the same gathered parts send byte-identical requests.
    """
    parts = [p for p in parts if p is not None and p.keyed.ids.numel()]
    if not parts:
        return None
    dims = {name: dim for p in parts for name, dim in zip(p.keyed.tables, p.dims)}
    tables = sorted(dims, key=lambda name: (dims[name], name))  # one block of rows per width
    index = {name: i for i, name in enumerate(tables)}
    table = torch.cat([torch.tensor([index[t] for t in p.keyed.tables], dtype=torch.int64).index_select(0, p.keyed.table_of_ids) for p in parts])
    unique, counts, inverse = unique_by_table(torch.cat([p.keyed.ids for p in parts]), table, len(tables))
    merged = KeyedIds(tuple(tables), tuple(counts.tolist()), unique)
    layout = RowLayout(merged.counts, [dims[t] for t in tables])
    rows = (torch.cumsum(counts, 0) - counts).index_select(0, table) + inverse  # each contribution's row in the merged update
    grads = torch.zeros(layout.numel, dtype=torch.float32)
    by_dim = {block.dim: block for block in layout.blocks}
    position = 0
    for part in parts:
        for block in RowLayout(part.keyed.counts, part.dims).blocks:
            target = by_dim[block.dim]
            target.of(grads).index_add_(0, rows[position + block.first_row : position + block.end_row] - target.first_row, block.of(part.grads))
        position += part.keyed.ids.numel()
    return SparseUpdate(merged, grads, tuple(dims[t] for t in tables))
