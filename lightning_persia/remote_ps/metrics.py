"""Prometheus metrics of the parameter server, with ``prometheus-client``.

- :class:`ServerRpcMetrics`: a gRPC server interceptor that counts every call by service, method and status
  code and times it (the names and labels of go-grpc-prometheus: ``grpc_server_started_total``,
  ``grpc_server_handled_total{grpc_code}``, ``grpc_server_handling_seconds``), so failures are the calls whose
  ``grpc_code`` is not ``OK``.
- :class:`ShardCollector`: reads the store's per-table figures (``ShardStore.stats()``) and the shard's identity
  when Prometheus scrapes, so the store keeps no metric of its own.
- :class:`ClientRpcMetrics`: the client side of :class:`ServerRpcMetrics` (``grpc.aio`` channels of a trainer).
- :func:`serve_metrics`: ``/metrics`` over HTTP for one registry, refusing a port that is taken.

Every process builds its own :class:`~prometheus_client.CollectorRegistry` (nothing global), so tests and
several shards in one process never share figures. This module never imports Lightning.

Example::

    registry = shard_registry(servicer)                  # what `ps serve --metrics-port P` exposes
    server = serve_metrics(registry, "0.0.0.0", 9100)    # curl http://host:9100/metrics
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import grpc
import grpc.aio
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import start_http_server

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from lightning_persia.remote_ps.servicer import PSServicer
    from lightning_persia.remote_ps.store.progress import JobFigures
    from lightning_persia.remote_ps.store.shard_store import ShardStore

# Request latencies from a loopback lookup (well under a millisecond) to a save of a large table.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


def _split_method(full_method: str) -> tuple[str, str]:
    """``"/persia.ParameterServer/Lookup"`` -> ``("persia.ParameterServer", "Lookup")``."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


