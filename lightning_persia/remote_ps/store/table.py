"""One embedding table on one shard: ids, rows, optimizer state and access statistics, kept row-aligned.

Row arrays are allocated for twice the rows in use (up to the capacity) and never written beyond the
rows in use, so the untouched part costs address space only: resident memory follows the rows stored.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from lightning_persia.ops.hashing import name_hash
from lightning_persia.remote_ps.store import eviction
from lightning_persia.remote_ps.store.index import IdIndex
from lightning_persia.remote_ps.store.initializers import initial_rows
from lightning_persia.remote_ps.store.optimizers import make_rule
from lightning_persia.remote_ps.table_config import TableConfig

_MIN_ROWS = 1024


@dataclass
class TableSnapshot:
    """The live rows of a table, as saved in a checkpoint."""

    config: TableConfig
    step: int
    ids: torch.Tensor
    weights: torch.Tensor
    state: torch.Tensor
    access: torch.Tensor


class Table:
    """Thread-safe store of one table's rows on one shard."""

    def __init__(self, config: TableConfig, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.rule = make_rule(config.optimizer, config.dim)
        self._lock = threading.Lock()
        self._admission = torch.Generator().manual_seed((seed ^ name_hash(config.name)) & ((1 << 63) - 1))
        self._index = IdIndex()
        self._size = 0
        self._free = torch.empty(0, dtype=torch.int64)
        self._step = 0
        self._counters = dict(lookups=0, lookup_rows=0, inserted=0, evicted=0, not_admitted=0, updates=0, update_rows=0, dropped_update_rows=0)
        self._allocate_arrays(_MIN_ROWS)

    # ---- reads and writes ------------------------------------------------------------------------

    def lookup(self, ids: torch.Tensor, train: bool) -> torch.Tensor:
        """Rows of ``ids`` as float32 ``[n, dim]``; training lookups admit unseen ids."""
        with self._lock:
            rows = self._index.find(ids, self._ids)
            missing = rows < 0
            out = self._weights.index_select(0, rows.clamp(min=0))
            self._counters["lookups"] += 1
            self._counters["lookup_rows"] += ids.numel()
            if train:
                self._step += 1
                eviction.touch(self._access, rows[~missing], self.config.eviction, self._step)
            if bool(missing.any()):
                out[missing] = self._fill_missing(ids[missing], train)
            return out

    def update(self, ids: torch.Tensor, grads: torch.Tensor) -> int:
        """Applies the optimizer to the rows of ``ids``; returns how many rows were present and updated."""
        unique, inverse = torch.unique(ids, return_inverse=True)
        if unique.numel() < ids.numel():
            grads = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)
            ids = unique
        with self._lock:
            rows = self._index.find(ids, self._ids)
            present = rows >= 0
            if not bool(present.all()):
                self._counters["dropped_update_rows"] += int((~present).sum())
                rows, grads = rows[present], grads[present]
            weights, state = self._weights[rows], self._state[rows]
            self.rule.apply(weights, state, grads)
            if self.config.weight_bound is not None:
                weights.clamp_(-self.config.weight_bound, self.config.weight_bound)
            self._weights[rows] = weights
            self._state[rows] = state
            self._counters["updates"] += 1
            self._counters["update_rows"] += rows.numel()
            return rows.numel()

    # ---- snapshots ---------------------------------------------------------------------------------

    def snapshot(self) -> TableSnapshot:
        """Copies of the live rows (consistent: taken under the table's lock)."""
        with self._lock:
            live = torch.nonzero(self._access[: self._size] != eviction.FREE).squeeze(1)
            return TableSnapshot(
                config=self.config,
                step=self._step,
                ids=self._ids[live].clone(),
                weights=self._weights[live].clone(),
                state=self._state[live].clone(),
                access=self._access[live].clone(),
            )

    @classmethod
    def from_snapshot(cls, snapshot: TableSnapshot, seed: int) -> "Table":
        """A table holding exactly the rows of ``snapshot``."""
        table = cls(snapshot.config, seed)
        n = snapshot.ids.numel()
        table._allocate_arrays(max(_MIN_ROWS, n))
        table._size = n
        table._ids[:n] = snapshot.ids
        table._weights[:n] = snapshot.weights
        table._state[:n] = snapshot.state
        table._access[:n] = snapshot.access
        table._step = snapshot.step
        table._index.rebuild(torch.arange(n), table._ids)
        return table

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            rows = self._size - self._free.numel()
            row_bytes = self._ids.element_size() + self._access.element_size() + 4 * (self.config.dim + self.rule.state_width)
            return dict(
                self._counters,
                rows=rows,
                capacity=self.config.capacity,
                dim=self.config.dim,
                step=self._step,
                bytes=rows * row_bytes + self._index.nbytes,
            )

    # ---- internals ---------------------------------------------------------------------------------

    def _fill_missing(self, ids: torch.Tensor, train: bool) -> torch.Tensor:
        unique, inverse = torch.unique(ids, return_inverse=True)
        initial = initial_rows(self.config.init, self.seed, self.config.name, unique, self.config.dim)
        if train:
            self._admit(unique, initial)
        return initial[inverse]

    def _admit(self, ids: torch.Tensor, initial: torch.Tensor) -> None:
        p = self.config.admit_probability
        if p < 1.0:
            keep = torch.rand(ids.numel(), generator=self._admission) < p
            self._counters["not_admitted"] += int((~keep).sum())
            ids, initial = ids[keep], initial[keep]
        if ids.numel() > self.config.capacity:
            self._counters["not_admitted"] += ids.numel() - self.config.capacity
            ids, initial = ids[: self.config.capacity], initial[: self.config.capacity]
        rows = self._take_rows(ids.numel())
        self._ids[rows] = ids
        self._weights[rows] = initial
        self._state[rows] = self.rule.initial_state(ids.numel())
        self._access[rows] = eviction.first_access(self.config.eviction, self._step)
        self._index.insert(ids, rows, self._ids)
        self._counters["inserted"] += ids.numel()

    def _take_rows(self, n: int) -> torch.Tensor:
        room = self.config.capacity - self._size + self._free.numel()
        if n > room:
            self._evict(eviction.bulk_size(n - room, self.config.capacity))
        reused = self._free[: n]
        self._free = self._free[reused.numel() :]
        appended = n - reused.numel()
        if self._size + appended > self._ids.numel():
            self._allocate_arrays(min(self.config.capacity, max(2 * self._ids.numel(), self._size + appended)))
        fresh = torch.arange(self._size, self._size + appended)
        self._size += appended
        return torch.cat([reused, fresh])

    def _evict(self, count: int) -> None:
        victims = eviction.select_victims(self._access[: self._size], count)
        self._index.remove(self._ids[victims], self._ids)
        self._access[victims] = eviction.FREE
        self._free = torch.cat([self._free, victims])
        self._counters["evicted"] += victims.numel()
        if self._index.tombstone_ratio() > 0.25:
            self._index.rebuild(torch.nonzero(self._access[: self._size] != eviction.FREE).squeeze(1), self._ids)

    def _allocate_arrays(self, rows: int) -> None:
        dim, width, used = self.config.dim, self.rule.state_width, self._size
        ids = torch.empty(rows, dtype=torch.int64)
        weights = torch.empty(rows, dim, dtype=torch.float32)
        state = torch.empty(rows, width, dtype=torch.float32)
        access = torch.empty(rows, dtype=torch.int32)
        if used:
            ids[:used], weights[:used], state[:used], access[:used] = self._ids[:used], self._weights[:used], self._state[:used], self._access[:used]
        self._ids, self._weights, self._state, self._access = ids, weights, state, access
