"""Finding a module's input inside a training batch of dicts, lists, tuples and dataclasses.

The prefetcher plans a step's lookups from its batch, before the forward: it needs to know, for every remote
module, which part of the batch the module will receive. A TorchRec collection says so itself (the
KeyedJaggedTensor holding its features); for the others the first training step tells, by where in the batch
the tensor a module received sits (a *path*), and later batches are read at the same path.
"""
from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, Iterator, Optional

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

Path = tuple[tuple[str, Any], ...]  # ("key", k) of a dict, ("index", i) of a list or tuple, ("field", name) of a dataclass
_MAX_DEPTH = 4


def _children(value: Any) -> Iterator[tuple[tuple[str, Any], Any]]:
    if isinstance(value, KeyedJaggedTensor):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield ("key", key), item
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield ("index", index), item
    elif is_dataclass(value) and not isinstance(value, type):
        for field in fields(value):
            yield ("field", field.name), getattr(value, field.name)


def find_kjts(batch: Any, depth: int = 0) -> Iterator[KeyedJaggedTensor]:
    """Every KeyedJaggedTensor inside ``batch``."""
    if isinstance(batch, KeyedJaggedTensor):
        yield batch
    elif depth < _MAX_DEPTH:
        for _, child in _children(batch):
            yield from find_kjts(child, depth + 1)


def find_path(batch: Any, target: Any, depth: int = 0) -> Optional[Path]:
    """Where ``target`` (the very object) sits inside ``batch``; None when it is not there."""
    if batch is target:
        return ()
    if depth >= _MAX_DEPTH:
        return None
    for step, child in _children(batch):
        found = find_path(child, target, depth + 1)
        if found is not None:
            return (step, *found)
    return None


def at_path(batch: Any, path: Path) -> Optional[Any]:
    """What sits at ``path`` inside ``batch``; None when this batch is shaped otherwise."""
    value = batch
    for kind, where in path:
        try:
            if kind == "field":
                value = getattr(value, where)
            elif kind == "index" and not isinstance(value, (list, tuple)):
                return None
            else:
                value = value[where]
        except (KeyError, IndexError, TypeError, AttributeError):
            return None
    return value
