"""What a data module does to the values of its files before the model sees them: :class:`DataTransform`.

Every file-reading data module has an ``ids`` setting and a :attr:`~TransformedFeatures.transform` that records it,
so that whoever feeds the model later repeats exactly what training saw: the strategy's tables kept on the trainers,
and a serving endpoint given the features as the training files hold them (the checkpoint records the transform,
:func:`recorded_transform`; the export bundle carries it; the endpoint applies it with :meth:`DataTransform.parse_ids`
and :meth:`DataTransform.parse_dense`). So a client never repeats the hashing and the dense transform.

* ``ids: raw``: the file's integers are the ids (vocabulary ids ``0..n-1`` as TorchRec's, MLPerf's and NVTabular's
  preprocessing write them, or any int64 key); a table kept on the trainers indexes its rows with them directly
  and an id outside ``[0, num_embeddings)`` is an error naming the feature. A null is a row without an id for the
  feature (an empty bag, pooled to zeros).
* ``ids: hash``: each value goes through :func:`~lightning_persia.data.batch.hash_categorical` (per feature, any
  int64; a null is the feature's "missing" id); a kept table folds the hashed ids into its rows modulo its size.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Literal, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from lightning_persia.data.batch import hash_feature_ids, string_key, transform_dense

IdMode = Literal["hash", "raw"]
ID_MODES: Tuple[str, ...] = ("hash", "raw")
#: ``log1p``: null -> 0, then ``log(1 + max(x, 0))`` (Criteo's); ``none``: null -> 0, values as stored.
DENSE_TRANSFORMS: Tuple[str, ...] = ("log1p", "none")
#: How a categorical value written as text reads: ``hex`` (Criteo's TSV: 8 hex digits), ``decimal``, or ``string``
#: (a string column's value: its 8-byte blake2b key, :func:`~lightning_persia.data.batch.string_key`, then hashed).
TEXT_IDS: Tuple[str, ...] = ("hex", "decimal", "string")
#: A data module's ``ids`` setting: one mode for every feature, or a mode per feature (the others: ``default``).
IdsSetting = Union[IdMode, Dict[str, IdMode]]
TRANSFORM_KEY = "lightning_persia.data_transform"
"""The key of the transform in a data module's ``state_dict`` (and so in the checkpoint)."""
_INT64 = (-(1 << 63), (1 << 63) - 1)


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


