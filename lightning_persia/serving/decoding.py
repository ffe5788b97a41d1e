"""From HTTP request bodies to the batch a model's ``predict_step`` takes, and from its output to scores.

A :class:`RequestDecoder` checks one request (one row) and raises :class:`RequestError` naming the field at
fault; the endpoint answers that request with HTTP 400 and serves the others. :class:`CriteoRequestDecoder`
is the decoder of models that take a :class:`~lightning_persia.data.CriteoBatch` (the example models);
another model brings its own, given to the endpoint as a factory ``f(predictor) -> RequestDecoder``.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.data import CriteoBatch

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
    """``{"sparse": {"<feature>": [ids, ...], ...}, "dense": [floats, ...]}`` -> :class:`CriteoBatch` rows.

    Every feature of ``sparse_features`` must be given (an empty list is a row without ids for it); ids are
    64-bit integers; ``dense`` holds exactly ``num_dense`` finite numbers.

    Example::

        decoder = CriteoRequestDecoder(["cat_0", "cat_1"], num_dense=2)
        batch = decoder.collate([decoder.decode({"sparse": {"cat_0": [3], "cat_1": []}, "dense": [0.1, 2.0]})])
    """

    def __init__(self, sparse_features: Sequence[str], num_dense: int) -> None:
        if not sparse_features:
            raise ValueError("CriteoRequestDecoder needs at least one sparse feature")
        self.sparse_features = list(sparse_features)
        self.num_dense = int(num_dense)
        self._known = set(self.sparse_features)

    @classmethod
    def from_predictor(cls, predictor: "Predictor") -> "CriteoRequestDecoder":
        """The features the predictor's twins read, and the module's ``num_dense_features`` hyper-parameter."""
        num_dense = predictor.module.hparams.get("num_dense_features")
        if num_dense is None:
            raise ValueError(
                f"{predictor.bundle.module_class_path} has no num_dense_features hyper-parameter, so the default request "
                "decoder cannot check the dense features; give the endpoint a decoder for this model"
            )
        return cls(predictor.sparse_features, num_dense)

    def decode(self, payload: dict[str, Any]) -> tuple[list[list[int]], list[float]]:
        if not isinstance(payload, dict):
            raise RequestError("body", f"must be a JSON object, got {type(payload).__name__}")
        unknown = sorted(set(payload) - {"sparse", "dense"})
        if unknown:
            raise RequestError(unknown[0], "unknown field; a request has 'sparse' and 'dense'")
        sparse = payload.get("sparse")
        if not isinstance(sparse, dict):
            raise RequestError("sparse", "missing or not an object {\"<feature>\": [ids, ...]}")
        extra = sorted(set(sparse) - self._known)
        if extra:
            raise RequestError(f"sparse.{extra[0]}", f"unknown feature; the model reads {self.sparse_features}")
        ids = []
        for feature in self.sparse_features:
            if feature not in sparse:
                raise RequestError(f"sparse.{feature}", "missing feature (give [] for a row without ids)")
            ids.append(_ids(sparse[feature], f"sparse.{feature}"))
        dense = payload.get("dense")
        if not isinstance(dense, list):
            raise RequestError("dense", f"missing or not a list of {self.num_dense} numbers")
        if len(dense) != self.num_dense:
            raise RequestError("dense", f"{len(dense)} numbers, the model takes {self.num_dense}")
        for position, value in enumerate(dense):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RequestError(f"dense[{position}]", f"{value!r} is not a finite number")
        return ids, [float(v) for v in dense]

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
