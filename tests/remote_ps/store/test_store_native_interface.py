"""The ctypes declarations of the store's binding modules agree with their C files: each ``X.c`` of
``remote_ps/store/native`` is declared by the module ``X`` there (see tests/ops/c_interface.py)."""
from __future__ import annotations

import ctypes
import importlib
import shutil
from pathlib import Path

import pytest

from lightning_persia.ops.native._source import sources
from lightning_persia.remote_ps.store import native
from tests.ops.c_interface import assert_declared, assert_struct_layouts, assert_struct_twins, c_functions, c_structs

FOLDER = Path(native.__file__).parent
C_FILES = [path for path in sources(FOLDER) if path.suffix == ".c"]


def _binding(path: Path):
    return importlib.import_module(f"{native.__name__}.{path.stem}")


def test_the_subjects_are_the_ones_the_package_lists():
    assert [path.name for path in C_FILES] == ["disk_map.c", "id_index.c", "jobs.c", "records.c", "rows.c"]
    assert [path.name for path in sources(FOLDER) if path.suffix == ".h"] == ["hash.h", "store.h"]  # hash.h: ops/native's


@pytest.mark.parametrize("path", C_FILES, ids=lambda path: path.name)
def test_every_exported_function_is_declared_by_its_binding_with_the_c_signature(path):
    assert_declared(path, _binding(path))


@pytest.mark.parametrize("path", C_FILES, ids=lambda path: path.name)
def test_every_struct_the_functions_take_has_a_ctypes_twin_with_the_same_fields(path):
    assert_struct_twins(path, _binding(path))


def test_the_parser_reads_what_it_compares():
    """A parser that saw nothing would pass the tests above: it sees every function, every struct and every field."""
    assert {name for path in C_FILES for name in c_structs(path)} == {"admit_job_t", "find_job_t", "update_job_t"}
    assert sum(len(c_functions(path)) for path in C_FILES) == 35
    assert c_functions(FOLDER / "rows.c")["lp_uniform_rows"] == (
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_double, ctypes.c_double, ctypes.c_void_p], None)
    assert c_functions(FOLDER / "id_index.c")["lp_index_new"] == ([], ctypes.c_void_p)
    fields = dict(c_structs(FOLDER / "jobs.c")["update_job_t"])
    assert (fields["shift"], fields["stride"], fields["grads"], fields["lr"]) == (
        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on this machine to print the C layouts")
def test_struct_layouts_match_byte_for_byte(tmp_path):
    assert_struct_layouts(FOLDER / "jobs.c", _binding(FOLDER / "jobs.c"), sources(FOLDER), tmp_path)
