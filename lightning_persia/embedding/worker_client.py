"""The trainer's side of its embedding workers: the pipeline's :class:`~lightning_persia.embedding.shard_client.ShardClient`,
with the per-id work done in worker processes (``embedding/embedding_worker.py``).

Per module and step the trainer names the module's ids and the worker deduplicates them into two shared buffers
(:meth:`EmbeddingWorkers.deduplicate`, the plan's unique ids and inverse indices, which the trainer then reads in
place). Per lookup the trainer names the step's unique ids (already in a shared buffer) and a shared buffer for the
rows, in one small message; the rows it then reads are that buffer, written by the worker (on a GPU: pinned, so
they go up in one copy). Per update it names the gradient and sends one message. Ids and gradients the worker reads
where they are in the trainer's memory (``embedding/process_memory.py``), or, where the kernel does not let it,
from shared buffers the trainer copies them into. Nothing here loops, encodes, decodes, deduplicates or sorts over
ids: that happens in the worker, and :meth:`shard` only marks the ids for it.

A worker that dies is started again, up to ``restarts`` times, and sent every call it had not answered: a lookup
or deduplication again (the same buffers: the trainer holds them until answered), an update again under the same
sequence numbers (the trainer numbers each sender's updates), which the shards apply exactly once whether or not the
dead worker's attempt reached them. Past ``restarts``, or when the new worker cannot start, every call in flight or
to come fails with an :class:`EmbeddingWorkerError` naming it, so the run stops with that error (the embedding
pipeline's waits raise it; nothing waits forever).
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
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from lightning_persia.embedding.embedding_worker import CLOSE, DEDUP, DEDUP_FEATURES, DONE, DROP, LOOKUP, READY, UPDATE, WorkerSpec
from lightning_persia.embedding.shared_buffers import SharedBuffers, SharedTensor
from lightning_persia.ops.keyed_ids import KeyedIds
from lightning_persia.remote_ps.protocol import SHARD_PROCESS_ENV
from lightning_persia.remote_ps.client.ps_client import SEQS_PER_UPDATE
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
    def __init__(self, index: int, name: str, spec: WorkerSpec) -> None:
        self.index, self.name, self.spec = index, name, spec
        self.process, self.connection = _start(spec)
        self.sent_incarnations = spec.incarnations
        self.send_lock = threading.Lock()  # the prefetch, push, rank-merge and trainer threads all send
        self.failure: Optional[EmbeddingWorkerError] = None
        self.restarts = 0
        self.reader: Optional[threading.Thread] = None
        self.reads_trainer_memory = False  # it reads ids and gradients in the trainer's memory (process_memory.py)

    def describe(self) -> str:
        return f"{self.name} (pid {self.process.pid})"


class WorkerDeduplication:
    """The planning's deduplication done by ``workers`` (``planning.CountingDeduplicate``): a collection's ids counted
    per table by the worker too, so that the trainer's prefetch thread makes no pass over the batch's lengths (a
    cumulative sum of 426k of them a step at batch 16,384)."""

    def __init__(self, workers: "EmbeddingWorkers") -> None:
        self._workers = workers

    def __call__(self, keyed: KeyedIds) -> tuple[KeyedIds, torch.Tensor]:
        return self._workers.deduplicate(keyed)

    def by_features(self, tables: tuple[str, ...], feature_tables: tuple[int, ...], stride: int, ids: torch.Tensor,
                    lengths: torch.Tensor) -> Optional[tuple[KeyedIds, torch.Tensor, tuple[int, ...]]]:
        return self._workers.deduplicate_features(tables, feature_tables, stride, ids, lengths)


class _Call:
    """A call sent to a worker and not yet answered: what to send again to a worker started in its place."""

    __slots__ = ("future", "result", "keep", "worker", "message")

    def __init__(self, future: Future, result: Any, keep: Any, worker: int, message: tuple) -> None:
        self.future, self.result, self.keep, self.worker, self.message = future, result, keep, worker, message


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
        restarts: how many times each worker is started again after it dies, its unanswered calls sent to the new
            one (0: a death stops the run with an error naming the worker).

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
        on_calls: Optional[Callable[[list[tuple[str, str, float]]], None]] = None, restarts: int = 0,
    ) -> None:
        if count < 1:
            raise ValueError(f"EmbeddingWorkers: count must be >= 1, got {count}")
        if restarts < 0:
            raise ValueError(f"EmbeddingWorkers: restarts must be >= 0, got {restarts}")
        self._dims = dict(dims)
        self._incarnations = incarnations
        self._timeout_s = timeout_s
        self._start_timeout_s = start_timeout_s
        self._on_calls = on_calls
        self._restarts = restarts
        self._workers: list[_Process] = []
        self._buffers = SharedBuffers(prefix=f"persia-r{rank}", on_drop=self._drop)
        self._pending: dict[int, _Call] = {}
        self._lock = threading.Lock()
        self._requests = itertools.count()
        self._turn = itertools.count()
        # Each sender's updates are numbered here, not by a worker's client, so that one sent again by a worker started
        # in place of a dead one carries the numbers of the first attempt (the shards apply it once).
        self._update_numbers: dict[str, Iterator[int]] = {}
        self._closed = False
        run = uuid.uuid4().hex[:12]
        self._probe = torch.frombuffer(bytearray(os.urandom(16)), dtype=torch.uint8)  # what a worker reads to tell it may
        trainer = (os.getpid(), self._probe.data_ptr(), bytes(self._probe.tolist()))
        try:
            for index in range(count):
                spec = WorkerSpec(tuple(addresses), self._dims, retry, tuple(incarnations()), token, tls_root_cert,
                                  on_calls is not None, client_id=f"{socket.gethostname()}-{os.getpid()}-{run}-worker{index}",
                                  trainer=trainer)
                self._workers.append(_Process(index, f"embedding worker {index} of rank {rank}", spec))
            for worker in self._workers:
                self._await_ready(worker, start_timeout_s)
        except BaseException:
            self._stop_processes()
            for worker in self._workers:
                worker.connection.close()
            self._buffers.close()
            raise
        for worker in self._workers:  # one reader each, blocked in recv: no selector to build for every reply
            worker.reader = threading.Thread(target=self._read, args=(worker,), name=f"persia-worker{worker.index}-replies", daemon=True)
            worker.reader.start()
        atexit.register(self.close)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (benchmarks read their CPU time)."""
        return [w.process.pid for w in self._workers]

    @property
    def read_trainer_memory(self) -> list[bool]:
        """Per worker, whether it reads ids and gradients in the trainer's memory (else they are copied to it)."""
        return [w.reads_trainer_memory for w in self._workers]

    @property
    def restarted(self) -> int:
        """How many times a worker was started again after it died."""
        return sum(w.restarts for w in self._workers)

    def deduplicate(self, keyed: KeyedIds) -> tuple[KeyedIds, torch.Tensor]:
        """``ops.dedup.keyed_unique(keyed)``, computed by a worker into shared buffers (the planning's ``Deduplicate``)."""
        worker = self._workers[next(self._turn) % len(self._workers)]
        ids, ids_ref = self._ids_buffer(keyed, worker)
        unique = self._buffers.take(keyed.ids.numel(), torch.int64)
        inverse = self._buffers.take(keyed.ids.numel(), torch.int64)
        request = next(self._requests)
        future = self._send(worker, request, None, (ids, unique, inverse),
                            (DEDUP, request, keyed.tables, keyed.counts, ids_ref, _ref(unique), _ref(inverse)))
        try:
            counts = future.result(self._timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"{worker.describe()} did not deduplicate {keyed.ids.numel()} ids within {self._timeout_s:.0f} s") from None
        return KeyedIds(keyed.tables, counts, unique.tensor[: sum(counts)]), inverse.tensor

    def deduplicate_features(self, tables: tuple[str, ...], feature_tables: tuple[int, ...], stride: int, ids: torch.Tensor,
                             lengths: torch.Tensor) -> Optional[tuple[KeyedIds, torch.Tensor, tuple[int, ...]]]:
        """A collection's ids deduplicated by a worker that also counts them per table from the batch's ``lengths``
        (``stride`` a feature, ``feature_tables[f]`` the table of feature ``f``; int32 or int64), both read in the trainer's memory:
        the unique ids, inverse indices and ids per table. None where the worker cannot read them in place (the
        planning then counts them and calls :meth:`deduplicate`)."""
        worker = self._workers[next(self._turn) % len(self._workers)]
        if not (worker.reads_trainer_memory and _readable_in_place(ids, torch.int64)
                and lengths.dtype in (torch.int32, torch.int64) and _readable_in_place(lengths, lengths.dtype)):
            return None
        unique = self._buffers.take(ids.numel(), torch.int64)
        inverse = self._buffers.take(ids.numel(), torch.int64)
        request = next(self._requests)
        future = self._send(worker, request, None, (ids, lengths, unique, inverse), (
            DEDUP_FEATURES, request, tuple(tables), tuple(feature_tables), stride, (None, ids.data_ptr(), ids.numel()),
            (None, lengths.data_ptr(), lengths.numel()), str(lengths.dtype).removeprefix("torch."), _ref(unique), _ref(inverse)))
        try:
            counts, id_counts = future.result(self._timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"{worker.describe()} did not deduplicate {ids.numel()} ids within {self._timeout_s:.0f} s") from None
        return KeyedIds(tuple(tables), counts, unique.tensor[: sum(counts)]), inverse.tensor, id_counts

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
        rows = self._buffers.take(_numel(keyed.counts, [self._dims[t] for t in keyed.tables]), torch.float32)
        worker = self._workers[next(self._turn) % len(self._workers)]
        id_buffer, ids_ref = self._ids_buffer(keyed, worker)
        request = next(self._requests)
        if train:
            ids.worker, ids.token = worker.index, request
        return self._send(worker, request, rows.tensor, id_buffer, (
            LOOKUP, request, ids.token, keyed.tables, keyed.counts, ids_ref, _ref(rows), train, wire_dtype))

    def update_sharded_async(
        self, sharded: Any, grads: torch.Tensor, dims: Sequence[int], *, wire_dtype: str = "fp16", sender: Optional[str] = None,
    ) -> "Future[None]":
        ids = _worker_ids(sharded)
        keyed = ids.keyed
        numel = _numel(keyed.counts, dims)
        if grads.dim() != 1 or grads.numel() != numel or not grads.is_floating_point():
            raise ValueError(f"grads must be a flat float tensor of {numel} values (counts {list(keyed.counts)} x dims "
                             f"{list(dims)}), got {grads.dtype} {tuple(grads.shape)}")
        # Updates under a given sender (rank 0's push of the ranks' merged update) all go through worker 0, numbered
        # here in the order they are pushed.
        token = ids.token if sender is None else None
        worker = self._workers[ids.worker if token is not None and ids.worker is not None else 0]
        values = grads.detach()
        if worker.reads_trainer_memory and _readable_in_place(values, torch.float32):
            values_ref = (None, values.data_ptr(), values.numel())
        else:
            shared = self._buffers.take(numel, torch.float32)
            shared.tensor.copy_(values)
            values, values_ref = shared.tensor, _ref(shared)
        id_buffer, ids_ref = self._ids_buffer(keyed, worker)
        request = next(self._requests)
        with worker.send_lock:  # numbered in the order sent, so that a shard sees a sender's numbers rise
            numbers = self._update_numbers.setdefault(sender or worker.spec.client_id, itertools.count(1))
            return self._send_locked(worker, request, None, (id_buffer, values), (
                UPDATE, request, token, keyed.tables, keyed.counts, ids_ref, values_ref, tuple(dims), wire_dtype, sender,
                next(numbers) * SEQS_PER_UPDATE))

    # ---- life --------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the workers (after the calls in flight: their futures fail if a worker is stopped first)."""
        atexit.unregister(self.close)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_processes()
        for worker in self._workers:
            if worker.reader is not None:
                worker.reader.join(STOP_TIMEOUT_S)  # it ends once its worker's pipe is closed at the other end
            worker.connection.close()
        self._fail_pending(lambda worker: EmbeddingWorkerError(f"{self._workers[worker].describe()} was stopped with the call in flight"))
        self._buffers.close()

    # ---- internals --------------------------------------------------------------------------------------

    def _ids_buffer(self, keyed: KeyedIds, worker: _Process) -> tuple[Any, tuple[Optional[str], int, int]]:
        """``keyed``'s ids where ``worker`` reads them, and their reference in its message: in a shared buffer when a
        worker wrote them there (a one-module step's unique ids); else where they are, when the worker reads the
        trainer's memory; else copied into a shared buffer. The first is what to hold until the worker answers."""
        located = self._buffers.locate(keyed.ids) if keyed.ids.dtype == torch.int64 else None
        if located is not None:
            return located, _ref(located)
        if worker.reads_trainer_memory and _readable_in_place(keyed.ids, torch.int64):
            return keyed.ids, (None, keyed.ids.data_ptr(), keyed.ids.numel())
        buffer = self._buffers.take(keyed.ids.numel(), torch.int64)
        buffer.tensor.copy_(keyed.ids)
        return buffer, _ref(buffer)

    def _send(self, worker: _Process, request: int, result: Any, keep: Any, message: tuple) -> Future:
        with worker.send_lock:
            return self._send_locked(worker, request, result, keep, message)

    def _send_locked(self, worker: _Process, request: int, result: Any, keep: Any, message: tuple) -> Future:
        """Sends ``message`` (under ``worker.send_lock``); the future of its answer. ``keep``: what the worker reads,
        held until it answers (and sent again if it dies first)."""
        future: Future = Future()
        if worker.failure is not None:
            future.set_exception(worker.failure)
            return future
        call = _Call(future, result, keep, worker.index, message)
        with self._lock:
            self._pending[request] = call
        if not self._transmit(worker, call) and not self._restarts:
            with self._lock:
                self._pending.pop(request, None)
            future.set_exception(self._died(worker))
        # Otherwise the call stays pending: the worker's reader sees the death and sends it to the worker started next.
        return future

    def _transmit(self, worker: _Process, call: _Call) -> bool:
        """Sends ``call`` (under ``worker.send_lock``) with the incarnations the worker has not heard of; False if
        the pipe is broken."""
        incarnations = tuple(self._incarnations())
        fence = incarnations if incarnations != worker.sent_incarnations else None
        try:
            worker.connection.send((*call.message, fence))
        except (BrokenPipeError, OSError):
            return False
        worker.sent_incarnations = incarnations
        return True

    def _read(self, worker: _Process) -> None:
        while True:
            try:
                kind, request, payload, calls = worker.connection.recv()
            except (EOFError, OSError):
                if self._closed or not self._restart(worker):
                    return
                continue
            if calls and self._on_calls is not None:
                self._on_calls(calls)
            with self._lock:
                call = self._pending.pop(request, None)
            if call is None:
                continue
            if kind == DONE:
                call.future.set_result(call.result if call.result is not None else payload)
            else:
                call.future.set_exception(payload)

    def _restart(self, worker: _Process) -> bool:
        """After ``worker`` died: starts another in its place and sends it the calls the dead one had not answered;
        False (every such call failed with an error naming the worker) when its restarts are spent or it cannot start."""
        with worker.send_lock:
            error = self._died(worker, final=worker.restarts >= self._restarts)
            if worker.restarts < self._restarts and not self._closed:
                worker.restarts += 1
                worker.connection.close()
                try:
                    worker.spec = replace(worker.spec, incarnations=tuple(self._incarnations()))
                    worker.process, worker.connection = _start(worker.spec)
                    worker.sent_incarnations = worker.spec.incarnations
                    self._await_ready(worker, self._start_timeout_s)
                except BaseException as failure:  # noqa: BLE001 - the run stops with it, naming the worker
                    worker.failure = EmbeddingWorkerError(f"{worker.name} died ({error}) and could not be started again: {failure}")
                    log.error("%s", worker.failure)
                else:
                    with self._lock:
                        unanswered = sorted((r, c) for r, c in self._pending.items() if c.worker == worker.index)
                    log.warning("%s: started again as pid %d (restart %d of %d); sending it the %d calls not answered",
                                error, worker.process.pid, worker.restarts, self._restarts, len(unanswered))
                    for _, call in unanswered:
                        if not self._transmit(worker, call):
                            break  # dead again: the reader's next recv sees it
                    return True
        failure = worker.failure
        self._fail_pending(lambda index: failure if index == worker.index else None)
        return False

    def _died(self, worker: _Process, final: bool = True) -> EmbeddingWorkerError:
        """The error naming ``worker``, dead; ``final``: the run stops with it (no restart left)."""
        if worker.failure is not None:
            return worker.failure
        try:
            code: Optional[int] = worker.process.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        how = "is not answering" if code is None else f"exited with code {code}"
        if not final:
            return EmbeddingWorkerError(f"{worker.describe()} {how}")
        restarted = f" after {worker.restarts} restart(s)" if worker.restarts else ""
        worker.failure = EmbeddingWorkerError(
            f"{worker.describe()} {how}{restarted}; the embedding lookups and updates it had in flight are lost, so the run "
            f"stops (restart it from the last checkpoint, or allow EmbeddingWorkerSettings.restarts)")
        log.error("%s", worker.failure)
        return worker.failure

    def _fail_pending(self, error_of: Callable[[int], Optional[BaseException]]) -> None:
        with self._lock:
            failing = [(r, c) for r, c in self._pending.items() if error_of(c.worker) is not None]
            for request, _ in failing:
                del self._pending[request]
        for _, call in failing:
            call.future.set_exception(error_of(call.worker))

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
        reads = bool(payload[1])
        if worker.reads_trainer_memory and not reads:  # the calls to send it again name the trainer's memory
            raise EmbeddingWorkerError(f"{worker.describe()} cannot read the trainer's memory as the worker it replaces did")
        if not reads and not worker.restarts:
            log.info("%s cannot read the trainer's memory (process_vm_readv refused): ids and gradients are copied into "
                     "shared buffers", worker.describe())
        worker.reads_trainer_memory = reads

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


def _ref(buffer: SharedTensor) -> tuple[Optional[str], int, int]:
    return buffer.segment, buffer.offset, buffer.tensor.numel()


def _numel(counts: Sequence[int], dims: Sequence[int]) -> int:
    """``RowLayout(counts, dims).numel`` without the layout's blocks (26 tables: three times a step on the prefetch thread)."""
    if len(counts) != len(dims):
        raise ValueError(f"{len(counts)} counts but {len(dims)} dims")
    return sum(c * d for c, d in zip(counts, dims))


def _readable_in_place(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.is_contiguous() and tensor.numel() > 0


def _worker_ids(sharded: Any) -> WorkerIds:
    if isinstance(sharded, WorkerIds):
        return sharded
    if isinstance(sharded, KeyedIds):
        return WorkerIds(sharded)
    raise TypeError(f"EmbeddingWorkers: expected the ids as EmbeddingWorkers.shard() gives them, got {type(sharded).__name__}")
