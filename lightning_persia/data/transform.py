"""How a data module turns the features as its files hold them into the batch its model reads, said once.

A data module describes its featurisation as a :class:`FeatureTransform` (:meth:`TransformedFeatures.feature_transform`);
the checkpoint records it (the data module's ``state_dict``), the serving bundle carries it, and the endpoint applies it
to requests that send the features as the training files hold them. So a client never repeats the hashing and the
dense transform, and a raw id never reaches a table trained on hashed ids.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

import torch
from torch import Tensor

from lightning_persia.data.batch import hash_feature_values, transform_dense

FEATURE_TRANSFORM_KEY = "lightning_persia.feature_transform"
"""The key of the transform in a data module's ``state_dict`` (and so in the checkpoint)."""
ID_MODES = ("hash", "raw")
DENSE_TRANSFORMS = ("log1p", "none")
TEXT_IDS = ("hex", "decimal")


class TransformError(ValueError):
    """A raw feature value the transform cannot take; ``field`` names it (``sparse.cat_3[0]``, ``dense[2]``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.reason = field, message


@dataclass(frozen=True)
class FeatureTransform:
    """The features in the order a data module's batches hold them, and what is done to each on the way.

    Args:
        sparse_features: the KJT keys, in order; a feature's position is its index in :func:`hash_categorical`.
        dense_features: the dense columns, in the order of ``dense_features``' columns in a batch.
        ids: ``"hash"``: a categorical value ``v`` (an integer in ``[0, 2**32)``) of the feature at position ``f``
            becomes ``hash_categorical``'s id of ``(f, v)``, a missing value the feature's fixed missing id;
            ``"raw"``: the value is the id (vocabulary ids, any int64), and a value cannot be missing.
        dense: ``"log1p"``: missing -> 0, then ``log(1 + max(x, 0))``; ``"none"``: missing -> 0, values as they are.
        text_ids: how a categorical value written as text reads (Criteo's TSV: 8 hex digits).
    """

    sparse_features: tuple[str, ...]
    dense_features: tuple[str, ...]
    ids: Literal["hash", "raw"] = "hash"
    dense: Literal["log1p", "none"] = "log1p"
    text_ids: Literal["hex", "decimal"] = "decimal"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sparse_features", tuple(self.sparse_features))
        object.__setattr__(self, "dense_features", tuple(self.dense_features))
        if self.ids not in ID_MODES:
            raise ValueError(f"FeatureTransform: ids must be one of {ID_MODES}, got {self.ids!r}")
        if self.dense not in DENSE_TRANSFORMS:
            raise ValueError(f"FeatureTransform: dense must be one of {DENSE_TRANSFORMS}, got {self.dense!r}")
        if self.text_ids not in TEXT_IDS:
            raise ValueError(f"FeatureTransform: text_ids must be one of {TEXT_IDS}, got {self.text_ids!r}")
        if len(set(self.sparse_features)) != len(self.sparse_features):
            raise ValueError(f"FeatureTransform: sparse feature names repeat: {list(self.sparse_features)}")

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-safe form (as checkpoints and bundles store it)."""
        out = dataclasses.asdict(self)
        out["sparse_features"], out["dense_features"] = list(self.sparse_features), list(self.dense_features)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FeatureTransform":
        """Inverse of :meth:`to_dict`; an unknown or missing field is a ``ValueError`` naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"FeatureTransform: unknown fields {unknown}")
        try:
            return cls(**data)
        except TypeError as err:
            raise ValueError(f"FeatureTransform: {err}") from None

    def sparse_ids(self, feature: str, values: Sequence[Any], field: str = "") -> Tensor:
        """The ids of the raw values ``values`` (integers, text, ``None`` for a missing value) of ``feature``."""
        field = field or f"sparse.{feature}"
        if feature not in self.sparse_features:
            raise TransformError(field, f"unknown feature; the data module's features are {list(self.sparse_features)}")
        numbers, missing = [], []
        for position, value in enumerate(values):
            where = f"{field}[{position}]"
            if value is None:
                if self.ids == "raw":
                    raise TransformError(where, "missing value (null) where ids are raw vocabulary ids, which have no missing id")
                numbers.append(0)
                missing.append(True)
                continue
            number = self._number(value, where)
            if self.ids == "hash" and not 0 <= number < 1 << 32:
                raise TransformError(where, f"{value!r} is not a 32-bit categorical value (ids are hashed from values in [0, 2**32))")
            if self.ids == "raw" and not -(1 << 63) <= number < 1 << 63:
                raise TransformError(where, f"{value!r} does not fit in 64 bits")
            numbers.append(number)
            missing.append(False)
        ids = torch.tensor(numbers, dtype=torch.int64)
        if self.ids == "raw":
            return ids
        return hash_feature_values(ids, self.sparse_features.index(feature), torch.tensor(missing, dtype=torch.bool))

    def dense_values(self, values: Sequence[Any], field: str = "dense") -> Tensor:
        """The transformed ``[len(dense_features)]`` float32 values of the raw ``values`` (numbers, ``None`` if missing)."""
        if len(values) != len(self.dense_features):
            raise TransformError(field, f"{len(values)} values for the {len(self.dense_features)} dense features {list(self.dense_features)}")
        numbers, missing = [], []
        for position, value in enumerate(values):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
                raise TransformError(f"{field}[{position}]", f"{value!r} is not a finite number or null (missing)")
            numbers.append(0.0 if value is None else float(value))
            missing.append(value is None)
        dense = torch.tensor(numbers, dtype=torch.float64)
        if self.dense == "log1p":
            return transform_dense(dense, torch.tensor(missing))
        return dense.to(torch.float32)

    def _number(self, value: Any, where: str) -> int:
        if isinstance(value, bool):
            raise TransformError(where, f"{value!r} is not a categorical value")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value, 16 if self.text_ids == "hex" else 10)
            except ValueError:
                raise TransformError(where, f"{value!r} is not a {self.text_ids} categorical value") from None
        raise TransformError(where, f"{value!r} is not an integer or text categorical value")


class TransformedFeatures:
    """What a data module adds to say how it featurises: :meth:`feature_transform`, kept in its checkpoints."""

    def feature_transform(self) -> Optional[FeatureTransform]:
        """How this data module's batches are made from its files' features; ``None``: not described."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Lightning saves this in checkpoints: the :class:`FeatureTransform`, for serving."""
        transform = self.feature_transform()
        return {} if transform is None else {FEATURE_TRANSFORM_KEY: transform.to_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the transform is the data module's own (a resumed run may read other files)."""


def recorded_transform(checkpoint: dict[str, Any]) -> Optional[FeatureTransform]:
    """The :class:`FeatureTransform` a Lightning checkpoint records (its data module's ``state_dict``), if any."""
    found = [value[FEATURE_TRANSFORM_KEY] for value in checkpoint.values() if isinstance(value, dict) and FEATURE_TRANSFORM_KEY in value]
    return FeatureTransform.from_dict(found[0]) if len(found) == 1 else None
