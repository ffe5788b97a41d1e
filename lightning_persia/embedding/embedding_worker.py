"""The embedding worker: a process of its own that does a trainer rank's per-id work with the parameter server.

PERSIA puts an embedding worker between the data loaders and the NN workers: it talks to the parameter servers and
hands the NN worker its rows ready to use, then takes the gradients back and pushes them. Here, per lookup, the worker
deduplicates each module's ids (per plan), buckets the step's unique ids by shard and encodes them, calls the shards (retries and fencing: ``remote_ps.client``), and decodes
the rows straight into the trainer's shared buffer; per update, it encodes the gradient read from the trainer's
shared buffer (reusing the lookup's bucketing) and sends it. None of that runs in the trainer's interpreter, whose
one lock its threads would share.

Messages are small tuples on a pipe (:data:`DEDUP`, :data:`DEDUP_FEATURES`, :data:`LOOKUP`, :data:`UPDATE`, :data:`DROP`, :data:`CLOSE` in; :data:`READY`,
:data:`DONE`, :data:`FAILED` out); tensors travel as ``(segment, offset, numel)`` of the trainer's
:class:`~lightning_persia.embedding.shared_buffers.SharedBuffers`, or, for what the worker only reads (ids, gradients),
as ``(None, address, numel)`` in the trainer's own memory (``embedding/process_memory.py``). Updates come numbered
by the trainer (``seq_base``), so that a worker started in place of a dead one sends them again under the same
sequence numbers. The worker ends when the trainer closes the pipe
(or dies). It runs as ``python -m lightning_persia.embedding.embedding_worker <socket fd>``, the spec its first message.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
from collections import OrderedDict
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Optional

import torch

from lightning_persia.embedding import process_memory
from lightning_persia.embedding.shared_buffers import MappedSegments
from lightning_persia.ops.dedup import keyed_unique
from lightning_persia.ops.keyed_ids import KeyedIds
from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.client.retry import RetryPolicy
from lightning_persia.remote_ps.metrics import ClientCallLog


DEDUP, DEDUP_FEATURES, LOOKUP, UPDATE, DROP, CLOSE = "dedup", "dedup_features", "lookup", "update", "drop", "close"
READY, DONE, FAILED = "ready", "done", "failed"
SHARDINGS_KEPT = 64  # lookups whose bucketing is kept for their update (more than any staleness window holds)

BufferRef = tuple[Optional[str], int, int]  # segment, byte offset, elements; no segment: an address in the trainer's memory


@dataclass(frozen=True)
class WorkerSpec:
    """What an embedding worker needs to reach the shards as its trainer does (picklable: it crosses to the process)."""

    addresses: tuple[str, ...]
    dims: dict[str, int]
    retry: RetryPolicy
    incarnations: tuple[Optional[str], ...]
    token: Optional[str] = None
    tls_root_cert: Optional[str] = None
    log_calls: bool = False  # every reply carries the shard calls made since the last (the trainer's metrics count them)
    client_id: Optional[str] = None  # the sender of its updates: a worker started in place of a dead one keeps it
    trainer: tuple[int, int, bytes] = (0, 0, b"")  # pid, and an address there with its bytes: whether the worker may read it


def serve(connection: Connection, spec: WorkerSpec) -> None:
    """The worker's process: answers the trainer's requests until it closes the pipe."""
    # A terminal's Ctrl-C reaches the whole process group: the trainer stops its workers (or its exit closes the pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # the worker's tensor work is small copies; the cores belong to the trainer's kernels
    try:
        calls = ClientCallLog() if spec.log_calls else None
        client = PSClient(list(spec.addresses), token=spec.token, tls_root_cert=spec.tls_root_cert, client_id=spec.client_id,
                          interceptors=[calls] if calls is not None else ())
        client.retry = spec.retry  # the trainer's policy, as recovery set it
        client.describe(list(spec.dims))  # learns the tables' dims, which size messages and decode rows
        client.incarnations = list(spec.incarnations)
    except BaseException as error:  # noqa: BLE001 - told to the trainer, which raises it naming this worker
        connection.send((FAILED, portable_error(error)))
        return
    pid, address, expected = spec.trainer
    trainer_pid = pid if pid and process_memory.readable(pid, address, expected) else None
    worker = _Worker(connection, client, calls, trainer_pid)
    connection.send((READY, os.getpid(), trainer_pid is not None))
    try:
        worker.run()
    finally:
        client.close()
        worker.segments.close()


class _Worker:
    def __init__(self, connection: Connection, client: PSClient, calls: Optional[ClientCallLog], trainer_pid: Optional[int]) -> None:
        self.connection = connection
        self._trainer_pid = trainer_pid
        self.client = client
        self._calls = calls
        self.segments = MappedSegments()
        self._send_lock = threading.Lock()  # replies go out from the client's thread as calls complete
        self._shardings: "OrderedDict[int, Any]" = OrderedDict()
        self._shardings_lock = threading.Lock()

    def run(self) -> None:
        while True:
            try:
                message = self.connection.recv()
            except (EOFError, OSError):  # the trainer is gone
                return
            kind = message[0]
            if kind == CLOSE:
                return
            if kind == DROP:
                self.segments.drop(message[1])
                continue
            request = message[1]
            try:
                if kind == DEDUP:
                    self._dedup(*message[1:])
                elif kind == DEDUP_FEATURES:
                    self._dedup_features(*message[1:])
                elif kind == LOOKUP:
                    self._lookup(*message[1:])
                elif kind == UPDATE:
                    self._update(*message[1:])
                else:
                    raise ValueError(f"unknown request {kind!r}")
            except BaseException as error:  # noqa: BLE001 - the request's future in the trainer raises it
                self._reply(FAILED, request, portable_error(error))

    def _dedup(self, request: int, tables: tuple[str, ...], counts: tuple[int, ...], ids: BufferRef, unique: BufferRef,
               inverse: BufferRef, incarnations: Optional[tuple]) -> None:
        """Writes each table's unique ids (one after another) and every id's row among its table's into the trainer's
        buffers; answers the unique counts."""
        self._fence(incarnations)
        found, rows = keyed_unique(KeyedIds(tables, counts, self._tensor(ids, torch.int64)))
        self._tensor(unique, torch.int64)[: found.ids.numel()].copy_(found.ids)
        self._tensor(inverse, torch.int64).copy_(rows)
        self._reply(DONE, request, found.counts)

    def _dedup_features(self, request: int, tables: tuple[str, ...], feature_tables: tuple[int, ...], stride: int, ids: BufferRef,
                        lengths: BufferRef, lengths_dtype: str, unique: BufferRef, inverse: BufferRef, incarnations: Optional[tuple]) -> None:
        """:meth:`_dedup` of a collection's ids, counted per table here from the batch's lengths (``stride`` of each
        feature, ``feature_tables[f]`` the table of feature ``f``); answers the unique counts and the ids' counts."""
        ends = torch.cumsum(self._tensor(lengths, getattr(torch, lengths_dtype)), 0, dtype=torch.int64)[stride - 1 :: stride]
        per_feature = torch.diff(ends, prepend=ends.new_zeros(1))
        counts = torch.zeros(len(tables), dtype=torch.int64).index_add_(0, torch.tensor(feature_tables, dtype=torch.int64), per_feature)
        id_counts = tuple(counts.tolist())
        self._fence(incarnations)
        found, rows = keyed_unique(KeyedIds(tables, id_counts, self._tensor(ids, torch.int64)))
        self._tensor(unique, torch.int64)[: found.ids.numel()].copy_(found.ids)
        self._tensor(inverse, torch.int64).copy_(rows)
        self._reply(DONE, request, (found.counts, id_counts))

    def _lookup(self, request: int, token: Optional[int], tables: tuple[str, ...], counts: tuple[int, ...], ids: BufferRef,
                rows: BufferRef, train: bool, wire_dtype: str, incarnations: Optional[tuple]) -> None:
        self._fence(incarnations)
        sharded = self.client.shard(KeyedIds(tables, counts, self._tensor(ids, torch.int64).clone()))
        if token is not None:
            with self._shardings_lock:
                self._shardings[token] = sharded
                while len(self._shardings) > SHARDINGS_KEPT:
                    self._shardings.popitem(last=False)
        out = self._tensor(rows, torch.float32)
        self._answer(request, self.client.lookup_sharded_async(sharded, train=train, wire_dtype=wire_dtype, out=out))

    def _update(self, request: int, token: Optional[int], tables: tuple[str, ...], counts: tuple[int, ...], ids: BufferRef,
                grads: BufferRef, dims: tuple[int, ...], wire_dtype: str, sender: Optional[str], seq_base: int,
                incarnations: Optional[tuple]) -> None:
        self._fence(incarnations)
        with self._shardings_lock:
            sharded = self._shardings.pop(token, None) if token is not None else None
        if sharded is None:
            sharded = self.client.shard(KeyedIds(tables, counts, self._tensor(ids, torch.int64).clone()))
        values = self._tensor(grads, torch.float32)
        self._answer(request, self.client.update_sharded_async(sharded, values, dims, wire_dtype=wire_dtype, sender=sender,
                                                               seq_base=seq_base))

    def _fence(self, incarnations: Optional[tuple]) -> None:
        if incarnations is not None:  # the trainer accepted new incarnations (after a rollback, or a checkpoint's load)
            self.client.incarnations = list(incarnations)

    def _tensor(self, ref: BufferRef, dtype: torch.dtype) -> torch.Tensor:
        segment, offset, numel = ref
        if segment is None:  # read-only input left in the trainer's memory: this copy is the only one
            if self._trainer_pid is None:
                raise RuntimeError("the trainer named its own memory, which this worker cannot read")
            return process_memory.read(self._trainer_pid, offset, numel, dtype)
        return self.segments.tensor(segment, offset, numel, dtype)

    def _answer(self, request: int, future: Future) -> None:
        def done(f: Future) -> None:
            error = f.exception() if not f.cancelled() else None
            if f.cancelled():
                self._reply(FAILED, request, CancelledError("the call was cancelled: the worker's client closed"))
            elif error is not None:
                self._reply(FAILED, request, portable_error(error))
            else:
                self._reply(DONE, request, None)

        future.add_done_callback(done)

    def _reply(self, kind: str, request: int, payload: Any) -> None:
        calls = self._calls.drain() if self._calls is not None else None
        with self._send_lock:
            try:
                self.connection.send((kind, request, payload, calls))
            except (BrokenPipeError, OSError):  # the trainer is gone; run() ends at its next read
                pass


def portable_error(error: BaseException) -> BaseException:
    """``error`` as the trainer can unpickle it: itself when it survives pickling (the client's errors do), else a
    RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")


if __name__ == "__main__":  # started by the trainer (worker_client.py) with its end of a socket pair
    _connection = Connection(int(sys.argv[1]))
    serve(_connection, _connection.recv())
