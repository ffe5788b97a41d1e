"""Prometheus metrics of one trainer rank (``PersiaStrategy(metrics=MetricsEndpoint(port=...))``).

Served at ``http://<host>:<port + local rank>/metrics``:

- per step, from the embedding pipeline's figures of the step (:meth:`TrainerMetrics.observe_step`):
  ``persia_trainer_steps_total``, ``persia_trainer_lookup_wait_seconds`` (histogram: how long the forward
  waited for its rows), ``persia_trainer_embedding_lag_steps`` (histogram: how many earlier steps' updates were
  unacknowledged when the step's lookup went out: the most its rows missed), ``persia_trainer_embedding_lag_at_answer_steps``
  (histogram: ... still unacknowledged when the lookup was answered; lower when a lookup waited, e.g. for a restarted
  shard), ``persia_trainer_rows_fetched_total``, ``persia_trainer_wire_bytes_total``;
- read when Prometheus scrapes (a collector over a figures callable): ``persia_trainer_rollbacks_total``,
  ``persia_trainer_dropped_nonfinite_rows_total``, ``persia_trainer_prefetch_misses_total``;
- every parameter-server call, by method and status code (``grpc_client_handled_total``,
  ``grpc_client_handling_seconds``): the PS errors are the calls whose ``grpc_code`` is not ``OK``;
- the process' CPU and memory (``process_*``), and ``persia_trainer_info{global_rank, local_rank, node_rank}``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, InfoMetricFamily, Metric

from lightning_persia.remote_ps.metrics import LATENCY_BUCKETS, ClientRpcMetrics, metrics_url, serve_metrics, stop_metrics

LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)

# figures() key -> (metric name, help)
_SCRAPED = {
    "rollbacks": ("persia_trainer_rollbacks", "Rollbacks to the last checkpoint after a parameter-server failure."),
    "dropped_nonfinite_rows": ("persia_trainer_dropped_nonfinite_rows", "Embedding gradient rows dropped as NaN or infinite."),
    "prefetch_misses": ("persia_trainer_prefetch_misses", "Forwards whose ids differed from the prefetched ones (fetched again)."),
}


class _Scraped:
    def __init__(self, figures: Callable[[], Mapping[str, float]], identity: Mapping[str, str]) -> None:
        self._figures = figures
        self._identity = dict(identity)

    def collect(self) -> Iterable[Metric]:
        figures = self._figures()
        for key, (name, text) in _SCRAPED.items():
            yield CounterMetricFamily(name, text, value=float(figures.get(key, 0)))
        info = InfoMetricFamily("persia_trainer", "This trainer process' place in the job.")
        info.add_metric([], self._identity)
        yield info


@dataclass
class MetricsEndpoint:
    """Where each trainer rank serves its Prometheus metrics: ``http://<host>:<port + local rank>/metrics``.

    Example (YAML: ``trainer.strategy.init_args.metrics: {port: 9400, host: 0.0.0.0}``)::

        PersiaStrategy(metrics=MetricsEndpoint(port=9400, host="0.0.0.0"))
    """

    port: int
    """Port of local rank 0 (local rank r serves on ``port + r``); ``0``: every rank picks a free port."""
    host: str = "127.0.0.1"
    """Address the endpoint binds (``0.0.0.0`` to be scraped from other machines)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"MetricsEndpoint: port must be in [0, 65535], got {self.port}")

    def port_of(self, local_rank: int) -> int:
        """The port local rank ``local_rank`` serves on."""
        return self.port + local_rank if self.port else 0


class TrainerMetrics:
    """The registry and HTTP endpoint of one trainer rank; :meth:`stop` closes the endpoint.

    Args:
        host, port: where ``/metrics`` is served (``port=0`` picks a free one).
        figures: returns the cumulative figures of :data:`_SCRAPED`'s keys; called at each scrape.
        identity: labels of ``persia_trainer_info`` (ranks).
    """

    def __init__(self, host: str, port: int, figures: Callable[[], Mapping[str, float]], identity: Mapping[str, str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self.registry.register(_Scraped(figures, identity))
        self.client_interceptor = ClientRpcMetrics(self.registry)
        self._steps = Counter("persia_trainer_steps", "Training steps whose embedding rows this rank fetched.", registry=self.registry)
        self._wait = Histogram("persia_trainer_lookup_wait_seconds", "Time a step's forward waited for its embedding rows.",
                               buckets=LATENCY_BUCKETS, registry=self.registry)
        self._lag = Histogram("persia_trainer_embedding_lag_steps", "Earlier steps' embedding updates unacknowledged when a step's lookup went out.",
                              buckets=LAG_BUCKETS, registry=self.registry)
        self._lag_at_answer = Histogram("persia_trainer_embedding_lag_at_answer_steps",
                                        "Earlier steps' embedding updates unacknowledged when a step's lookup was answered.",
                                        buckets=LAG_BUCKETS, registry=self.registry)
        self._rows = Counter("persia_trainer_rows_fetched", "Embedding rows fetched (unique per table and step).", registry=self.registry)
        self._wire = Counter("persia_trainer_wire_bytes", "Bytes of embedding rows received from the shards.", registry=self.registry)
        self._server = serve_metrics(self.registry, host, port, what=f"trainer metrics (metrics.port, rank {identity.get('global_rank', '?')})")
        self.url = metrics_url(self._server, host)

    def observe_step(self, figures: Mapping[str, float]) -> None:
        """Folds in one step's figures (``EmbeddingPipeline.step_metrics()``: lookup_wait_ms, staleness, staleness_at_answer,
        rows_fetched, wire_bytes)."""
        if not figures:
            return
        self._steps.inc()
        self._wait.observe(figures.get("lookup_wait_ms", 0.0) / 1000.0)
        self._lag.observe(figures.get("staleness", 0.0))
        self._lag_at_answer.observe(figures.get("staleness_at_answer", 0.0))
        self._rows.inc(figures.get("rows_fetched", 0.0))
        self._wire.inc(figures.get("wire_bytes", 0.0))

    def stop(self) -> None:
        stop_metrics(self._server)
