"""The ctypes declarations of ``ops/native/ids.py`` agree with ``ids.c`` (see tests/ops/c_interface.py)."""
from __future__ import annotations

import ctypes
from pathlib import Path

from lightning_persia.ops import native
from lightning_persia.ops.native import ids
from lightning_persia.ops.native._source import sources
from tests.ops.c_interface import assert_declared, assert_struct_twins, c_functions, c_structs

FOLDER = Path(native.__file__).parent


def test_the_folder_holds_one_c_file_and_it_has_its_binding():
    assert [path.name for path in sources(FOLDER)] == ["hash.h", "ids.c"]


def test_every_exported_function_is_declared_with_the_c_signature():
    assert_declared(FOLDER / "ids.c", ids)
    assert_struct_twins(FOLDER / "ids.c", ids)


def test_the_parser_reads_what_it_compares():
    """A parser that saw nothing would pass the test above: it sees every function, and no struct where none is."""
    functions = c_functions(FOLDER / "ids.c")
    assert functions == {
        "lp_first_foreign": ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64], ctypes.c_int64),
        "lp_slot_of": ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p], None),
        "lp_unique_by_table": ([ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 3, ctypes.c_int64),
    }
    assert c_structs(FOLDER / "ids.c") == {}  # seen_t is the C code's own: no function takes it
