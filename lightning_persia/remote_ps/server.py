"""One parameter-server shard: the gRPC server around :class:`PSServicer`, and the process that serves it.

- :class:`ShardServer` binds the servicer and the standard health service, with a token and/or TLS when
  asked (``security.py``); with ``metrics_port`` set it also serves Prometheus metrics (``metrics.py``).
- :func:`run_shard` is the ``lightning-persia ps serve`` process: prints ``PERSIA_PS_LISTENING host:port``
  (after ``PERSIA_PS_METRICS <url>`` when it serves metrics), stops gracefully on SIGTERM/SIGINT, and exits
  when its parent dies (``parent_pid``; ``process.py``).

The service itself is ``servicer.py``; the launcher of local shard processes is ``launcher.py``. This module
never imports Lightning.
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import uuid
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lightning_persia.remote_ps import metrics
from lightning_persia.remote_ps.config import PSConfig
from lightning_persia.remote_ps.faults import DelayInterceptor
from lightning_persia.remote_ps.peers import Peers
from lightning_persia.remote_ps.process import exit_with_parent, prepare_shard_process, trim_memory_every
from lightning_persia.remote_ps.protocol import LISTENING_PREFIX, METRICS_PREFIX, SERVICE_NAME
from lightning_persia.remote_ps.security import TLSFiles, TokenInterceptor, check_bind_security, is_loopback_host
from lightning_persia.remote_ps.servicer import PSServicer
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.wal import ReplayReport, open_shard_log

log = logging.getLogger("lightning_persia.ps")


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@dataclass(frozen=True)
class Endpoint:
    """Where a shard listens (``port`` 0 picks a free one) and who may call it: the holders of ``token``, over TLS
    with ``tls``; ``insecure`` allows a non-loopback ``host`` with neither (``lightning-persia ps serve``'s options)."""

    host: str = "127.0.0.1"
    port: int = 0
    token: Optional[str] = None
    tls: Optional[TLSFiles] = None
    insecure: bool = False


class ShardServer:
    """The gRPC server of one shard: the PS service, the health service, optional token and TLS."""

    def __init__(self, store: ShardStore, config: PSConfig, endpoint: Endpoint = Endpoint(), *, model_version: int = 0) -> None:
        check_bind_security(endpoint.host, token=endpoint.token, tls=endpoint.tls is not None, insecure=endpoint.insecure)
        self.servicer = PSServicer(store, config, model_version, peers=Peers(
            endpoint.token, endpoint.tls, max_message_bytes=config.max_message_mb << 20))
        self.health = health.HealthServicer()
        self._host = endpoint.host
        self._metrics_port = config.metrics_port
        self.metrics_registry = None if config.metrics_port is None else metrics.shard_registry(self.servicer)
        self.metrics_url: Optional[str] = None
        self._metrics_server = None
        # The metrics interceptor comes first, so it also counts the calls the token interceptor refuses; an
        # injected delay last, so that it slows only the calls that get through.
        interceptors = ([metrics.ServerRpcMetrics(self.metrics_registry)] if self.metrics_registry is not None else []) + (
            [TokenInterceptor(endpoint.token)] if endpoint.token else []) + ([DelayInterceptor(config.fault_delay_s)] if config.fault_delay_s else []) + (
            [DelayInterceptor(config.fault_ack_delay_s, {"Update"}, after=True)] if config.fault_ack_delay_s else [])
        max_bytes = config.max_message_mb << 20
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.server_threads, thread_name_prefix="persia-ps"),
            interceptors=interceptors or None,
            options=[
                ("grpc.max_send_message_length", max_bytes),
                ("grpc.max_receive_message_length", max_bytes),
                ("grpc.so_reuseport", 0),  # a busy port is an error, not a silently shared one
            ],
        )
        self.servicer.add_to_server(self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        target = format_address(endpoint.host, endpoint.port)
        try:
            if endpoint.tls is not None:
                bound = self._server.add_secure_port(target, endpoint.tls.credentials())
            else:
                bound = self._server.add_insecure_port(target)
        except RuntimeError as err:
            raise OSError(f"cannot bind {target}: {err} (is the port in use?)") from None
        if not bound:
            raise OSError(f"cannot bind {target} (is the port in use?)")
        self.address = format_address(endpoint.host, bound)

    def start(self) -> str:
        """Starts serving (metrics first: a shard whose metrics port is taken never answers a call)."""
        if self.metrics_registry is not None:
            try:
                self._metrics_server = metrics.serve_metrics(self.metrics_registry, self._host, self._metrics_port,
                                                             what=f"shard {self.servicer.store.shard_index} metrics (--metrics-port)")
            except metrics.MetricsPortError:
                self._server.stop(None)  # releases the bound gRPC port
                raise
            self.metrics_url = metrics.metrics_url(self._metrics_server, self._host)
        self._server.start()
        self.servicer.settler.start()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self.address

    def stop(self, grace_s: float) -> None:
        """Reports NOT_SERVING, lets in-flight calls finish for up to ``grace_s`` seconds, then stops."""
        self.health.enter_graceful_shutdown()
        self.servicer.settler.stop()
        self._server.stop(grace_s).wait()
        self.servicer.close()
        metrics.stop_metrics(self._metrics_server)


def run_shard(
    *,
    shard_index: int,
    num_shards: int,
    config: PSConfig,
    endpoint: Endpoint = Endpoint(),
    parent_pid: Optional[int] = None,
    model_version: int = 0,
    before_serving: Optional[Callable[[PSServicer, threading.Event], None]] = None,
) -> int:
    """Serves one shard until SIGTERM/SIGINT (or the parent's death); returns the exit status.

    Prints ``PERSIA_PS_LISTENING <host>:<port>`` on stdout, on a line of its own, once it accepts calls.
    ``model_version``: the version of the model whose tables it restored (a serving bundle's).
    ``before_serving(servicer, stop)`` runs once the tables are restored, before the first call is accepted
    (the serving delta watcher: ``stop`` is set when the shard stops); what it raises stops the shard.
    """
    prepare_shard_process(config)
    store = ShardStore(shard_index=shard_index, num_shards=num_shards, seed=config.seed, table_defaults=config.table_configs(),
                       fault_save_delay_s=config.fault_save_delay_s, disk_dir=config.disk_dir,
                       disk_mapped_bytes=config.disk_mapped_mb << 20,
                       memory_limit_bytes=config.memory_limit_mb << 20 if config.memory_limit_mb is not None else None)
    restored = None
    if config.durability != "none" and not config.read_only:  # before binding, like a restore
        store.log = open_shard_log(store, wal_directory(config.wal_dir, shard_index, num_shards), config.durability,
                                   uuid.uuid4().hex[:16], config.restore_from, config.dedup_window,
                                   on_progress=functools.partial(_report_replay, shard_index, num_shards),
                                   pause_s=config.fault_replay_delay_s)
        restored = store.log.report.checkpoint
    elif config.restore_from:  # before binding: a shard that cannot restore never answers with empty tables
        restored = store.load_latest(config.restore_from)  # CheckpointError: refuse to start
        log.info("shard %d/%d restored from %s", shard_index, num_shards, restored)
    server = ShardServer(store, config, endpoint, model_version=model_version)
    server.servicer.restored_from = restored
    stop = threading.Event()
    if before_serving is not None:
        before_serving(server.servicer, stop)
    if endpoint.insecure and not (is_loopback_host(endpoint.host) or endpoint.token or endpoint.tls):
        log.warning("serving on %s with neither TLS nor a token (--insecure): anyone who reaches it can read and "
                    "overwrite the tables", endpoint.host)

    signalled: list[int] = []

    def on_signal(signum, frame) -> None:
        # No lock here (not even Event.set): the handler runs on the main thread between two bytecodes, possibly
        # while that thread holds the very lock it would take (a second SIGTERM landing inside the first
        # handler's Event.set deadlocked the shard for good). The main loop below polls the list.
        signalled.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    if parent_pid is not None:
        exit_with_parent(parent_pid, stop)

    if config.malloc_trim_interval_s > 0:
        trim_memory_every(config.malloc_trim_interval_s, stop)
    address = server.start()
    protection = " + ".join(name for name, on in (("TLS", endpoint.tls), ("token", endpoint.token)) if on) or "no TLS, no token"
    log.info("shard %d/%d serving on %s (%s)", shard_index, num_shards, address, protection)
    if server.metrics_url:
        log.info("shard %d/%d metrics on %s", shard_index, num_shards, server.metrics_url)
        print(f"{METRICS_PREFIX} {server.metrics_url}", flush=True)
    print(f"{LISTENING_PREFIX} {address}", flush=True)
    while not signalled and not stop.wait(0.2):  # a timed wait keeps the main thread responsive to signals
        pass
    log.info("shard %d/%d stopping (grace %.1f s)", shard_index, num_shards, config.grace_s)
    stop.set()
    server.stop(config.grace_s)
    if store.log is not None:
        store.log.close()
    return 0


def wal_directory(wal_dir: str, shard_index: int, num_shards: int) -> str:
    """The folder of one shard's write-ahead log under ``PSConfig.wal_dir``."""
    return os.path.join(wal_dir, f"shard-{shard_index:05d}-of-{num_shards:05d}")


def _report_replay(shard_index: int, num_shards: int, report: ReplayReport) -> None:
    share = f"{100 * report.bytes_read / report.bytes_total:.0f}% " if report.bytes_total else ""
    state = "replaying its write-ahead log:" if not report.replayed else "replayed"
    log.info("shard %d/%d %s %s%s", shard_index, num_shards, state, share if not report.replayed else "", report.describe())
