"""``EmbeddingWorkerSettings``: how many embedding-worker processes serve each trainer rank (``PersiaStrategy(embedding_workers=...)``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EmbeddingWorkerSettings:
    """The embedding workers of each rank: processes that do the rank's per-id work with the shards (bucketing and
    encoding ids, the calls with their retries and fencing, decoding rows, encoding and pushing gradients), so that the
    trainer's interpreter does not (``embedding/embedding_worker.py``).

    Example (YAML: ``trainer.strategy.init_args.embedding_workers: {count: 2}``)::

        PersiaStrategy(embedding_workers=EmbeddingWorkerSettings(count=2))

    The workers run on the trainer's machine, started with the rank and stopped with it; rows cross through shared
    memory, and the workers read ids and gradients in the trainer's memory. Workers on other hosts are not
    supported: they would need the rows over the network instead of shared memory.
    """

    count: int = 1
    """Worker processes per rank; ``0`` does the work in the trainer's process, on its threads (the path before
    workers existed). Lookups go to the workers in turn; each update goes to the worker that looked its ids up."""
    start_timeout_s: float = 120.0
    """Longest wait for a worker to start and reach the shards (a fresh interpreter imports torch first)."""
    restarts: int = 3
    """How many times each worker is started again after it dies (killed, out of memory), over the whole run. The new
    worker is sent every call the dead one had not answered: lookups and deduplications again, updates again under
    their first sequence numbers, which the shards apply exactly once, so nothing is lost or applied twice. ``0``, or
    a death past the last restart: the run stops with an error naming the worker."""

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"EmbeddingWorkerSettings: count must be >= 0, got {self.count}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"EmbeddingWorkerSettings: start_timeout_s must be > 0, got {self.start_timeout_s}")
        if self.restarts < 0:
            raise ValueError(f"EmbeddingWorkerSettings: restarts must be >= 0, got {self.restarts}")
