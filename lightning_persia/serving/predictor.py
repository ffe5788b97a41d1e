"""``Predictor``: a bundle's LightningModule answering batches without a Trainer, its tables on read-only shards."""
from __future__ import annotations

import importlib
import inspect
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import instantiate_module
from safetensors.torch import load_file

from lightning_persia.embedding.data_parallel import DataParallelTables
from lightning_persia.read_write_lock import ReadWriteLock
from lightning_persia.remote_ps.client import PSClient, PSError, RetryPolicy
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.table_config import TableConfig
from lightning_persia.serving.bundle import DENSE_FILE, Bundle, BundleError
from lightning_persia.serving.delta import Delta, DeltaError, DeltaWatcher, delta_path
from lightning_persia.serving.row_source import ReadOnlyRowSource, kjt_features, remote_table_dims
from lightning_persia.strategy.interception import TableDefaults, TableOverride, intercept

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prediction:
    """What ``predict_step`` returned for a batch, and the model version that computed all of it."""

    output: Any
    version: int


class ServingError(RuntimeError):
    """The predictor cannot answer: its shards are between two versions (a commit failed on some of them)."""


class Predictor:
    """Runs a bundle's module (``predict_step``, as ``trainer.predict`` does) with its tables on inference shards.

    The module is rebuilt from the bundle, its embedding modules are swapped for the same remote twins the
    training strategy used, and the twins read their rows with evaluation lookups (an id the tables never
    saw reads its deterministic initial row; nothing is inserted). Without ``ps_addresses`` the predictor
    starts its own read-only shards on this machine (``lightning-persia ps serve --read-only --restore-from
    BUNDLE``) and stops them in :meth:`close`.

    **Versions.** With ``deltas`` (the folder :class:`~lightning_persia.serving.PublishDeltas` writes into) the
    predictor applies the versions published there, strictly in order, first every one published so far, then
    each new one as it appears (polled every ``watch_interval_s``). A version is applied in two steps: every
    shard *stages* it (reads and checks its files) while predictions go on; then, between two predictions
    (a reader-writer lock: predictions are readers, the switch is the writer), every shard *commits* it and the
    module takes its dense weights. So every :class:`Prediction` is computed entirely by one version, and names
    it. A delta that is refused (corrupted, truncated, out of order) is logged naming the file; the predictor
    keeps serving its last good version. ``version`` stops at that version: the bundle plus the deltas up to it
    (a rollback).

    Example::

        with Predictor.from_bundle("runs/dlrm/bundle", deltas="runs/dlrm/deltas") as predictor:
            prediction = predictor.predict(batch)      # = trainer.predict's output at version prediction.version
    """

    def __init__(self, module: LightningModule, version: int, bundle: Bundle, client: PSClient, shards: Optional[LocalShards] = None) -> None:
        self._module = module
        self._version = version
        self._bundle = bundle
        self._client = client
        self._shards = shards
        self._lock = ReadWriteLock()
        self._watcher: Optional[DeltaWatcher] = None
        self._uncommitted: Optional[tuple[int, dict[str, torch.Tensor]]] = None  # a version committed on some shards only

    @classmethod
    def from_bundle(
        cls,
        path: str | os.PathLike,
        ps_addresses: Optional[Sequence[str]] = None,
        *,
        num_shards: Optional[int] = None,
        wire_dtype: Optional[str] = None,
        device: str | torch.device = "cpu",
        token: Optional[str] = None,
        tls_root_cert: Optional[str] = None,
        timeout_s: float = 30.0,
        startup_timeout_s: float = 120.0,
        deltas: Optional[str | os.PathLike] = None,
        version: Optional[int] = None,
        watch_interval_s: Optional[float] = 1.0,
    ) -> "Predictor":
        """The predictor of the bundle at ``path``.

        Args:
            ps_addresses: ``host:port`` of inference shards already serving this bundle, in shard order; ``None``
                starts ``num_shards`` of them here (default: as many as trained the tables).
            wire_dtype: ``"fp16"`` or ``"fp32"`` rows on the wire (default: the training strategy's).
            device: where the module runs.
            token, tls_root_cert: for shards started with a token or TLS.
            timeout_s: deadline of one lookup.
            deltas: the folder of versioned deltas to apply (see the class docstring).
            version: apply the deltas up to this version only, and no later one (default: follow the newest).
            watch_interval_s: how often to look for a new version; ``None``: only when :meth:`refresh` is called.

        Raises:
            BundleError: the bundle is damaged, or its module, weights or tables do not fit together or do not
                match the shards at ``ps_addresses``; with ``version``, a delta up to it is missing or refused
                (:class:`~lightning_persia.serving.delta.DeltaError`).
        """
        bundle = Bundle.open(path)
        bundle.verify([DENSE_FILE])
        if version is not None and version != bundle.version and deltas is None:
            raise BundleError(f"version {version} of {bundle.path} (version {bundle.version}) needs the folder of its deltas")
        device = torch.device(device)
        module = _build_module(bundle)
        twins = _swap_embedding_modules(module, bundle)
        try:
            module.load_state_dict(load_file(str(bundle.dense_path)), strict=True)
        except RuntimeError as err:
            raise BundleError(f"the dense weights of {bundle.path} do not fit the rebuilt {bundle.module_class_path}: {err}") from None
        shards = None
        client = None
        try:
            if ps_addresses is None:
                shards = LocalShards(
                    num_shards or bundle.num_shards, extra_args=["--read-only", "--restore-from", str(bundle.path)],
                    startup_timeout_s=startup_timeout_s,
                )
                ps_addresses = shards.addresses
            client = PSClient(list(ps_addresses), token=token, tls_root_cert=tls_root_cert, retry=RetryPolicy(timeout_s=timeout_s))
            client.wait_healthy(startup_timeout_s)
            _check_shard_tables(client, twins, bundle)
            served = _shard_version(client, bundle, following=deltas is not None)
        except BaseException:
            if client is not None:
                client.close()
            if shards is not None:
                shards.stop()
            raise
        ReadOnlyRowSource(client, wire_dtype or bundle.wire_dtype, device, timeout_s=timeout_s).bind(twins)
        module.to(device).eval()
        predictor = cls(module, bundle.version, bundle, client, shards)
        try:
            if deltas is not None:
                predictor._follow(Path(deltas), served, version, watch_interval_s)
        except BaseException:
            predictor.close()
            raise
        log.info("serving %s version %d from %s on shards %s", bundle.module_class_path, predictor.version, bundle.path, client.addresses)
        return predictor

    # ---- what it serves ----------------------------------------------------------------------------

    @property
    def module(self) -> LightningModule:
        return self._module

    @property
    def version(self) -> int:
        """The version every prediction now starting computes with."""
        return self._version

    @property
    def bundle(self) -> Bundle:
        return self._bundle

    @property
    def ps_addresses(self) -> list[str]:
        return list(self._client.addresses)

    @property
    def sparse_features(self) -> list[str]:
        """The KeyedJaggedTensor keys the module's TorchRec twins read, in module order."""
        return kjt_features(self.module)

    @property
    def raw_id_rows(self) -> dict[str, int]:
        """The rows of the kept table each raw-id feature indexes directly (an id must lie in ``[0, rows)``)."""
        return {feature: rows for tables in self.module.modules() if isinstance(tables, DataParallelTables)
                for feature, rows in tables.raw_feature_rows().items()}

    # ---- predictions ---------------------------------------------------------------------------------

    def predict(self, batch: Any) -> Prediction:
        """``predict_step(batch, 0)`` in evaluation mode without autograd, after the module's batch-transfer hooks.

        Raises :class:`ServingError` while the shards are between two versions (a commit that failed on some).
        """
        with self._lock.reading():
            if self._uncommitted is not None:
                raise ServingError(f"version {self._uncommitted[0]} is committed on some inference shards only; predictions "
                                   "wait until the commit is retried (at the next look for deltas)")
            module, version = self._module, self._version
            with torch.inference_mode():
                batch = module.on_before_batch_transfer(batch, 0)
                batch = module.transfer_batch_to_device(batch, module.device, 0)
                batch = module.on_after_batch_transfer(batch, 0)
                output = module.predict_step(batch, 0)
        return Prediction(output, version)

    # ---- versions --------------------------------------------------------------------------------------

    def refresh(self) -> int:
        """Applies the versions published since the last look (refusals are logged); returns the version served."""
        if self._watcher is None:
            raise RuntimeError("this predictor follows no deltas (Predictor.from_bundle(..., deltas=DIR))")
        return self._watcher.catch_up()

    def _follow(self, root: Path, served: int, up_to: Optional[int], interval_s: Optional[float]) -> None:
        if up_to is not None and served > up_to:
            raise BundleError(f"the shards at {self._client.addresses} serve version {served}, later than version {up_to}: "
                              f"restart them from the bundle {self._bundle.path} to roll back")
        if served != self._version:  # external shards that an earlier endpoint moved on: take that version's weights
            delta = Delta.open(delta_path(root, served))
            delta.verify([DENSE_FILE])
            self._switch(delta.version, self._dense_weights(delta))
        self._watcher = DeltaWatcher(root, lambda: self._version, self._apply, up_to=up_to, interval_s=interval_s or 1.0,
                                     name=f"predictor of {self._bundle.path.name}")
        self._watcher.catch_up(strict=up_to is not None)
        if up_to is None and interval_s is not None:
            self._watcher.start()

    def _apply(self, delta: Delta) -> None:
        """Stages ``delta`` on every shard while predictions go on, then commits it between two of them."""
        if self._uncommitted is not None and self._uncommitted[0] == delta.version:  # staged everywhere, committed on some
            state = self._uncommitted[1]
        else:
            state = self._dense_weights(delta)
            self._client.stage_delta(delta.tables_path, delta.version, delta.base_version)
        with self._lock.writing():
            try:
                self._client.commit_delta(delta.version)
            except PSError:
                self._uncommitted = (delta.version, state)
                raise
            self._switch(delta.version, state)

    def _switch(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self._module.load_state_dict(state, strict=True)
        self._version, self._uncommitted = version, None

    def _dense_weights(self, delta: Delta) -> dict[str, torch.Tensor]:
        state = load_file(str(delta.dense_path))
        expected = {name: tuple(value.shape) for name, value in self._module.state_dict().items()}
        found = {name: tuple(value.shape) for name, value in state.items()}
        if found != expected:
            wrong = sorted(set(expected) ^ set(found)) or sorted(n for n in expected if expected[n] != found[n])
            raise DeltaError(f"{delta.dense_path} does not hold the weights of {self._bundle.module_class_path} "
                             f"(names or shapes differ: {wrong[:5]}): is it a delta of another model?")
        return state

    def close(self) -> None:
        """Stops following deltas, disconnects, and stops the shards this predictor started."""
        if self._watcher is not None:
            self._watcher.stop()
        self._client.close()
        if self._shards is not None:
            self._shards.stop()
            self._shards = None

    def __enter__(self) -> "Predictor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _build_module(bundle: Bundle) -> LightningModule:
    class_path = bundle.module_class_path
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise BundleError(f"cannot import the module class {class_path!r} of {bundle.path}: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, LightningModule)):
        raise BundleError(f"{class_path!r} of {bundle.path} is not a LightningModule")
    init_args = bundle.module_init_args
    parameters = inspect.signature(cls.__init__).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        names = {p.name for p in parameters}
        init_args = {k: v for k, v in init_args.items() if k in names}  # as load_from_checkpoint does
    try:
        return instantiate_module(cls, {"_class_path": class_path, **init_args})
    except Exception as err:  # whatever the module's __init__ or the argument parser raises
        raise BundleError(f"cannot rebuild {class_path} from {bundle.path}: {type(err).__name__}: {err}") from None


def _swap_embedding_modules(module: LightningModule, bundle: Bundle) -> list:
    """The strategy's swap of the embedding modules, replayed with the table configs it recorded."""
    record = bundle.interception
    configs = [TableConfig.from_dict(spec) for spec in record["tables"].values()]
    overrides = {c.name: TableOverride.of(c) for c in configs}
    transform = bundle.data_transform  # its raw features index kept tables directly, as in training
    defaults = TableDefaults(overrides=overrides, data_parallel_max_rows=record["data_parallel_max_rows"],
                             raw_features=() if transform is None else transform.raw_features)
    try:
        twins = intercept(module, record["intercept"], record["exclude"], defaults, seed=record["seed"])
    except ValueError as err:
        raise BundleError(f"the rebuilt {bundle.module_class_path} does not have the tables of {bundle.path}: {err}") from None
    remote = sorted(remote_table_dims(twins))
    if remote != sorted(bundle.remote_tables):
        raise BundleError(
            f"the rebuilt {bundle.module_class_path} reads remote tables {remote}, the bundle {bundle.path} holds "
            f"{sorted(bundle.remote_tables)}: was it exported with the configuration it was trained with?"
        )
    return twins


def _check_shard_tables(client: PSClient, twins: list, bundle: Bundle) -> None:
    served = client.describe()
    for name, dim in remote_table_dims(twins).items():
        config = served.get(name)
        if config is None or config.dim != dim:
            found = f"dim {config.dim}" if config is not None else "no such table"
            raise BundleError(
                f"the shards at {client.addresses} do not serve table {name!r} (dim {dim}) of {bundle.path} "
                f"({found}); start them with: lightning-persia ps serve --read-only --restore-from {bundle.path} ..."
            )


def _shard_version(client: PSClient, bundle: Bundle, following: bool) -> int:
    """The model version the shards serve (all the same, the bundle's or, when following deltas, a later one)."""
    servers = [shard["server"] for shard in client.stats()]
    versions = sorted({server.get("model_version", 0) for server in servers})
    watching = [f"{client.addresses[i]} ({server['watching_deltas']})" for i, server in enumerate(servers) if server.get("watching_deltas")]
    if watching:
        raise BundleError(f"the shards {', '.join(watching)} apply deltas on their own (--watch-deltas), so the dense weights "
                          "here would not follow them: a predictor drives its shards (start them without --watch-deltas, "
                          "and give the predictor the deltas)")
    if len(versions) > 1:
        raise BundleError(f"the shards at {client.addresses} serve different versions {versions}: restart them from {bundle.path}")
    version = versions[0]
    if version == bundle.version or (version == 0 and not following):  # 0: restored from a checkpoint, not a bundle
        return bundle.version
    if following and version > bundle.version:
        return version
    raise BundleError(f"the shards at {client.addresses} serve version {version}, the bundle {bundle.path} is version "
                      f"{bundle.version}: start them with --restore-from {bundle.path}"
                      + ("" if following else ", or give the folder of the deltas that made their version"))
