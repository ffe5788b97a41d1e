"""``Predictor``: a bundle's LightningModule answering batches without a Trainer, its tables on read-only shards."""
from __future__ import annotations

import importlib
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import instantiate_module
from safetensors.torch import load_file

from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.server import LocalShards
from lightning_persia.remote_ps.table_config import TableConfig
from lightning_persia.serving.bundle import DENSE_FILE, Bundle, BundleError
from lightning_persia.serving.row_source import ReadOnlyRowSource, kjt_features, remote_table_dims
from lightning_persia.strategy.interception import TableDefaults, TableOverride, intercept

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prediction:
    """What ``predict_step`` returned for a batch, and the model version that computed all of it."""

    output: Any
    version: int


@dataclass(frozen=True)
class _Served:
    """One model version: the module and its number, read together by every prediction."""

    module: LightningModule
    version: int


class Predictor:
    """Runs a bundle's module (``predict_step``, as ``trainer.predict`` does) with its tables on inference shards.

    The module is rebuilt from the bundle, its embedding modules are swapped for the same remote twins the
    training strategy used, and the twins read their rows with evaluation lookups (an id the tables never
    saw reads its deterministic initial row; nothing is inserted). Without ``ps_addresses`` the predictor
    starts its own read-only shards on this machine (``lightning-persia ps serve --read-only --restore-from
    BUNDLE``) and stops them in :meth:`close`.

    Every :class:`Prediction` names the version that computed it: the module and its version are read once
    per call, so replacing them (with a newer version) never mixes two versions in one answer.

    Example::

        with Predictor.from_bundle("runs/dlrm/bundle") as predictor:
            scores = predictor.predict(batch).output      # = trainer.predict's output for the batch
    """

    def __init__(self, served: _Served, bundle: Bundle, client: PSClient, shards: Optional[LocalShards] = None) -> None:
        self._served = served
        self._bundle = bundle
        self._client = client
        self._shards = shards

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
    ) -> "Predictor":
        """The predictor of the bundle at ``path``.

        Args:
            ps_addresses: ``host:port`` of inference shards already serving this bundle, in shard order; ``None``
                starts ``num_shards`` of them here (default: as many as trained the tables).
            wire_dtype: ``"fp16"`` or ``"fp32"`` rows on the wire (default: the training strategy's).
            device: where the module runs.
            token, tls_root_cert: for shards started with a token or TLS.
            timeout_s: deadline of one lookup.

        Raises:
            BundleError: the bundle is damaged, or its module, weights or tables do not fit together or do not
                match the shards at ``ps_addresses``.
        """
        bundle = Bundle.open(path)
        bundle.verify([DENSE_FILE])
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
            client = PSClient(list(ps_addresses), token=token, tls_root_cert=tls_root_cert, timeout_s=timeout_s)
            client.wait_healthy(startup_timeout_s)
            _check_shard_tables(client, twins, bundle)
        except BaseException:
            if client is not None:
                client.close()
            if shards is not None:
                shards.stop()
            raise
        ReadOnlyRowSource(client, wire_dtype or bundle.wire_dtype, device, timeout_s=timeout_s).bind(twins)
        module.to(device).eval()
        log.info("serving %s version %d from %s on shards %s", bundle.module_class_path, bundle.version, bundle.path, client.addresses)
        return cls(_Served(module, bundle.version), bundle, client, shards)

    # ---- what it serves ----------------------------------------------------------------------------

    @property
    def module(self) -> LightningModule:
        return self._served.module

    @property
    def version(self) -> int:
        return self._served.version

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

    # ---- predictions ---------------------------------------------------------------------------------

    def predict(self, batch: Any) -> Prediction:
        """``predict_step(batch, 0)`` in evaluation mode without autograd, after the module's batch-transfer hooks."""
        served = self._served
        module = served.module
        with torch.inference_mode():
            batch = module.on_before_batch_transfer(batch, 0)
            batch = module.transfer_batch_to_device(batch, module.device, 0)
            batch = module.on_after_batch_transfer(batch, 0)
            output = module.predict_step(batch, 0)
        return Prediction(output, served.version)

    def close(self) -> None:
        """Disconnects, and stops the shards this predictor started."""
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
    overrides = {
        c.name: TableOverride(optimizer=c.optimizer, init=c.init, capacity=c.capacity, eviction=c.eviction,
                              admit_probability=c.admit_probability, weight_bound=c.weight_bound)
        for c in configs
    }
    defaults = TableDefaults(overrides=overrides, data_parallel_max_rows=record["data_parallel_max_rows"])
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
