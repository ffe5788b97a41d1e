"""What a data module does to the values of its files before the model sees them: :class:`DataTransform`.

Every file-reading data module has an ``ids`` setting and a :attr:`transform` that records it, so that whoever
feeds the model later (the strategy's tables kept on the trainers, a serving endpoint given raw features) repeats
exactly what training saw:

* ``ids: raw``: the file's integers are the ids (vocabulary ids ``0..n-1`` as TorchRec's, MLPerf's and NVTabular's
  preprocessing write them, or any int64 key); a table kept on the trainers indexes its rows with them directly
  and an id outside ``[0, num_embeddings)`` is an error naming the feature. A null is a row without an id for the
  feature (an empty bag, pooled to zeros).
* ``ids: hash``: each value goes through :func:`~lightning_persia.data.batch.hash_categorical` (per feature, any
  int64; a null is the feature's "missing" id); a kept table folds the hashed ids into its rows modulo its size.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Literal, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from lightning_persia.data.batch import hash_feature_ids, transform_dense

IdMode = Literal["hash", "raw"]
ID_MODES: Tuple[str, ...] = ("hash", "raw")
#: ``log1p``: null -> 0, then ``log(1 + max(x, 0))`` (Criteo's); ``none``: null -> 0, values as stored.
DENSE_TRANSFORMS: Tuple[str, ...] = ("log1p", "none")
#: A data module's ``ids`` setting: one mode for every feature, or a mode per feature (the others: ``default``).
IdsSetting = Union[IdMode, Dict[str, IdMode]]


def resolve_ids(ids: IdsSetting, features: Sequence[str], default: str) -> Tuple[str, ...]:
    """The id mode of each of ``features`` from a data module's ``ids`` setting; raises naming a bad mode or an
    unknown feature."""
    if isinstance(ids, str):
        modes = {f: ids for f in features}
    else:
        unknown = sorted(set(ids) - set(features))
        if unknown:
            raise ValueError(f"ids names features the data has not: {unknown}; its features: {list(features)}")
        modes = {f: ids.get(f, default) for f in features}
    for feature, mode in modes.items():
        if mode not in ID_MODES:
            raise ValueError(f"ids of feature {feature!r} must be one of {ID_MODES}, got {mode!r}")
    return tuple(modes[f] for f in features)


@dataclass(frozen=True)
class DataTransform:
    """How a data module turns stored values into a batch (public: the strategy and serving read it).

    Attributes:
        sparse_features: the KJT's keys, in order (the ``f`` of :func:`hash_categorical` is a key's position).
        ids: the id mode of each sparse feature (``hash`` or ``raw``, see the module's doc).
        dense_features: the stored dense columns, in the order of ``batch.dense_features``.
        dense_transform: what is done to them: ``log1p`` or ``none`` (:data:`DENSE_TRANSFORMS`).
    """

    sparse_features: Tuple[str, ...]
    ids: Tuple[str, ...]
    dense_features: Tuple[str, ...]
    dense_transform: str

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.sparse_features):
            raise ValueError(f"{len(self.ids)} id modes for {len(self.sparse_features)} sparse features")
        bad = [m for m in self.ids if m not in ID_MODES]
        if bad:
            raise ValueError(f"id modes must be among {ID_MODES}, got {bad}")
        if self.dense_transform not in DENSE_TRANSFORMS:
            raise ValueError(f"dense_transform must be one of {DENSE_TRANSFORMS}, got {self.dense_transform!r}")

    @property
    def raw_features(self) -> Tuple[str, ...]:
        """The sparse features whose ids are used as they are."""
        return tuple(f for f, mode in zip(self.sparse_features, self.ids) if mode == "raw")

    def feature_ids(self, feature: int, values: Tensor, missing: Optional[Tensor] = None) -> Tensor:
        """The ids of int64 ``values`` of the ``feature``-th sparse feature (``missing``: null values, hashed to the
        feature's missing id; in ``raw`` mode the caller leaves nulls out instead)."""
        values = values.to(torch.int64)
        return values if self.ids[feature] == "raw" else hash_feature_ids(values, feature, missing)

    def dense(self, values: Tensor, missing: Optional[Tensor] = None) -> Tensor:
        """``[n, D]`` stored dense values as the model sees them (float32)."""
        if self.dense_transform == "log1p":
            return transform_dense(values, missing)
        values = values.to(torch.float32)
        return values.masked_fill(missing, 0.0) if missing is not None else values

    def as_dict(self) -> Dict[str, Any]:
        """A JSON-able record (what an export bundle keeps); :meth:`from_dict` reads it back."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> "DataTransform":
        return cls(sparse_features=tuple(record["sparse_features"]), ids=tuple(record["ids"]),
                   dense_features=tuple(record["dense_features"]), dense_transform=record["dense_transform"])
