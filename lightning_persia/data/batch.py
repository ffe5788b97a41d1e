"""The batch every data module of this package yields, and the featurisation the Criteo-shaped sources share.

A batch holds the sparse features as a TorchRec ``KeyedJaggedTensor`` (one key per categorical feature; per row a
bag of ids: one for a one-hot feature, several for a multi-hot one, none for a null read as raw ids), the dense
features as a ``[B, num_dense]`` float32 tensor and the labels as a ``[B]`` float32 tensor.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.ops.hashing import mix64

_POSITIVE = (1 << 63) - 1
_MISSING_BIT = 1 << 32
_FEATURE_SHIFT = 33
_WIDE_SALT = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: salts the wide values apart from the 32-bit ones


@dataclass
class CriteoBatch:
    """One batch: ``sparse_features`` (KJT), ``dense_features`` (``[B, D]`` float32) and ``labels`` (``[B]`` float32).

    Lightning moves it with :meth:`to` (``transfer_batch_to_device`` treats any object with a ``to`` method as
    transferable) and a ``DataLoader(pin_memory=True)`` pins it with :meth:`pin_memory`.
    """

    sparse_features: KeyedJaggedTensor
    dense_features: Tensor
    labels: Tensor

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "CriteoBatch":
        """A copy on ``device`` (tensors already there are not copied)."""
        device = torch.device(device)
        return CriteoBatch(
            sparse_features=self.sparse_features.to(device, non_blocking=non_blocking),
            dense_features=self.dense_features.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "CriteoBatch":
        """A copy in pinned host memory (called by ``DataLoader(pin_memory=True)``)."""
        return CriteoBatch(
            sparse_features=self.sparse_features.pin_memory(),
            dense_features=self.dense_features.pin_memory(),
            labels=self.labels.pin_memory(),
        )

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    def __len__(self) -> int:
        return self.batch_size

    def sparse_ids(self) -> Tensor:
        """The sparse ids as a ``[B, F]`` tensor (valid only when every feature has one id per row, as here)."""
        return self.sparse_features.values().view(len(self.sparse_features.keys()), -1).t()


def make_batch(
    sparse_ids: Tensor, dense: Tensor, labels: Tensor, feature_names: Sequence[str]
) -> CriteoBatch:
    """Build a :class:`CriteoBatch` from ``[B, F]`` int64 ids (one per row and feature), dense and labels."""
    batch, num_features = sparse_ids.shape
    if num_features != len(feature_names):
        raise ValueError(f"{num_features} sparse columns for {len(feature_names)} feature names")
    kjt = KeyedJaggedTensor(
        keys=list(feature_names),
        values=sparse_ids.t().contiguous().view(-1),
        lengths=torch.ones(batch * num_features, dtype=torch.int32),
        stride=batch,
    )
    return CriteoBatch(
        sparse_features=kjt,
        dense_features=dense.to(torch.float32).contiguous(),
        labels=labels.to(torch.float32).contiguous(),
    )


def hash_categorical(values: Tensor, missing: Optional[Tensor] = None) -> Tensor:
    """Stable, collision-free int64 ids of ``[B, F]`` int64 categorical values (column ``f`` = feature ``f``).

    The id of a 32-bit value ``v`` (in ``[0, 2**32)``) of feature ``f`` is ``mix64(((f + 1) << 33) | v)`` with the
    sign bit cleared; a missing value has the fixed id ``mix64(((f + 1) << 33) | 2**32)``. ``mix64`` is a bijection,
    so two (feature, value) pairs (missing included) never share an id apart from the cleared sign bit (a chance of
    2**-63 per pair). Any other int64 (ids of ``2**32`` and more, negative ones such as Spark's signed ``xxhash64``)
    is mixed on its own first, ``mix64(mix64(v) ^ salt(f))``: a chance of 2**-63 per pair to meet another id. The
    result is a pure function of (feature index, value): the same in every process.
    """
    if values.dim() != 2:
        raise ValueError(f"expected [B, F] values, got shape {tuple(values.shape)}")
    feature = torch.arange(values.shape[1], dtype=torch.int64).unsqueeze(0)
    return _hash(values.to(torch.int64), feature, missing)


def hash_feature_ids(values: Tensor, feature: int, missing: Optional[Tensor] = None) -> Tensor:
    """:func:`hash_categorical`'s ids of any-shaped int64 ``values`` of the ``feature``-th feature (multi-hot bags);
    ``missing`` (same shape) marks nulls."""
    return _hash(values.to(torch.int64), torch.tensor(feature, dtype=torch.int64), missing)


def _hash(values: Tensor, feature: Tensor, missing: Optional[Tensor]) -> Tensor:
    narrow = (values >= 0) & (values < _MISSING_BIT)
    if missing is not None:
        values = torch.where(missing, torch.full_like(values, _MISSING_BIT), values)
        narrow = narrow | missing
    tagged = ((feature + 1) << _FEATURE_SHIFT) | torch.where(narrow, values, torch.zeros_like(values))
    ids = mix64(tagged)
    if not bool(narrow.all()):
        ids = torch.where(narrow, ids, mix64(mix64(values) ^ (tagged * _WIDE_SALT)))
    return ids & _POSITIVE


def string_key(value: str) -> int:
    """The int64 key of a string categorical value (its UTF-8's 8-byte blake2b), which ``ids: hash`` then hashes per
    feature as any other value."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little", signed=True)


def missing_ids(num_features: int) -> Tensor:
    """The id that :func:`hash_categorical` gives a missing value of each of ``num_features`` features."""
    return hash_categorical(
        torch.zeros(1, num_features, dtype=torch.int64), torch.ones(1, num_features, dtype=torch.bool)
    )[0]


def transform_dense(values: Tensor, missing: Optional[Tensor] = None) -> Tensor:
    """Criteo dense transform: missing -> 0, then ``log(1 + max(x, 0))``, as float32."""
    values = values.to(torch.float64)
    if missing is not None:
        values = values.masked_fill(missing, 0.0)
    return torch.log1p(values.clamp_min(0.0)).to(torch.float32)