class TransformError(ValueError):
    """A raw feature value the transform cannot take; ``field`` names it (``sparse.cat_3[0]``, ``dense[2]``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.reason = field, message


@dataclass(frozen=True)
class DataTransform:
    """How a data module turns stored values into a batch (public: the strategy and serving read it).

    Attributes:
        sparse_features: the KJT's keys, in order (the ``f`` of :func:`hash_categorical` is a key's position).
        ids: the id mode of each sparse feature (``hash`` or ``raw``, see the module's doc).
        dense_features: the stored dense columns, in the order of ``batch.dense_features``.
        dense_transform: what is done to them: ``log1p`` or ``none`` (:data:`DENSE_TRANSFORMS`).
        text_ids: how a categorical value written as text reads (:data:`TEXT_IDS`): ``hex`` for Criteo's TSV,
            ``string`` for Parquet (whose string columns are keyed), ``decimal`` otherwise.
    """

    sparse_features: Tuple[str, ...]
    ids: Tuple[str, ...]
    dense_features: Tuple[str, ...]
    dense_transform: str
    text_ids: str = "decimal"

    def __post_init__(self) -> None:
        for name in ("sparse_features", "ids", "dense_features"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if len(self.ids) != len(self.sparse_features):
            raise ValueError(f"{len(self.ids)} id modes for {len(self.sparse_features)} sparse features")
        if len(set(self.sparse_features)) != len(self.sparse_features):
            raise ValueError(f"sparse feature names repeat: {list(self.sparse_features)}")
        bad = [m for m in self.ids if m not in ID_MODES]
        if bad:
            raise ValueError(f"id modes must be among {ID_MODES}, got {bad}")
        if self.dense_transform not in DENSE_TRANSFORMS:
            raise ValueError(f"dense_transform must be one of {DENSE_TRANSFORMS}, got {self.dense_transform!r}")
        if self.text_ids not in TEXT_IDS:
            raise ValueError(f"text_ids must be one of {TEXT_IDS}, got {self.text_ids!r}")

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

    def parse_ids(self, feature: str, values: Sequence[Any], field: str = "") -> Tensor:
        """The ids of one row's values of ``feature`` as a file holds them (integers, text read as
        :attr:`text_ids` says, ``None`` for a null): what the data module's reader makes of them. Raises
        :class:`TransformError` naming ``field`` (default ``sparse.<feature>``) and the position of a bad value."""
        field = field or f"sparse.{feature}"
        if feature not in self.sparse_features:
            raise TransformError(field, f"unknown feature; the data module's features are {list(self.sparse_features)}")
        index = self.sparse_features.index(feature)
        raw = self.ids[index] == "raw"
        numbers, missing = [], []
        for position, value in enumerate(values):
            if value is None:
                if not raw:  # raw: a null is no id (an empty bag), as the readers leave it out
                    numbers.append(0)
                    missing.append(True)
                continue
            numbers.append(self._number(value, raw, f"{field}[{position}]"))
            missing.append(False)
        return self.feature_ids(index, torch.tensor(numbers, dtype=torch.int64), None if raw else torch.tensor(missing, dtype=torch.bool))

    def parse_dense(self, values: Sequence[Any], field: str = "dense") -> Tensor:
        """The ``[len(dense_features)]`` float32 values the model sees of one row's stored dense values (numbers,
        ``None`` for a null); raises :class:`TransformError` naming ``field`` and the position of a bad value."""
        if len(values) != len(self.dense_features):
            raise TransformError(field, f"{len(values)} values for the {len(self.dense_features)} dense features {list(self.dense_features)}")
        numbers, missing = [], []
        for position, value in enumerate(values):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
                raise TransformError(f"{field}[{position}]", f"{value!r} is not a finite number or null (missing)")
            numbers.append(0.0 if value is None else float(value))
            missing.append(value is None)
        return self.dense(torch.tensor([numbers], dtype=torch.float64), torch.tensor([missing], dtype=torch.bool))[0]

    def _number(self, value: Any, raw: bool, where: str) -> int:
        number = value
        if isinstance(value, str) and self.text_ids != "string":
            try:
                number = int(value, 16 if self.text_ids == "hex" else 10)
            except ValueError:
                raise TransformError(where, f"{value!r} is not a {self.text_ids} categorical value") from None
        elif isinstance(value, str):
            if raw:
                raise TransformError(where, f"{value!r} is text; raw ids are integers (ids: hash takes strings)")
            return string_key(value)
        if isinstance(number, bool) or not isinstance(number, int):
            raise TransformError(where, f"{value!r} is not an integer or text categorical value")
        if not _INT64[0] <= number <= _INT64[1]:
            raise TransformError(where, f"{value!r} does not fit in 64 bits")
        return number

    def as_dict(self) -> Dict[str, Any]:
        """A JSON-able record (what checkpoints and export bundles keep); :meth:`from_dict` reads it back."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> "DataTransform":
        """Inverse of :meth:`as_dict`; an unknown or missing field, or a bad value, is a ``ValueError`` naming it."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(record) - set(names))
        if unknown:
            raise ValueError(f"DataTransform: unknown fields {unknown}")
        try:
            return cls(**record)
        except TypeError as err:
            raise ValueError(f"DataTransform: {err}") from None


class TransformedFeatures:
    """What a data module adds to say how it featurises: :attr:`transform`, kept in its checkpoints."""

    #: how this data module's batches are made from its files' values; ``None``: not described
    transform: Optional[DataTransform] = None

    def state_dict(self) -> Dict[str, Any]:
        """Lightning saves this in checkpoints: the :class:`DataTransform`, for serving."""
        return {} if self.transform is None else {TRANSFORM_KEY: self.transform.as_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Nothing to restore: the transform is the data module's own (a resumed run may read other files)."""


def recorded_transform(checkpoint: Mapping[str, Any]) -> Optional[DataTransform]:
    """The :class:`DataTransform` a Lightning checkpoint records (its data module's ``state_dict``), if any."""
    found = [value[TRANSFORM_KEY] for value in checkpoint.values() if isinstance(value, dict) and TRANSFORM_KEY in value]
    return DataTransform.from_dict(found[0]) if len(found) == 1 else None
