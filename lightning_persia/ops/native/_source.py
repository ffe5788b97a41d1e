"""The native kernels' source and the name of the library built from it.

Read by the loader (``__init__.py``) and by ``setup.py``, which builds the library without importing the package
(a build environment has no torch). The name carries a digest of the source and the flags, so a library built
from another version of ``kernels.c`` is never loaded.
"""
import hashlib
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.c")
COMPILE_ARGS = ("-O3", "-std=c99", "-ffp-contract=off")  # no fused multiply-add: initial rows equal torch's, bit for bit


def library_name() -> str:
    """``_kernels_<digest>``: the module name setuptools builds the library under (plus the platform's suffix)."""
    digest = hashlib.sha1(SOURCE.read_bytes() + " ".join(COMPILE_ARGS).encode()).hexdigest()[:16]
    return f"_kernels_{digest}"
