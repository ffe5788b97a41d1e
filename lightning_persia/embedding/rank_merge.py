"""One embedding update per step for all trainer ranks, as if one rank had trained on the global batch.

Without merging, every rank pushes the gradient of its own share of the batch and the shards apply each as a
step of their own: N ranks take N optimizer steps on a row that one rank would step once. For SGD that is the
same thing; for Adagrad and Adam it is not (the second step is taken with the state the first one left), so
the model would depend on the number of ranks. And a rank's acknowledgement would cover its own update only,
so a lookup of the next batch could miss another rank's part of the previous one, even at staleness 0.

:class:`RankMerge` makes every rank push the same update: after the backward (where DDP all-reduces the dense
gradients) the ranks all-gather their embedding gradients, and each sums them into the same
``{table: (unique ids, summed rows)}``. Every rank then sends that update under one shared sender id with
the same sequence numbers, so the shards' exactly-once de-duplication (``remote_ps/exactly_once.py``) applies
it once, and answers every rank only after it is applied. So:

- N ranks train the tables like one rank on the global batch, the way DDP trains the dense weights (and the
  way TorchRec's sharded tables, which reduce gradients before the optimizer, behave);
- an acknowledged update is the whole step's update, and the staleness window counts steps of the job, not
  of one rank.

The cost: two all-gathers of the embedding gradients per step (sizes, then the bytes), and every rank uploads
the merged update (its duplicates are answered without being decoded; the shards' ``update_duplicates``
counter counts them). Both run on a thread of their own with a gloo group of their own, so the trainer goes on
to the optimizer step and the next forward as it does without merging. A copy that arrives while the first
is being applied holds a shard handler thread until then: give the shards more ``server_threads`` than there
are ranks. Copies that differ (they never should) are refused with FAILED_PRECONDITION, not dropped.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

Updates = dict[str, tuple[torch.Tensor, torch.Tensor]]


class RankMerge:
    """Sums the ranks' embedding gradients of each step into one update that every rank pushes as ``sender``.

    Every rank submits one update per step, in the same order (as DDP's backward does). Needs an initialised
    default process group; creates a gloo group of its own (a collective: every rank constructs it together).

    Example::

        merge = RankMerge(sender="job-42-merged", dims={"user": 16, "item": 16})
        future = merge.submit(updates, lambda merged: client.update_async(merged, sender=merge.sender))
        future.result()   # this step's merged update is applied on every shard
    """

    def __init__(self, sender: str, dims: dict[str, int], timeout: Optional[timedelta] = None) -> None:
        if not sender:
            raise ValueError("RankMerge needs a sender id shared by every rank")
        if not dims:
            raise ValueError("RankMerge needs the remote tables' dims (there is nothing to merge without a table)")
        self.sender = sender
        self.dims = dict(sorted(dims.items()))
        self._row_bytes = torch.tensor([8 + 4 * d for d in self.dims.values()], dtype=torch.int64)  # int64 id + float32 row
        # The ranks meet here once a step, so the timeout bounds how far apart they may drift (as DDP's does).
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        self._world = dist.get_world_size()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="persia-rank-merge", daemon=True)
        self._thread.start()

    def submit(self, updates: Updates, push: Callable[[Updates], "Future[None]"]) -> "Future[None]":
        """Merges ``updates`` with the other ranks' of the same step, then ``push(merged)``; returns push's outcome."""
        unknown = sorted(set(updates) - set(self.dims))
        if unknown:
            raise ValueError(f"gradients of tables the rank merge was not set up for: {unknown}")
        for name, (ids, grads) in updates.items():
            if ids.dim() != 1 or tuple(grads.shape) != (ids.numel(), self.dims[name]):
                raise ValueError(
                    f"table {name!r}: expected ids [n] and grads [n, {self.dims[name]}], got {tuple(ids.shape)} and {tuple(grads.shape)}"
                )
        done: Future = Future()
        self._queue.put((updates, push, done))
        return done

    def close(self) -> None:
        """Lets the merge thread end after the steps submitted so far (without waiting: another rank may be gone)."""
        self._queue.put(None)

    def _run(self) -> None:
        failure: Optional[BaseException] = None
        while (item := self._queue.get()) is not None:
            updates, push, done = item
            if failure is not None:  # a failed collective leaves the ranks out of step: every later one fails too
                done.set_exception(failure)
                continue
            try:
                parts = self._gather(updates)
            except BaseException as error:  # noqa: BLE001 - handed to the step's future
                failure = error
                done.set_exception(error)
                continue
            try:
                merged = merge_updates(parts)
                if merged:
                    _chain(push(merged), done)
                else:
                    done.set_result(None)
            except BaseException as error:  # noqa: BLE001 - handed to the step's future
                done.set_exception(error)

    def _gather(self, updates: Updates) -> list[Updates]:
        counts = torch.tensor([updates[n][0].numel() if n in updates else 0 for n in self.dims], dtype=torch.int64)
        all_counts = [torch.empty_like(counts) for _ in range(self._world)]
        dist.all_gather(all_counts, counts, group=self._group)
        size = max(int((c * self._row_bytes).sum()) for c in all_counts)
        mine = torch.zeros(size, dtype=torch.uint8)
        offset = 0
        for name, dim in self.dims.items():
            if name in updates:
                ids, grads = updates[name]
                for part in (ids.to(torch.int64), grads.to(torch.float32).reshape(-1)):
                    raw = part.contiguous().view(torch.uint8)
                    mine[offset : offset + raw.numel()] = raw
                    offset += raw.numel()
        gathered = [torch.empty(size, dtype=torch.uint8) for _ in range(self._world)]
        dist.all_gather(gathered, mine, group=self._group)
        return [self._decode(raw, c) for raw, c in zip(gathered, all_counts)]

    def _decode(self, raw: torch.Tensor, counts: torch.Tensor) -> Updates:
        out: Updates = {}
        offset = 0
        for (name, dim), n in zip(self.dims.items(), counts.tolist()):
            if n:  # clone: a view as int64 / float32 needs an aligned start
                ids = raw[offset : offset + 8 * n].clone().view(torch.int64)
                offset += 8 * n
                grads = raw[offset : offset + 4 * n * dim].clone().view(torch.float32).view(n, dim)
                offset += 4 * n * dim
                out[name] = (ids, grads)
        return out


def _chain(source: "Future[None]", target: "Future[None]") -> None:
    def forward(f: Future) -> None:
        error = f.exception()
        if error is None:
            target.set_result(f.result())
        else:
            target.set_exception(error)

    source.add_done_callback(forward)


def merge_updates(parts: list[Updates]) -> Updates:
    """Sums several ``{table: (ids [n], grads [n, dim])}`` into one with unique ids, deterministically.

    The result depends only on ``parts`` and their order (sorted tables, sorted ids), so ranks that merge
    the same gathered parts send byte-identical requests.
    """
    merged: Updates = {}
    for name in sorted({name for part in parts for name in part}):
        ids = torch.cat([part[name][0] for part in parts if name in part])
        grads = torch.cat([part[name][1] for part in parts if name in part])
        unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        summed = torch.zeros((unique.numel(), grads.shape[1]), dtype=grads.dtype).index_add_(0, inverse, grads)
        merged[name] = (unique, summed)
    return merged
