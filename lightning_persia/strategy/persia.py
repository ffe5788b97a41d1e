"""``PersiaStrategy``: embeddings on parameter-server shards (asynchronous, bounded staleness), dense network with DDP.

The class keeps Lightning's hooks, as Lightning's own ``strategies/ddp.py`` does; the work behind them lives in
``embedding/`` (the pipeline), ``strategy/interception.py``, ``recovery.py``, ``table_saves.py`` and ``local_cluster.py``.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Literal, Mapping, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

import lightning.pytorch as pl
from lightning_persia.data.transform import DataTransform
from lightning_persia.embedding.data_parallel import DataParallelTables
from lightning_persia.embedding.modules import RemoteModule
from lightning_persia.embedding.pipeline import EmbeddingPipeline
from lightning_persia.embedding.prefetch import PrefetchingLoader
from lightning_persia.embedding.rank_merge import RankMerge
from lightning_persia.embedding.worker_client import EmbeddingWorkers, WorkerDeduplication
from lightning_persia.ops.pooled_lookup import kernel_in_use
from lightning_persia.remote_ps.client import PSClient, ShardWait
from lightning_persia.remote_ps.table_config import InitLike, OptimizerLike, TableSettings
from lightning_persia.strategy import ps_checkpoint
from lightning_persia.strategy.interception import MODULE_KINDS, TableDefaults, TableOverride, intercept
from lightning_persia.strategy.lightning_internals import keep_the_users_samplers
from lightning_persia.remote_ps.client.scaling import ScaleReport
from lightning_persia.strategy.local_cluster import LocalCluster
from lightning_persia.strategy.metrics import MetricsEndpoint, TrainerMetrics
from lightning_persia.strategy.moved_arguments import refuse_moved_arguments
from lightning_persia.strategy.ps_settings import PSSettings
from lightning_persia.strategy.recovery import Recovery, RecoveryConfig, RollbackEvent
from lightning_persia.strategy.table_saves import TableSaves
from lightning_persia.strategy.worker_settings import EmbeddingWorkerSettings

log = logging.getLogger(__name__)

WAIT_REPORT_INTERVAL_S = 2.0  # a line every this many seconds while a shard has not answered yet


class PersiaStrategy(DDPStrategy):
    """Trains embedding tables on parameter-server shards and the dense network with DDP (PERSIA's hybrid algorithm).

    In ``setup()`` every ``torchrec.EmbeddingBagCollection``, ``torchrec.EmbeddingCollection``,
    ``nn.EmbeddingBag`` and ``nn.Embedding`` of the LightningModule is swapped for a remote twin with the same
    call signature and output type; their tables then live on the shards and cost nothing on the trainer (they
    may be declared on the ``meta`` device). The rest of the model trains synchronously with DDP.

    Each batch's embedding rows are fetched ahead of its step, and its embedding gradients are pushed after its
    backward without waiting: a lookup misses the updates of at most ``staleness`` earlier batches
    (``staleness=0`` is exactly synchronous training).

    Example::

        trainer = L.Trainer(strategy=PersiaStrategy(staleness=4, embedding_optimizer=Adagrad(lr=0.01)), devices=2)
        trainer.fit(model, datamodule)

    Args:
        ps: where the shards are and how to reach them: a :class:`~lightning_persia.PSSettings` (``addresses``, or
            ``num_local_shards`` started here with ``seed`` and ``config``; ``token``, ``tls_root_cert``,
            ``timeout_s``). The default starts 2 shards on this machine unless ``PERSIA_PS_ADDRESSES`` names some.
        staleness: how many earlier batches' embedding updates a lookup may miss.
        tables: settings of every table (optimizer, initialiser, capacity, eviction, admission, weight bound,
            storage dtype, disk tier, TTL): a :class:`~lightning_persia.TableSettings`, whose defaults are those of
            every table (optimizer ``Adagrad(lr=0.01, rowwise=True)``; ``init=None`` keeps each module's default:
            TorchRec's ``U(-sqrt(1/n), sqrt(1/n))`` or its ``weight_init_min/max``, ``N(0, 1)`` for ``nn.Embedding[Bag]``).
        table_overrides: per-table settings, keyed by the table's name or its full name ``<module path>.<name>``.
        embedding_optimizer: shorthand for ``tables.optimizer`` (a different ``tables.optimizer`` too is refused).
        embedding_init: shorthand for ``tables.init`` (a different ``tables.init`` too is refused).
        wire_dtype: ``"fp16"`` (default) or ``"fp32"`` for rows and gradients on the wire.
        intercept: module kinds to serve remotely (default: all four).
        exclude: module paths to keep local (trained by DDP like any dense parameter).
        data_parallel_max_rows: tables of TorchRec collections with at most this many rows stay on every
            trainer (TorchRec's data-parallel placement) and train without staleness: DDP all-reduces their
            gradient and the table's embedding optimizer runs here after each backward. Small tables are
            touched by every batch, so this is where staleness costs accuracy. A kept table reads row
            ``id mod num_embeddings`` (a remote one takes any id). ``0`` (default): all remote.
        average_embedding_gradients: scale each rank's embedding gradient by ``1 / world_size`` so that an
            embedding ``lr`` means what it means under DDP (mean over the global batch).
        merge_rank_gradients: with several ranks, sum the ranks' embedding gradients of a step and apply
            them as one update (default), so N ranks train the tables as one rank on the global batch and
            staleness counts steps of the job. ``False``: every rank's gradient is its own update, as in
            PERSIA (no all-gather; the model then depends on the rank count). See ``embedding/rank_merge.py``.
        log_embedding_metrics: log lookup wait, rows fetched, unique ratio, wire bytes and staleness of the steps the
            trainer logs (every ``log_every_n_steps``: logging costs the trainer CPU on every call, even unwritten).
        recovery: what happens when a shard dies or restarts (default: roll back to the last checkpoint and go
            on; the embedded launcher restarts dead shards). See ``lightning_persia.strategy.recovery``.
        metrics: serve this rank's Prometheus metrics (lookup wait, lag, rows, wire bytes, rollbacks, PS calls and
            errors) at a :class:`~lightning_persia.MetricsEndpoint` (``http://<host>:<port + local rank>/metrics``);
            ``None``: none. See ``lightning_persia.strategy.metrics``.
        embedding_workers: the processes that do each rank's per-id work with the shards, out of the trainer's
            interpreter: an :class:`~lightning_persia.EmbeddingWorkerSettings` (``count``, default 1; ``0``: on the
            trainer's threads). See ``docs/embedding-pipeline.md``.

    The connection, table and metrics settings were flat arguments once (``ps_addresses``, ``capacity``,
    ``metrics_port``, ...); such a name fails with a message naming its new place
    (``lightning_persia.strategy.moved_arguments``).
    """

    strategy_name = "persia"

    def __init__(
        self,
        ps: Optional[PSSettings] = None,
        staleness: int = 4,
        tables: Optional[TableSettings] = None,
        table_overrides: Optional[dict[str, TableOverride]] = None,
        embedding_optimizer: Optional[OptimizerLike] = None,
        embedding_init: Optional[InitLike] = None,
        wire_dtype: Literal["fp16", "fp32"] = "fp16",
        intercept: Optional[list[str]] = None,
        exclude: Optional[list[str]] = None,
        data_parallel_max_rows: int = 0,
        average_embedding_gradients: bool = True,
        merge_rank_gradients: bool = True,
        log_embedding_metrics: bool = True,
        recovery: Optional[RecoveryConfig] = None,
        metrics: Optional[MetricsEndpoint] = None,
        embedding_workers: Optional[EmbeddingWorkerSettings] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        refuse_moved_arguments(ddp_kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if data_parallel_max_rows < 0:
            raise ValueError(f"data_parallel_max_rows must be >= 0, got {data_parallel_max_rows}")
        if wire_dtype not in ("fp16", "fp32"):
            raise ValueError(f"wire_dtype must be 'fp16' or 'fp32', got {wire_dtype!r}")
        for name, value, kind in (("ps", ps, PSSettings), ("embedding_workers", embedding_workers, EmbeddingWorkerSettings),
                                  ("metrics", metrics, MetricsEndpoint)):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"PersiaStrategy: {name} must be a {kind.__name__} or None, got {type(value).__name__}")
        self.ps = (ps if ps is not None else PSSettings()).with_environment()
        self.embedding_workers = embedding_workers if embedding_workers is not None else EmbeddingWorkerSettings()
        self._workers: Optional[EmbeddingWorkers] = None
        self.staleness = staleness
        self.wire_dtype = wire_dtype
        self.intercept_kinds = list(intercept) if intercept is not None else list(MODULE_KINDS)
        self.exclude = list(exclude or [])
        self.average_embedding_gradients = average_embedding_gradients
        self.merge_rank_gradients = merge_rank_gradients
        self.log_embedding_metrics = log_embedding_metrics
        self.table_defaults = TableDefaults.of(tables, embedding_optimizer, embedding_init, table_overrides, data_parallel_max_rows)
        self.client: Optional[PSClient] = None
        self._pipeline: Optional[EmbeddingPipeline] = None
        self.remote_modules: list[RemoteModule] = []
        self.data_parallel_tables: list[DataParallelTables] = []
        self._cluster: Optional[LocalCluster] = None
        self._loaders: list[PrefetchingLoader] = []
        self.recovery = recovery if recovery is not None else RecoveryConfig()
        self._recovery = Recovery(self, self.recovery)
        self._table_saves = TableSaves(self, self._recovery)
        self.metrics = metrics
        self._metrics: Optional[TrainerMetrics] = None

    @property
    def pipeline(self) -> Optional[EmbeddingPipeline]:
        """The rank's embedding pipeline (set up with the model; None before, or without remote tables)."""
        return self._pipeline

    @property
    def embedding_worker_pids(self) -> list[int]:
        """The process ids of this rank's embedding workers (none before setup, or with ``embedding_workers.count=0``)."""
        return self._workers.pids if self._workers is not None else []

    @property
    def embedding_workers_restarted(self) -> int:
        """How many times one of this rank's embedding workers died and was started again (``EmbeddingWorkerSettings.restarts``)."""
        return self._workers.restarted if self._workers is not None else 0

    @property
    def metrics_url(self) -> Optional[str]:
        """Where this rank serves its Prometheus metrics (set up with the environment; None without ``metrics``)."""
        return self._metrics.url if self._metrics is not None else None

    @property
    def rollbacks(self) -> list[RollbackEvent]:
        """The rollbacks of this run so far (when, where, why, to which checkpoint, how long)."""
        return list(self._recovery.events)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # The checkpoint's PS files are loaded through the client, which exists only after setup.
        return True

    # ---- connection to the parameter server ---------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.metrics is not None and self._metrics is None:  # before connecting: its PS calls count too
            ranks = {"global_rank": str(self.global_rank), "local_rank": str(self.local_rank), "node_rank": str(self.node_rank)}
            self._metrics = TrainerMetrics(self.metrics.host, self.metrics.port_of(self.local_rank), self._metric_figures, ranks)
        if self.client is None:
            self._connect()

    def _metric_figures(self) -> dict[str, float]:
        pipeline = self._pipeline
        return {"rollbacks": len(self._recovery.events),
                "dropped_nonfinite_rows": pipeline.dropped_nonfinite_rows if pipeline is not None else 0,
                "prefetch_misses": pipeline.prefetch_misses if pipeline is not None else 0}

    def _connect(self) -> None:
        addresses: Union[list[str], str, None] = self.ps.addresses
        if addresses is None:
            if self.global_rank == 0:
                rank_zero_info(f"PersiaStrategy: starting {self.ps.num_local_shards} embedded parameter-server shards on this machine")
                try:
                    self._cluster = LocalCluster(
                        self.ps.num_local_shards, seed=self.ps.seed, config_path=self.ps.config,
                        restart=self.recovery.enabled and self.recovery.restart_local_shards, max_restarts=self.recovery.max_local_restarts,
                    )
                    addresses = self._cluster.addresses
                except Exception as error:  # every rank must leave the broadcast, then raise
                    addresses = f"embedded parameter server failed to start: {error}"
            addresses = self.broadcast(addresses)
            if isinstance(addresses, str):
                raise RuntimeError(addresses)
        self.client = PSClient(addresses, token=self.ps.token, tls_root_cert=self.ps.tls_root_cert, retry=self.recovery.retry_policy(self.ps.timeout_s),
                               interceptors=[self._metrics.client_interceptor] if self._metrics is not None else ())
        self._recovery.attach(self.client, None, self._cluster)
        self.client.wait_healthy(self.ps.timeout_s, on_wait=_report_wait, report_every_s=WAIT_REPORT_INTERVAL_S)
        self.client.refresh_map()  # a cluster scaled before this trainer started routes by a newer map than its own

    # ---- model ------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        if not any(isinstance(m, RemoteModule) for m in self.model.modules()):
            self._swap_embedding_modules(_raw_id_features(trainer))
        self.data_parallel_tables = [m for m in self.model.modules() if isinstance(m, DataParallelTables)]
        self._announce()
        if self.world_size == 1:
            keep_the_users_samplers(trainer)
        super().setup(trainer)

    def _announce(self) -> None:
        """Says where the tables live, as Lightning announces its cluster environment."""
        assert self.client is not None
        mode = "embedded parameter server (shards started here)" if self.ps.embedded else "remote parameter server"
        shards = ", ".join(f"shard {shard} at {address}" for shard, address in enumerate(self.client.addresses))
        remote = [t.name for m in self.remote_modules for t in m.remote_tables]
        kept = [c.name for tables in self.data_parallel_tables for c in tables.configs]
        excluded = f"; modules left to DDP (exclude): {', '.join(self.exclude)}" if self.exclude else ""
        rank_zero_info(
            f"PersiaStrategy: {mode}: {shards} (shard map version {self.client.shard_map.version})\n"
            f"PersiaStrategy: {len(remote)} tables on the shards ({_names(remote)}); {len(kept)} kept on the trainers "
            f"({_names(kept)}){excluded}; staleness {self.staleness}\n"
            f"PersiaStrategy: pooled lookups on {self.root_device}: {kernel_in_use(self.root_device.type)}"
        )

    def _swap_embedding_modules(self, raw_features: tuple[str, ...]) -> None:
        assert self.model is not None and self.client is not None
        defaults = dataclasses.replace(self.table_defaults, raw_features=raw_features)
        twins = intercept(self.model, self.intercept_kinds, self.exclude, defaults, seed=self.ps.seed)
        self.remote_modules = [m for m in twins if m.remote_tables]
        if not self.remote_modules:
            log.warning("PersiaStrategy found no embedding table to serve remotely; training runs as plain DDP")
        self.client.configure([t.config for m in self.remote_modules for t in m.remote_tables])
        dims = {t.name: t.dim for m in self.remote_modules for t in m.remote_tables}
        rank_merge = None
        if self.merge_rank_gradients and self.world_size > 1 and dims:
            sender = self.broadcast(f"{self.client.client_id}-merged")
            rank_merge = RankMerge(sender, dims, timeout=self._timeout)
        # A wait for rows or for the staleness window lasts as long as the call it waits for may, retries included
        # (RecoveryConfig.wait_for_shards_s): a shard coming back in that time costs a pause, not the run.
        client, budget_s = self.client, self.client.call_budget_s
        if self.embedding_workers.count and dims:
            self._workers = EmbeddingWorkers(
                self.embedding_workers.count, client.addresses, dims, client.retry, lambda: client.incarnations, token=self.ps.token,
                tls_root_cert=self.ps.tls_root_cert, rank=self.global_rank, start_timeout_s=self.embedding_workers.start_timeout_s,
                timeout_s=budget_s, on_calls=self._metrics.client_interceptor.record if self._metrics is not None else None,
                restarts=self.embedding_workers.restarts)
            self._pipeline = EmbeddingPipeline(self._workers, self.staleness, self.wire_dtype, self.root_device, timeout_s=budget_s,
                                               rank_merge=rank_merge, dedup=WorkerDeduplication(self._workers))
        else:
            self._pipeline = EmbeddingPipeline(client, self.staleness, self.wire_dtype, self.root_device, timeout_s=budget_s, rank_merge=rank_merge)
        # Lightning moves each batch to the device as a whole; a module that overrides one of these hooks may change it.
        self._pipeline.batches_arrive_unchanged = not any(
            is_overridden(hook, self.lightning_module) for hook in ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
        )
        for module in self.remote_modules:
            self._pipeline.register(module.planner)
            module.row_source = self._pipeline
        self._recovery.attach(self.client, self._pipeline, self._cluster)

    @override
    def configure_ddp(self) -> None:
        # DDP refuses a model without trainable parameters (with every table remote there may be none left),
        # and with one process it only adds a gradient copy and hooks to every step.
        if self.world_size == 1 or not any(p.requires_grad for p in self.model.parameters()):
            log.info("PersiaStrategy: %s, DDP is skipped", "one process" if self.world_size == 1 else "no dense parameter to synchronise")
            return
        # The twins' buffers are identical on every rank by construction (constants, and the kept tables' rule
        # state, updated from all-reduced gradients): DDP need not broadcast them before every forward.
        buffers = [f"{path}.{name}" for path, module in self.model.named_modules() if isinstance(module, RemoteModule)
                   for name, _ in module.named_buffers()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self.model, buffers)
        super().configure_ddp()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._pipeline is None or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        loader = PrefetchingLoader(dataloader, self._pipeline)
        self._loaders.append(loader)
        return loader

    # ---- the hybrid step --------------------------------------------------------------------------------

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._pipeline is not None:
            self._pipeline.begin_step(batch)
            self._recovery.check("train")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        trainer = self.lightning_module.trainer
        # five log calls a step cost milliseconds of the trainer's CPU: the figures go out on the logging steps only
        logging_step = self.log_embedding_metrics and (trainer.global_step + 1) % max(trainer.log_every_n_steps, 1) == 0
        if self._pipeline is not None and (logging_step or self._metrics is not None):
            metrics = self._pipeline.step_metrics()
            if metrics and logging_step:
                self.lightning_module.log_dict({f"persia/{k}": v for k, v in metrics.items()}, on_step=True, on_epoch=False, batch_size=1)
            if self._metrics is not None:
                self._metrics.observe_step(metrics)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        trainer = self.lightning_module.trainer
        where = "sanity check" if trainer.sanity_checking else "validation"
        return self._recovery.evaluate(lambda: super(PersiaStrategy, self).validation_step(*args, **kwargs), where)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        scale = self._embedding_gradient_scale()
        if self._pipeline is not None:
            self._pipeline.finish_step(scale)
        # Inside DDP's no_sync (all micro-batches of an accumulation but the last) a gradient is this rank's
        # own: it stays and accumulates until DDP all-reduces the sum with the last micro-batch's backward.
        if isinstance(self.model, DistributedDataParallel) and not self.model.require_backward_grad_sync:
            return
        for tables in self.data_parallel_tables:  # DDP has averaged their gradients over the ranks already
            tables.apply_gradients(scale * self.world_size)

    def _embedding_gradient_scale(self) -> Union[float, Tensor]:
        """What each rank's embedding gradient is multiplied by before it leaves: ``1 / world_size`` (averaged
        gradients) over the AMP loss scale. The loss scale stays a tensor on the device when it is one there:
        ``GradScaler.get_scale()`` would wait for the device in every step, so its tensor is read
        (``_get_scale_async``, torch's own name for this value) and the gradient is divided on the device."""
        scale = 1.0 / self.world_size if self.average_embedding_gradients else 1.0
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            on_device = scaler._get_scale_async()
            if on_device is not None and on_device.device.type != "cpu":
                return scale / on_device  # gradients leave the trainer unscaled
            scale /= float(scaler.get_scale())
        return scale

    def _drain(self) -> None:
        if self._pipeline is not None:
            self._pipeline.drain()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._drain()
        self._recovery.check("validation")
        if self._pipeline is not None:
            trainer = self.lightning_module.trainer
            counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
            total = sum(counts)
            self._recovery.begin_evaluation(int(total) if math.isfinite(total) else None)

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._drain()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._drain()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._close_loaders()
        self._drain()
        if self._pipeline is not None:  # a failure in the last steps: the run ends on a consistent state
            self._recovery.check("end of training")

    def _close_loaders(self) -> None:
        for loader in self._loaders:
            loader.close()
        self._loaders.clear()

    # ---- checkpoints --------------------------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Saves the shards' state beside the ``.ckpt`` (in ``<file>.ps/``, a path or an ``fsspec`` URL), consistent
        with the same step."""
        ps_dir = self._table_saves.save(filepath, checkpoint) if self.client is not None and self.remote_modules else None
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if ps_dir is not None:
            self._table_saves.saved(filepath, ps_dir)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Loads the dense state, and the shards' state from ``<file>.ps/`` (also into another shard count)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._table_saves.load(checkpoint_path, checkpoint)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            ps_checkpoint.remove(f"{filepath}.ps")

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        if self.remote_modules:
            state[ps_checkpoint.TABLES_ELSEWHERE_KEY] = ps_checkpoint.tables_elsewhere_marker()
        return state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        state = checkpoint["state_dict"]
        if ps_checkpoint.TABLES_ELSEWHERE_KEY in state:
            checkpoint = {**checkpoint, "state_dict": {k: v for k, v in state.items() if k != ps_checkpoint.TABLES_ELSEWHERE_KEY}}
        super().load_model_state_dict(checkpoint, strict=strict)

    # ---- the shards ------------------------------------------------------------------------------------

    def scale_shards(self, num_shards: int, *, wait: bool = True) -> "ScaleReport | Future[ScaleReport] | None":
        """Grows or drains the embedded parameter server to ``num_shards`` shards while training runs: slots move to
        their new owners live, and the trainers route by the new map (``docs/elastic.md``). ``wait=False`` returns a
        ``Future`` at once and training goes on during the move (requests follow the new map as the shards answer
        with it); ``wait=True`` returns the move's report when it is done.

        With several ranks, call it on every rank (as a callback runs) or on rank 0 alone: rank 0 runs the move,
        the others return None and follow the new map as the shards answer with it (rank 0 alone pushes the merged
        update, so each step's update is routed by one map). With ``wait=True`` the other ranks wait for rank 0 in
        the next step's collectives, which fail after the strategy's ``timeout``: a longer move needs ``wait=False``.
        A cluster given by address is scaled by whoever runs it (``lightning-persia ps scale``).
        """
        if not self.ps.embedded or self.client is None:
            raise RuntimeError("scale_shards grows or drains the embedded shards, which this strategy did not start "
                               "(ps.addresses is set): scale that cluster with `lightning-persia ps scale`")
        if self._cluster is None:  # not rank 0: its shards are rank 0's to move
            return None
        if not wait:
            moving = self._cluster.start_rescale(num_shards, token=self.ps.token)
            moving.add_done_callback(_report_scaled)
            return moving
        report = self._cluster.rescale(num_shards, token=self.ps.token)
        self.client.refresh_map()
        _report_scale(report)
        return report

    # ---- teardown ----------------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        # The connection and an embedded cluster stay up: a later trainer.test() must see the trained tables.
        self._close_loaders()
        self._drain()
        module = self.lightning_module
        if module is None or not _holds_meta_tensors(module):
            super().teardown()
            return
        # The start failed before setup() swapped the embedding modules: their tables are still declared on the
        # meta device and nothing was moved to a device yet. Lightning's teardown moves the module to the CPU,
        # which a meta tensor refuses; that error would replace the one that stopped the start. The rest of the
        # teardown runs without the module.
        self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # Lightning re-raises ``exception`` after this hook and the teardown: an error while cleaning up would be
        # chained to it and printed last, in its place. It is reported here, and the original goes on.
        try:
            self._close_loaders()
            self.close()
        except Exception as error:
            log.warning("PersiaStrategy: cleaning up after %s failed: %s: %s", type(exception).__name__, type(error).__name__, error)

    def close(self) -> None:
        """Stops the embedding workers, disconnects from the shards and stops the embedded cluster, if this rank started one."""
        pipeline, workers, client, cluster, metrics = self._pipeline, self._workers, self.client, self._cluster, self._metrics
        self._pipeline = self._workers = self.client = self._cluster = self._metrics = None
        try:
            if pipeline is not None:
                pipeline.close()
            if workers is not None:
                workers.close()
            if client is not None:
                client.close()
        finally:  # the shards and the metrics server stop whatever failed before
            if cluster is not None:
                cluster.stop()
            if metrics is not None:
                metrics.stop()


def _report_scaled(moving: "Future[ScaleReport]") -> None:
    if moving.exception() is not None:
        log.warning("PersiaStrategy: rescaling the embedded shards failed, they stay on the map of the last wave that "
                    "went through: %s", moving.exception())
    else:
        _report_scale(moving.result())


def _report_scale(report: ScaleReport) -> None:
    rank_zero_info(f"PersiaStrategy: {report.from_shards} -> {report.to_shards} shards (shard map version "
                   f"{report.map_version}): {report.slots_moved} slots, {report.rows_moved} rows moved in "
                   f"{report.seconds:.1f} s in {report.waves} waves; requests for a wave's slots waited "
                   f"{report.fenced_seconds * 1e3:.0f} ms at most")


def _report_wait(wait: ShardWait) -> None:
    rank_zero_info(
        f"PersiaStrategy: waiting for parameter-server shard {wait.shard} at {wait.address}: {wait.waited_s:.0f} s of "
        f"ps.timeout_s={wait.timeout_s:g} so far ({wait.last_error})"
    )


def _names(names: list[str]) -> str:
    return ", ".join(names) if names else "none"


def _holds_meta_tensors(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


# The one registration of "persia" (Lightning calls ``register_strategies`` of its own strategies only).
StrategyRegistry.register(
    PersiaStrategy.strategy_name, PersiaStrategy, description="PERSIA hybrid training: embeddings on PS shards, dense with DDP", override=True
)


def _raw_id_features(trainer: "pl.Trainer") -> tuple[str, ...]:
    """The features the trainer's data module gives as vocabulary ids (its ``transform``), which the tables kept on
    the trainers index directly; none without such a data module."""
    transform = getattr(trainer.datamodule, "transform", None)
    return transform.raw_features if isinstance(transform, DataTransform) else ()

