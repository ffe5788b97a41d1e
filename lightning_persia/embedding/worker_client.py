"""The trainer's side of its embedding workers: the pipeline's :class:`~lightning_persia.embedding.shard_client.ShardClient`,
with the per-id work done in worker processes (``embedding/embedding_worker.py``).

Per module and step the trainer copies the module's ids into a shared buffer and the worker deduplicates them into
two more (:meth:`EmbeddingWorkers.deduplicate`, the plan's unique ids and inverse indices, which the trainer then reads
in place). Per lookup the trainer copies the step's unique ids into a shared buffer, names a shared buffer for the rows and
sends one small message; the rows it then reads are that buffer, written by the worker (on a GPU: pinned, so they
go up in one copy). Per update it copies the gradient into a shared buffer and sends one message. Nothing here
loops, encodes, decodes, deduplicates or sorts over ids: that happens in the worker, and :meth:`shard` only marks
the ids for it.

A worker that dies fails every call in flight or to come with an :class:`EmbeddingWorkerError` naming it, so the
run stops with that error (the embedding pipeline's waits raise it; nothing waits forever).
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_persia.embedding.embedding_worker import CLOSE, DEDUP, DONE, DROP, LOOKUP, READY, UPDATE, WorkerSpec
from lightning_persia.embedding.shared_buffers import SharedBuffers, SharedTensor
from lightning_persia.ops.keyed_ids import KeyedIds, RowLayout
from lightning_persia.remote_ps.protocol import SHARD_PROCESS_ENV
from lightning_persia.remote_ps.client.retry import RetryPolicy

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # a worker asked to close that has not ended by then is killed


class EmbeddingWorkerError(RuntimeError):
    """An embedding worker died or could not start; the message names it (its rank, index and process id)."""


class WorkerIds:
    """Ids to look up through the workers (what :meth:`EmbeddingWorkers.shard` returns): the worker buckets them.

    After a training lookup, ``worker`` and ``token`` say which worker kept their bucketing for the update.
    """

    __slots__ = ("keyed", "worker", "token")

    def __init__(self, keyed: KeyedIds) -> None:
        self.keyed = keyed
        self.worker: Optional[int] = None
        self.token: Optional[int] = None


def defer_sharding(keyed: KeyedIds) -> WorkerIds:
    """The sharder of :class:`EmbeddingWorkers` (picklable, for DataLoader workers): nothing to do, the worker shards."""
    return WorkerIds(keyed)


class _Process:
    def __init__(self, index: int, name: str, process: subprocess.Popen, connection: Connection,
                 incarnations: Sequence[Optional[str]]) -> None:
        self.index, self.name, self.process, self.connection = index, name, process, connection
        self.sent_incarnations = tuple(incarnations)
        self.send_lock = threading.Lock()  # the prefetch, push, rank-merge and trainer threads all send
        self.failure: Optional[EmbeddingWorkerError] = None

    def describe(self) -> str:
        return f"{self.name} (pid {self.process.pid})"


class EmbeddingWorkers:
    """``count`` embedding-worker processes of one rank, started now, reaching the shards at ``addresses``.

    Args:
        count: worker processes.
        addresses, token, tls_root_cert: the shards and how to reach them (as the trainer's ``PSClient``).
        dims: width of every remote table.
        retry: the trainer client's retry policy (the workers' calls retry alike).
        incarnations: callable giving the shards' incarnations the trainer accepts (its ``PSClient.incarnations``);
            a change reaches the workers with the next call, so they are fenced as the trainer is.
        rank: the trainer's global rank (in names).
        start_timeout_s: longest wait for each worker to start.
        timeout_s: longest wait for a worker's deduplication (a worker that does not answer in time fails the plan).
        on_calls: told of the shard calls the workers made, ``[(method path, status code name, seconds)]``, as they
            answer (the trainer's metrics count them: ``ClientRpcMetrics.record``).

    Example::

        workers = EmbeddingWorkers(1, client.addresses, {"user": 16}, client.retry, lambda: client.incarnations)
        pipeline = EmbeddingPipeline(workers, staleness=4, wire_dtype="fp16", device=torch.device("cpu"))
        ...
        workers.close()
    """

    def __init__(
        self, count: int, addresses: Sequence[str], dims: dict[str, int], retry: RetryPolicy,
        incarnations: Callable[[], Sequence[Optional[str]]], *, token: Optional[str] = None, tls_root_cert: Optional[str] = None,
        rank: int = 0, start_timeout_s: float = 120.0, timeout_s: float = 300.0,
        on_calls: Optional[Callable[[list[tuple[str, str, float]]], None]] = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"EmbeddingWorkers: count must be >= 1, got {count}")
        self._dims = dict(dims)
        self._incarnations = incarnations
        self._timeout_s = timeout_s
        self._on_calls = on_calls
        self._workers: list[_Process] = []
        self._buffers = SharedBuffers(prefix=f"persia-r{rank}", on_drop=self._drop)
        self._pending: dict[int, tuple[Future, Any, int]] = {}  # request -> (future, its result, worker)
        self._lock = threading.Lock()
        self._requests = itertools.count()
        self._turn = itertools.count()
        self._closed = False
        try:
            for index in range(count):
                name = f"embedding worker {index} of rank {rank}"
                spec = WorkerSpec(tuple(addresses), self._dims, retry, tuple(incarnations()), token, tls_root_cert, on_calls is not None)
                self._workers.append(_Process(index, name, *_start(spec), spec.incarnations))
            for worker in self._workers:
                self._await_ready(worker, start_timeout_s)
        except BaseException:
            self._stop_processes()
            for worker in self._workers:
                worker.connection.close()
            self._buffers.close()
            raise
        self._reader = threading.Thread(target=self._read, name="persia-worker-replies", daemon=True)
        self._reader.start()
        atexit.register(self.close)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (benchmarks read their CPU time)."""
        return [w.process.pid for w in self._workers]

    def deduplicate(self, keyed: KeyedIds) -> tuple[KeyedIds, torch.Tensor]:
        """``ops.dedup.keyed_unique(keyed)``, computed by a worker into shared buffers (the planning's ``Deduplicate``)."""
        ids = self._ids_buffer(keyed)
        unique = self._buffers.take(keyed.ids.numel(), torch.int64)
        inverse = self._buffers.take(keyed.ids.numel(), torch.int64)
        worker = self._workers[next(self._turn) % len(self._workers)]
        request = next(self._requests)
        future = self._send(worker, request, None, ids, (DEDUP, request, keyed.tables, keyed.counts, _ref(ids), _ref(unique), _ref(inverse)))
        try:
            counts = future.result(self._timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"{worker.describe()} did not deduplicate {keyed.ids.numel()} ids within {self._timeout_s:.0f} s") from None
        return KeyedIds(keyed.tables, counts, unique.tensor[: sum(counts)]), inverse.tensor

    # ---- ShardClient -----------------------------------------------------------------------------------

    def shard(self, keyed: KeyedIds) -> WorkerIds:
        return WorkerIds(keyed)

    def sharder(self) -> Callable[[KeyedIds], WorkerIds]:
        return defer_sharding

    def lookup_sharded_async(self, sharded: Any, *, train: bool, wire_dtype: str = "fp16") -> "Future[torch.Tensor]":
        ids = _worker_ids(sharded)
        keyed = ids.keyed
        unknown = [t for t in keyed.tables if t not in self._dims]
        if unknown:
            raise ValueError(f"EmbeddingWorkers: tables {unknown} are not among the remote tables {sorted(self._dims)}")
        rows = self._buffers.take(RowLayout(keyed.counts, [self._dims[t] for t in keyed.tables]).numel, torch.float32)
        id_buffer = self._ids_buffer(keyed)
        worker = self._workers[next(self._turn) % len(self._workers)]
        request = next(self._requests)
        if train:
            ids.worker, ids.token = worker.index, request
        return self._send(worker, request, rows.tensor, id_buffer, (
            LOOKUP, request, ids.token, keyed.tables, keyed.counts, _ref(id_buffer), _ref(rows), train, wire_dtype))

    def update_sharded_async(
        self, sharded: Any, grads: torch.Tensor, dims: Sequence[int], *, wire_dtype: str = "fp16", sender: Optional[str] = None,
    ) -> "Future[None]":
        ids = _worker_ids(sharded)
        keyed = ids.keyed
        layout = RowLayout(keyed.counts, dims)
        if grads.dim() != 1 or grads.numel() != layout.numel or not grads.is_floating_point():
            raise ValueError(f"grads must be a flat float tensor of {layout.numel} values (counts {list(keyed.counts)} x dims "
                             f"{list(dims)}), got {grads.dtype} {tuple(grads.shape)}")
        values = self._buffers.take(layout.numel, torch.float32)
        values.tensor.copy_(grads.detach())
        # Updates under a shared sender (the ranks' merged update) carry sequence numbers that must match across ranks:
        # they all go through worker 0, whose client numbers them in the same order on every rank.
        token = ids.token if sender is None else None
        worker = self._workers[ids.worker if token is not None and ids.worker is not None else 0]
        id_buffer = self._ids_buffer(keyed)
        request = next(self._requests)
        return self._send(worker, request, None, (id_buffer, values), (
            UPDATE, request, token, keyed.tables, keyed.counts, _ref(id_buffer), _ref(values), tuple(dims), wire_dtype, sender))

    # ---- life --------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the workers (after the calls in flight: their futures fail if a worker is stopped first)."""
        atexit.unregister(self.close)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_processes()
        self._reader.join(STOP_TIMEOUT_S)  # it ends once every worker's pipe is closed at the other end
        for worker in self._workers:
            worker.connection.close()
        self._fail_pending(lambda worker: EmbeddingWorkerError(f"{self._workers[worker].describe()} was stopped with the call in flight"))
        self._buffers.close()

    # ---- internals --------------------------------------------------------------------------------------

    def _ids_buffer(self, keyed: KeyedIds) -> SharedTensor:
        """``keyed``'s ids in a shared buffer: where they are when a worker wrote them (a one-module step's unique
        ids), else a copy."""
        located = self._buffers.locate(keyed.ids) if keyed.ids.dtype == torch.int64 else None
        if located is not None:
            return located
        buffer = self._buffers.take(keyed.ids.numel(), torch.int64)
        buffer.tensor.copy_(keyed.ids)
        return buffer

    def _send(self, worker: _Process, request: int, result: Any, keep: Any, message: tuple) -> Future:
        future: Future = Future()
        incarnations = tuple(self._incarnations())
        with worker.send_lock:
            if worker.failure is not None:
                future.set_exception(worker.failure)
                return future
            with self._lock:
                self._pending[request] = (future, (result, keep), worker.index)
            fence = incarnations if incarnations != worker.sent_incarnations else None
            try:
                worker.connection.send((*message, fence))
            except (BrokenPipeError, OSError):
                with self._lock:
                    self._pending.pop(request, None)
                future.set_exception(self._died(worker))
                return future
            worker.sent_incarnations = incarnations
        return future

    def _read(self) -> None:
        connections = {w.connection: w for w in self._workers}
        while connections:
            for connection in wait(list(connections)):
                worker = connections[connection]
                try:
                    kind, request, payload, calls = connection.recv()
                except (EOFError, OSError):
                    del connections[connection]
                    if not self._closed:
                        error = self._died(worker)
                        self._fail_pending(lambda index: error if index == worker.index else None)
                    continue
                if calls and self._on_calls is not None:
                    self._on_calls(calls)
                with self._lock:
                    entry = self._pending.pop(request, None)
                if entry is None:
                    continue
                future, (result, _), _ = entry
                if kind == DONE:
                    future.set_result(result if result is not None else payload)
                else:
                    future.set_exception(payload)

    def _died(self, worker: _Process) -> EmbeddingWorkerError:
        if worker.failure is None:
            try:
                code: Optional[int] = worker.process.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
            how = "is not answering" if code is None else f"exited with code {code}"
            worker.failure = EmbeddingWorkerError(
                f"{worker.describe()} {how}; the embedding lookups and updates it had in flight are lost, so the run stops "
                f"(restart it from the last checkpoint)")
            log.error("%s", worker.failure)
        return worker.failure

    def _fail_pending(self, error_of: Callable[[int], Optional[BaseException]]) -> None:
        with self._lock:
            failing = [(r, e) for r, e in self._pending.items() if error_of(e[2]) is not None]
            for request, _ in failing:
                del self._pending[request]
        for _, (future, _, index) in failing:
            future.set_exception(error_of(index))

    def _await_ready(self, worker: _Process, timeout_s: float) -> None:
        if not worker.connection.poll(timeout_s):
            raise EmbeddingWorkerError(f"{worker.describe()} did not start within {timeout_s:.0f} s")
        try:
            kind, *payload = worker.connection.recv()
        except (EOFError, OSError):
            raise self._died(worker) from None
        if kind != READY:
            error = payload[0]
            raise EmbeddingWorkerError(f"{worker.describe()} could not reach the shards: {type(error).__name__}: {error}") from error

    def _drop(self, segment: str) -> None:
        for worker in self._workers:
            with worker.send_lock:
                if worker.failure is None:
                    try:
                        worker.connection.send((DROP, segment))
                    except (BrokenPipeError, OSError):
                        pass

    def _stop_processes(self) -> None:
        for worker in self._workers:
            try:
                with worker.send_lock:
                    worker.connection.send((CLOSE,))
            except (BrokenPipeError, OSError):
                pass
        for worker in self._workers:
            try:
                worker.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s of close(); killing it", worker.describe(), STOP_TIMEOUT_S)
                worker.process.kill()
                worker.process.wait()


def _start(spec: WorkerSpec) -> tuple[subprocess.Popen, Connection]:
    """Starts a worker in a fresh interpreter (``python -m``: neither the trainer's script nor its CUDA context or
    threads come along), connected by a socket pair; sends it ``spec``."""
    mine, theirs = socket.socketpair()
    # Without the strategy (Lightning, TorchRec): a worker then starts in a third of the time (1.5 s of CPU, not 4.5).
    environment = {**os.environ, SHARD_PROCESS_ENV: "1"}
    try:
        process = subprocess.Popen([sys.executable, "-m", "lightning_persia.embedding.embedding_worker", str(theirs.fileno())],
                                   pass_fds=[theirs.fileno()], env=environment)
    finally:
        theirs.close()
    connection = Connection(mine.detach())
    connection.send(spec)
    return process, connection


def _ref(buffer: SharedTensor) -> tuple[str, int, int]:
    return buffer.segment, buffer.offset, buffer.tensor.numel()


def _worker_ids(sharded: Any) -> WorkerIds:
    if isinstance(sharded, WorkerIds):
        return sharded
    if isinstance(sharded, KeyedIds):
        return WorkerIds(sharded)
    raise TypeError(f"EmbeddingWorkers: expected the ids as EmbeddingWorkers.shard() gives them, got {type(sharded).__name__}")
