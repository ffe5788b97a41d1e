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

The cost: an all-gather of the embedding gradients per step, and every rank uploads the merged update (its
duplicates are answered without being decoded). The shards' ``update_duplicates`` counter counts them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Updates = dict[str, tuple[torch.Tensor, torch.Tensor]]


class RankMerge:
    """Sums the ranks' embedding gradients of a step into one update that every rank pushes as ``sender``.

    Every rank of ``group`` must call :meth:`merge` once per step, in the same order (as DDP's backward).

    Example (inside an initialised process group)::

        merge = RankMerge(sender="job-42-merged")
        merged = merge(worker_updates)        # identical on every rank
        client.update_async(merged, sender=merge.sender)
    """

    def __init__(self, sender: str, group: Optional[dist.ProcessGroup] = None) -> None:
        if not sender:
            raise ValueError("RankMerge needs a sender id shared by every rank")
        self.sender = sender
        self.group = group

    def __call__(self, updates: Updates) -> Updates:
        """``{table: (ids, grads)}`` of this rank -> the sum over every rank, the same on each."""
        gathered: list[Optional[Updates]] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, updates, group=self.group)
        return merge_updates([g for g in gathered if g])


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
