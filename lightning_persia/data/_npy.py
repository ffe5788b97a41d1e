"""Arrays of ``.npy`` files and of the members of uncompressed ``.npz`` archives, memory-mapped."""
from __future__ import annotations

import struct
import zipfile
from typing import Dict

import numpy as np

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip member's local header: 30 bytes, then its name and extra field


def load_npy(path: str) -> np.ndarray:
    """``path`` memory-mapped; raises ``ValueError`` naming it when it is not a ``.npy`` array."""
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"{path} is not a readable .npy array: {err}") from None


def load_npz_members(path: str) -> Dict[str, np.ndarray]:
    """Every ``<name>.npy`` member of an ``.npz`` archive (as ``np.savez`` writes it), memory-mapped in place: a
    member is stored, not compressed, so its bytes are an ``.npy`` file inside the archive. Raises ``ValueError``
    naming the archive and member when it is compressed (``np.savez_compressed``) or not an array."""
    out: Dict[str, np.ndarray] = {}
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"{path} is not a readable .npz archive: {err}") from None
    with archive, open(path, "rb") as handle:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{path}: member {info.filename} is compressed; write the archive with np.savez "
                                 "(as MLPerf's materialize_synthetic_multihot_dataset.py does) so that it can be memory-mapped")
            handle.seek(info.header_offset)
            header = _LOCAL_HEADER.unpack(handle.read(_LOCAL_HEADER.size))
            handle.seek(info.header_offset + _LOCAL_HEADER.size + header[-2] + header[-1])
            try:
                version = np.lib.format.read_magic(handle)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read(handle)
            except ValueError as err:
                raise ValueError(f"{path}: member {info.filename} is not a .npy array: {err}") from None
            if dtype.hasobject:
                raise ValueError(f"{path}: member {info.filename} holds Python objects, not numbers")
            out[info.filename[: -len(".npy")]] = np.memmap(path, dtype=dtype, mode="r", shape=shape,
                                                           order="F" if fortran else "C", offset=handle.tell())
    return out
