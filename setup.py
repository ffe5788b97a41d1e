"""Builds the native kernels (``lightning_persia/ops/native/kernels.c``) into a shared library inside the package.

Everything else about the package is declared in pyproject.toml. The library is plain C called through ctypes
(no Python.h): setuptools compiles it like an extension module, so ``pip install .``, ``python -m build`` and
``pip install -e .`` all build it, with ``$CC`` or the platform's compiler. ``optional=True``: where no compiler
works the package installs without it, and runs its tensor implementation instead.
"""
import importlib.util
from pathlib import Path

from setuptools import Extension, setup

_spec = importlib.util.spec_from_file_location("_source", Path(__file__).parent / "lightning_persia/ops/native/_source.py")
_source = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_source)

setup(
    ext_modules=[
        Extension(
            f"lightning_persia.ops.native.{_source.library_name()}",
            sources=["lightning_persia/ops/native/kernels.c"],
            extra_compile_args=list(_source.COMPILE_ARGS),
            libraries=["m"],  # sqrtf of the sparse rules
            optional=True,
        )
    ]
)
