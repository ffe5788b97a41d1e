"""Builds the native kernels into shared libraries inside the package: the trainer's (``lightning_persia/ops/native``)
and the parameter server store's (``lightning_persia/remote_ps/store/native``), each from the C files of its folder.

Everything else about the package is declared in pyproject.toml. The libraries are plain C called through ctypes
(no Python.h): setuptools compiles them like extension modules, so ``pip install .``, ``python -m build`` and
``pip install -e .`` all build them, with ``$CC`` or the platform's compiler. ``optional=True``: where no compiler
works the package installs without them, and runs its tensor implementation instead.
"""
import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).parent
NATIVE_FOLDERS = ("lightning_persia/ops/native", "lightning_persia/remote_ps/store/native")

_spec = importlib.util.spec_from_file_location("_source", ROOT / "lightning_persia/ops/native/_source.py")
_source = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_source)


def _extension(folder: str) -> Extension:
    files = _source.sources(ROOT / folder)
    return Extension(
        f"{folder.replace('/', '.')}.{_source.library_name(ROOT / folder)}",
        sources=[os.path.relpath(path, ROOT) for path in files if path.suffix == ".c"],
        depends=[os.path.relpath(path, ROOT) for path in files if path.suffix == ".h"],
        extra_compile_args=list(_source.COMPILE_ARGS),
        libraries=["m"],  # sqrtf of the sparse rules
        optional=True,
    )


setup(ext_modules=[_extension(folder) for folder in NATIVE_FOLDERS])
