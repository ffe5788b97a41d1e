"""The C sources of a folder of native kernels, and the name of the library built from them.

Read by the loader (``library.py``) and by ``setup.py``, which builds the libraries without importing the package
(a build environment has no torch). The name carries a digest of the folder's sources (its ``*.c`` and ``*.h``
files, and the shared headers it includes from this folder) and of the flags, so a library built from another
version of them is never loaded.
"""
import hashlib
from pathlib import Path

COMPILE_ARGS = ("-O3", "-std=c99", "-ffp-contract=off")  # no fused multiply-add: initial rows equal torch's, bit for bit

SHARED_HEADERS = (Path(__file__).parent / "hash.h",)
"""Headers of this folder that the other folders' kernels include too: the ids' hash, which the trainer and the
store must compute alike."""


def sources(folder: Path) -> list[Path]:
    """The folder's C files (each compiled) and headers (included by them), and the shared headers it does not hold
    itself, in name order."""
    files = {path.name: path for path in SHARED_HEADERS}
    files.update({path.name: path for path in folder.iterdir() if path.suffix in (".c", ".h")})
    return [files[name] for name in sorted(files)]


def library_name(folder: Path) -> str:
    """``_kernels_<digest>``: the module name setuptools builds the folder's library under (plus the platform's
    suffix)."""
    digest = hashlib.sha1()
    for path in sources(folder):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(COMPILE_ARGS).encode())
    return f"_kernels_{digest.hexdigest()[:16]}"