class ServerRpcMetrics(grpc.ServerInterceptor):
    """Counts and times every unary call a gRPC server handles (streaming calls pass through uncounted)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self._started = Counter("grpc_server_started_total", "RPCs started on the server.", labels, registry=registry)
        self._handled = Counter("grpc_server_handled_total", "RPCs completed on the server, by status code.",
                                [*labels, "grpc_code"], registry=registry)
        self._seconds = Histogram("grpc_server_handling_seconds", "Time from the call's arrival to its answer.",
                                  labels, buckets=LATENCY_BUCKETS, registry=registry)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler
        labels = ("unary", *_split_method(handler_call_details.method))
        behaviour = handler.unary_unary

        def counted(request, context):
            self._started.labels(*labels).inc()
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                return behaviour(request, context)
            except BaseException:
                # context.abort() recorded its code before raising; anything else reaches the caller as UNKNOWN
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            finally:
                self._seconds.labels(*labels).observe(time.perf_counter() - start)
                self._handled.labels(*labels, code.name).inc()

        return grpc.unary_unary_rpc_method_handler(
            counted, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer,
        )


class ClientRpcMetrics(grpc.aio.UnaryUnaryClientInterceptor):
    """Counts and times every call of a ``grpc.aio`` client (``grpc_client_*``, go-grpc-prometheus's names).

    Every attempt counts: a call that the client retries after ``UNAVAILABLE`` shows as one ``UNAVAILABLE``
    and then one ``OK``.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self._handled = Counter("grpc_client_handled_total", "RPCs completed by the client, by status code.",
                                [*labels, "grpc_code"], registry=registry)
        self._seconds = Histogram("grpc_client_handling_seconds", "Time from sending a call to its answer.",
                                  labels, buckets=LATENCY_BUCKETS, registry=registry)

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        start = time.perf_counter()
        call = await continuation(client_call_details, request)
        code = await call.code()
        self.record([(_method_name(client_call_details), code.name, time.perf_counter() - start)])
        return call

    def record(self, calls: Sequence[tuple[str, str, float]]) -> None:
        """Counts calls ``(method path, status code name, seconds)``: this client's, or those another process made
        for it and logged (an embedding worker's, :class:`ClientCallLog`)."""
        for method, code, seconds in calls:
            labels = ("unary", *_split_method(method))
            self._seconds.labels(*labels).observe(seconds)
            self._handled.labels(*labels, code).inc()


class ClientCallLog(grpc.aio.UnaryUnaryClientInterceptor):
    """Notes every call of a ``grpc.aio`` client as ``(method path, status code name, seconds)`` until :meth:`drain`:
    an embedding worker's calls, which its trainer counts (:meth:`ClientRpcMetrics.record`)."""

    def __init__(self) -> None:
        self._calls: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        start = time.perf_counter()
        call = await continuation(client_call_details, request)
        code = await call.code()
        with self._lock:
            self._calls.append((_method_name(client_call_details), code.name, time.perf_counter() - start))
        return call

    def drain(self) -> list[tuple[str, str, float]]:
        """The calls noted since the last drain."""
        with self._lock:
            calls, self._calls = self._calls, []
        return calls


def _method_name(details: grpc.aio.ClientCallDetails) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else method


@dataclass(frozen=True)
class _TableFigure:
    key: str  # key of ShardStore.stats()[table]
    name: str
    help: str
    counter: bool


# What a table's stats() figures become. Counters restart from zero when a checkpoint replaces the table
# (Prometheus' rate() treats that as a counter reset).
_TABLE_FIGURES = (
    _TableFigure("rows", "persia_ps_table_rows", "Rows stored in the table on this shard.", False),
    _TableFigure("bytes", "persia_ps_table_bytes", "Bytes the table's rows, optimizer state and index take on this shard.", False),
    _TableFigure("capacity", "persia_ps_table_capacity_rows", "Rows the table keeps on this shard before it evicts.", False),
    _TableFigure("inserted", "persia_ps_table_inserted_rows", "Rows admitted into the table.", True),
    _TableFigure("evicted", "persia_ps_table_evicted_rows", "Rows evicted from the table.", True),
    _TableFigure("not_admitted", "persia_ps_table_not_admitted_ids", "Unseen ids met in training that got no row "
                 "(admit_probability, or more new ids than the capacity).", True),
    _TableFigure("lookup_rows", "persia_ps_table_lookup_rows", "Rows read by lookups.", True),
    _TableFigure("update_rows", "persia_ps_table_update_rows", "Rows written by updates.", True),
    _TableFigure("dropped_update_rows", "persia_ps_table_dropped_update_rows", "Update rows of ids that had no row (evicted, or never admitted).", True),
    _TableFigure("lock_wait_s", "persia_ps_table_lock_wait_seconds", "Seconds requests waited to take the table's lock "
                 "(behind the demoter, expiry, a checkpoint's copy, or another request).", True),
)


class ShardCollector:
    """What one shard holds, read at scrape time: per-table rows, bytes and counters, and the shard's identity.

    ``persia_ps_shard_info{shard_index, num_shards, incarnation}`` changes its ``incarnation`` label whenever the
    shard process restarts (its tables then come from ``restored_from``, or start empty).
    """

    def __init__(self, servicer: "PSServicer") -> None:
        self._servicer = servicer

    def collect(self) -> Iterable[Metric]:
        servicer = self._servicer
        stats = servicer.store.stats()
        for figure in _TABLE_FIGURES:
            family = (CounterMetricFamily if figure.counter else GaugeMetricFamily)(figure.name, figure.help, labels=["table"])
            for table, values in stats.items():
                family.add_metric([table], float(values.get(figure.key, 0)))
            yield family
        info = InfoMetricFamily("persia_ps_shard", "This shard's place in its cluster and its process incarnation.")
        info.add_metric([], {"shard_index": str(servicer.store.shard_index), "num_shards": str(servicer.store.num_shards),
                             "incarnation": servicer.incarnation, "restored_from": servicer.restored_from or ""})
        yield info
        yield GaugeMetricFamily("persia_ps_shard_start_time_seconds", "Start of this shard's incarnation (Unix time).",
                                value=servicer.started_at)
        yield GaugeMetricFamily("persia_ps_tables", "Tables this shard holds.", value=len(stats))
        yield from _job_families(servicer.store.progress.figures())
        yield from _move_families(servicer.store)
        background = CounterMetricFamily("persia_ps_background_cpu_seconds", "CPU the shard's background threads spent "
                                         "in their passes (the demoter: disk tables' promotions, demotions, compaction).",
                                         labels=["thread"])
        for thread, seconds in servicer.store.background_cpu_s().items():
            background.add_metric([thread], seconds)
        yield background
        yield CounterMetricFamily("persia_ps_update_duplicates", "Updates answered without applying them again "
                                  "(a retry, or an update re-routed after a move that the slots' old owner had applied).", value=servicer.dedup.duplicates)
        shard_log = servicer.store.log
        if shard_log is not None:
            figures = shard_log.wal.stats
            yield GaugeMetricFamily("persia_ps_wal_bytes", "Bytes of the write-ahead log on disk (a checkpoint truncates it).",
                                    value=figures.disk_bytes)
            yield CounterMetricFamily("persia_ps_wal_written_bytes", "Bytes this process wrote to the write-ahead log.",
                                      value=figures.bytes_written)
            yield CounterMetricFamily("persia_ps_wal_records", "Records this process wrote to the write-ahead log.",
                                      value=figures.records)
            yield CounterMetricFamily("persia_ps_wal_commits", "Writes of the write-ahead log (each one fsync with "
                                      "durability fsync; a write carries every record queued).", value=figures.commits)
            report = shard_log.report
            yield GaugeMetricFamily("persia_ps_wal_replay_seconds", "How long this process's start replayed the write-ahead "
                                    "log past its checkpoint (0: no log to replay).", value=report.seconds)
            yield GaugeMetricFamily("persia_ps_wal_replay_load_seconds", "How long this process's start loaded the "
                                    "checkpoint its write-ahead log follows.", value=report.load_seconds)
            yield GaugeMetricFamily("persia_ps_wal_replay_rows", "Rows this process's start replayed from the log.",
                                    value=report.rows)


def _job_families(jobs: Iterable["JobFigures"]) -> Iterable[Metric]:
    """The figures of the shard's last save, load, re-shard and hand-over of each table (running or finished)."""
    labels = ["job", "table"]
    done = GaugeMetricFamily("persia_ps_job_done_rows", "Rows done by the table's last save, load, re-shard or hand-over.", labels=labels)
    total = GaugeMetricFamily("persia_ps_job_total_rows", "Rows the table's last save, load, re-shard or hand-over has to do.", labels=labels)
    rate = GaugeMetricFamily("persia_ps_job_rows_per_second", "Rows per second of the table's last save, load, re-shard or hand-over.", labels=labels)
    left = GaugeMetricFamily("persia_ps_job_seconds_left", "Seconds the table's running save, load, re-shard or hand-over has left "
                             "at its rate so far (0 once done).", labels=labels)
    running = GaugeMetricFamily("persia_ps_job_running", "1 while the table's save, load, re-shard or hand-over runs.", labels=labels)
    for job in jobs:
        key = [job.job, job.table]
        done.add_metric(key, job.done_rows)
        rate.add_metric(key, job.rows_per_second)
        running.add_metric(key, 0.0 if job.finished else 1.0)
        if job.total_rows is not None:
            total.add_metric(key, job.total_rows)
        if job.seconds_left is not None:
            left.add_metric(key, job.seconds_left)
    yield from (done, total, rate, left, running)


def _move_families(store: "ShardStore") -> Iterable[Metric]:
    """The shard's place in the shard map and what its live moves carried (``docs/elastic.md``)."""
    shard_map = store.shard_map
    yield GaugeMetricFamily("persia_ps_shard_map_version", "Version of the shard map this shard routes by.",
                            value=shard_map.version)
    yield GaugeMetricFamily("persia_ps_slots_owned", "Slots of the shard map this shard owns (of 4096).",
                            value=len(shard_map.slots_of(store.shard_index)))
    yield GaugeMetricFamily("persia_ps_handover_running", "1 while this shard hands slots over to others.",
                            value=float(store.handover_map is not None))
    tally = store.moves
    rows = CounterMetricFamily("persia_ps_moved_rows", "Rows live moves carried, out of this shard or into it (a "
                               "row sent again in a later round counts again).", labels=["direction"])
    moved = CounterMetricFamily("persia_ps_moved_bytes", "Bytes of rows live moves carried, out of this shard or into it.",
                                labels=["direction"])
    for direction, count, size in (("out", tally.rows_out, tally.bytes_out), ("in", tally.rows_into, tally.bytes_into)):
        rows.add_metric([direction], count)
        moved.add_metric([direction], size)
    yield rows
    yield moved
    moves = CounterMetricFamily("persia_ps_handovers", "Moves of slots out of this shard, by how they ended.", labels=["outcome"])
    moves.add_metric(["finished"], tally.finished)
    moves.add_metric(["given_up"], tally.given_up)
    yield moves


def shard_registry(servicer: "PSServicer") -> CollectorRegistry:
    """The registry a shard serves: its table collector and the process' CPU, memory (RSS) and file figures.

    The RPC figures are added by the :class:`ServerRpcMetrics` interceptor built on the same registry.
    """
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    registry.register(ShardCollector(servicer))
    return registry


class MetricsPortError(OSError):
    """The metrics port could not be bound (taken, or an address this host does not have)."""


def serve_metrics(registry: CollectorRegistry, host: str, port: int, what: str = "metrics") -> "WSGIServer":
    """Serves ``registry`` at ``http://host:port/metrics`` on a daemon thread; ``port=0`` picks a free port.

    Stop it with ``server.shutdown(); server.server_close()``. Raises :class:`MetricsPortError` naming the
    address when it cannot be bound.
    """
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        raise MetricsPortError(f"cannot serve {what} on {host}:{port}: {err.strerror or err}"
                               f"{' (the port is taken: choose another one)' if port else ''}") from None
    return server


def metrics_url(server: "WSGIServer", host: Optional[str] = None) -> str:
    """``http://host:port/metrics`` of a server started by :func:`serve_metrics`."""
    bound_host, bound_port = server.server_address[:2]
    host = host or bound_host
    return f"http://[{host}]:{bound_port}/metrics" if ":" in host else f"http://{host}:{bound_port}/metrics"


def stop_metrics(server: Optional["WSGIServer"]) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()

