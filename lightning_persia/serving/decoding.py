"""From HTTP request bodies to the batch a model's ``predict_step`` takes, and from its output to scores.

A :class:`RequestDecoder` checks one request (one row) and raises :class:`RequestError` naming the field at
fault; the endpoint answers that request with HTTP 400 and serves the others. :class:`CriteoRequestDecoder`
is the decoder of models that take a :class:`~lightning_persia.data.CriteoBatch` (the example models);
another model brings its own, given to the endpoint as a factory ``f(predictor) -> RequestDecoder``.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.data import CriteoBatch
from lightning_persia.data.transform import DataTransform, TransformError

if TYPE_CHECKING:
    from lightning_persia.serving.predictor import Predictor

_INT64 = (-(1 << 63), (1 << 63) - 1)


class RequestError(ValueError):
    """A request that cannot be answered; ``field`` names the part at fault (``sparse.cat_3[2]``, ``dense``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class RequestDecoder(ABC):
    """Turns request bodies (parsed JSON objects, one row each) into a batch, and the batch's output into scores."""

    @abstractmethod
    def decode(self, payload: dict[str, Any]) -> Any:
        """One row from one request body; raises :class:`RequestError` naming the field when the body is bad."""

    @abstractmethod
    def collate(self, rows: Sequence[Any]) -> Any:
        """The batch of ``rows`` (each from :meth:`decode`) that the model's ``predict_step`` takes."""

    def scores(self, output: Any, count: int) -> list[float]:
        """One score per row from ``predict_step``'s output (default: a tensor of ``count`` numbers)."""
        if not isinstance(output, torch.Tensor) or output.numel() != count:
            shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise TypeError(f"predict_step returned {shape} for {count} rows; the default decoder expects one number per row")
        return output.reshape(count).tolist()


class CriteoRequestDecoder(RequestDecoder):
    """Request bodies -> :class:`CriteoBatch` rows, in two forms.

    As the training files hold the features (the default)::

        {"sparse": {"cat_0": "68fd1e64", "cat_1": [7, null], ...}, "dense": [3, null, 0.5, ...]}

    a feature's value or list of values (integers, or text as the files write it, ``null`` for a missing value) and
    the dense values (numbers, ``null`` for missing) go through the training data module's
    :class:`~lightning_persia.data.DataTransform` (each feature's ids hashed or raw, the dense transform), recorded
    in the bundle. Already transformed, marked so::

        {"transformed": true, "sparse": {"cat_0": [4284822064372588020], ...}, "dense": [0.0, 1.9459, ...]}

    the model's inputs as they are: ids are 64-bit integers, ``dense`` holds exactly ``num_dense`` finite numbers.
    Every feature of ``sparse_features`` must be given either way (an empty list is a row without ids for it).
    Either way, the id of a raw-id feature whose table is kept on the trainers (``raw_id_rows``: feature -> rows) is
    the row it reads, so one outside ``[0, rows)`` is refused naming the feature.

    Example::

        decoder = CriteoRequestDecoder(["cat_0", "cat_1"], num_dense=2)
        batch = decoder.collate([decoder.decode({"transformed": True, "sparse": {"cat_0": [3], "cat_1": []}, "dense": [0.1, 2.0]})])
    """

    def __init__(
        self, sparse_features: Sequence[str], num_dense: int, transform: Optional[DataTransform] = None,
        raw_id_rows: Optional[Mapping[str, int]] = None,
    ) -> None:
        if not sparse_features:
            raise ValueError("CriteoRequestDecoder needs at least one sparse feature")
        self.sparse_features = list(sparse_features)
        self.num_dense = int(num_dense)
        self.transform = transform
        self.raw_id_rows = dict(raw_id_rows or {})
        self._known = set(self.sparse_features)
        if transform is not None:
            unknown = sorted(self._known - set(transform.sparse_features))
            if unknown:
                raise ValueError(f"the model reads features {unknown} that its data module's transform does not make "
                                 f"(it makes {list(transform.sparse_features)})")
            if len(transform.dense_features) != self.num_dense:
                raise ValueError(f"the model takes {self.num_dense} dense features, its data module's transform makes "
                                 f"{len(transform.dense_features)}")

    @classmethod
    def from_predictor(cls, predictor: "Predictor") -> "CriteoRequestDecoder":
        """The features the predictor's twins read, the module's ``num_dense_features`` hyper-parameter, the
        bundle's data transform and the sizes of the kept tables its raw-id features index."""
        num_dense = predictor.module.hparams.get("num_dense_features")
        if num_dense is None:
            raise ValueError(
                f"{predictor.bundle.module_class_path} has no num_dense_features hyper-parameter, so the default request "
                "decoder cannot check the dense features; give the endpoint a decoder for this model"
            )
        return cls(predictor.sparse_features, num_dense, predictor.bundle.data_transform, predictor.raw_id_rows)

    def decode(self, payload: dict[str, Any]) -> tuple[list[list[int]], list[float]]:
        if not isinstance(payload, dict):
            raise RequestError("body", f"must be a JSON object, got {type(payload).__name__}")
        unknown = sorted(set(payload) - {"sparse", "dense", "transformed"})
        if unknown:
            raise RequestError(unknown[0], "unknown field; a request has 'sparse', 'dense' and optionally 'transformed'")
        transformed = payload.get("transformed", False)
        if not isinstance(transformed, bool):
            raise RequestError("transformed", f"must be true or false, got {transformed!r}")
        if not transformed and self.transform is None:
            raise RequestError("transformed", "this model's bundle records no data transform (its checkpoint predates it, or its "
                                              "data module describes none): send the model's inputs marked \"transformed\": true")
        sparse = payload.get("sparse")
        if not isinstance(sparse, dict):
            raise RequestError("sparse", "missing or not an object {\"<feature>\": [values, ...]}")
        extra = sorted(set(sparse) - self._known)
        if extra:
            raise RequestError(f"sparse.{extra[0]}", f"unknown feature; the model reads {self.sparse_features}")
        missing = [f for f in self.sparse_features if f not in sparse]
        if missing:
            raise RequestError(f"sparse.{missing[0]}", "missing feature (give [] for a row without ids)")
        dense = payload.get("dense")
        if not isinstance(dense, list):
            raise RequestError("dense", f"missing or not a list of {self.num_dense} numbers")
        if transformed:
            ids, values = [_ids(sparse[f], f"sparse.{f}") for f in self.sparse_features], _dense(dense, self.num_dense)
        else:
            assert self.transform is not None
            try:
                ids = [self.transform.parse_ids(f, _values(sparse[f]), f"sparse.{f}").tolist() for f in self.sparse_features]
                values = self.transform.parse_dense(dense).tolist()
            except TransformError as err:
                raise RequestError(err.field, err.reason) from None
        for feature, feature_ids in zip(self.sparse_features, ids):
            rows = self.raw_id_rows.get(feature)
            outside = [i for i in feature_ids if rows is not None and not 0 <= i < rows]
            if outside:
                raise RequestError(f"sparse.{feature}", f"raw id {outside[0]} is outside the {rows} rows of the feature's table kept "
                                                        "on the trainers (its ids are vocabulary ids, which index the rows directly)")
        return ids, values

    def collate(self, rows: Sequence[tuple[list[list[int]], list[float]]]) -> CriteoBatch:
        count = len(rows)
        # KeyedJaggedTensor order: feature-major (every row's ids of feature 0, then of feature 1, ...)
        lengths = [len(row[0][f]) for f in range(len(self.sparse_features)) for row in rows]
        values = [i for f in range(len(self.sparse_features)) for row in rows for i in row[0][f]]
        features = KeyedJaggedTensor(
            keys=self.sparse_features,
            values=torch.tensor(values, dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int32),
            stride=count,
        )
        dense = torch.tensor([row[1] for row in rows], dtype=torch.float32).reshape(count, self.num_dense)
        return CriteoBatch(sparse_features=features, dense_features=dense, labels=torch.zeros(count))


def _ids(value: Any, field: str) -> list[int]:
    if not isinstance(value, list):
        raise RequestError(field, f"must be a list of integer ids, got {type(value).__name__}")
    for position, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise RequestError(f"{field}[{position}]", f"{item!r} is not an integer id")
        if not _INT64[0] <= item <= _INT64[1]:
            raise RequestError(f"{field}[{position}]", f"{item} does not fit in 64 bits")
    return value


def _dense(values: list, count: int) -> list[float]:
    if len(values) != count:
        raise RequestError("dense", f"{len(values)} numbers, the model takes {count}")
    for position, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(f"dense[{position}]", f"{value!r} is not a finite number")
    return [float(v) for v in values]


def _values(value: Any) -> list:
    """A raw feature's values: a list as it is, one value (or null) as a list of one."""
    return value if isinstance(value, list) else [value]
