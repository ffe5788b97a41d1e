"""``NativeObject``: the ownership of a C object by its binding (made by ``<prefix>_new``, freed once by ``<prefix>_free``)."""
import gc
from types import SimpleNamespace

import pytest

from lightning_persia.ops.native.library import NativeObject


def _library(handle: int, freed: list):
    functions = SimpleNamespace(lp_thing_new=lambda: handle, lp_thing_free=freed.append)
    return SimpleNamespace(require=lambda: functions)


def test_the_object_is_freed_once_when_collected():
    freed: list = []
    thing = NativeObject(_library(1234, freed), "lp_thing", "a thing")
    assert thing._handle == 1234
    thing.__del__()  # an explicit close, then the collection: one free
    del thing
    gc.collect()
    assert freed == [1234]


def test_a_null_handle_is_an_out_of_memory_error_naming_the_object():
    freed: list = []
    with pytest.raises(MemoryError, match="cannot allocate a thing"):
        NativeObject(_library(0, freed), "lp_thing", "a thing")
    gc.collect()
    assert freed == []
