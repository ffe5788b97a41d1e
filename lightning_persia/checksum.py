"""The checksum of every file that a parameter-server checkpoint, a serving bundle or a serving delta lists.

A manifest's entry for a file holds its size and one digest, under the name of the algorithm that made it:
``{"file": ..., "bytes": ..., "xxh3_128": "<32 hex digits>"}``. Files are checksummed with XXH3-128, which runs
at ~8 GB/s on a core where sha256 runs at ~1.2 (measured on the development machine): a shard's save and load
hash every byte they write or read, so with sha256 a quarter of a load's CPU went to the hash. Entries of older
checkpoints and bundles hold a ``"sha256"`` instead, and still verify.

Neither detects more than damage (a truncated file, flipped bits, a file from another save): no key signs a
manifest, so whoever can rewrite a file can rewrite its digest too. Loading never runs code from a file
whatever its digest (arrays are parsed, never unpickled).
"""
from __future__ import annotations

import hashlib
import os
from typing import Callable, Optional

import xxhash

ALGORITHM = "xxh3_128"
"""The algorithm of the files written now."""
_ALGORITHMS: dict[str, Callable] = {ALGORITHM: xxhash.xxh3_128, "sha256": hashlib.sha256}
_BLOCK = 1 << 24


class Digest:
    """A digest made block by block while a file is written or read; :meth:`entry` gives its manifest fields."""

    def __init__(self, algorithm: str = ALGORITHM) -> None:
        self._algorithm = algorithm
        self._digest = _ALGORITHMS[algorithm]()

    @classmethod
    def like(cls, entry: dict) -> "Digest":
        """A digest with the algorithm of a manifest ``entry``, to check its file as it is read (:meth:`matches`).

        Raises :class:`ValueError` when the entry holds no digest this version knows.
        """
        return cls(required_algorithm(entry))

    def update(self, data) -> None:
        self._digest.update(data)

    def entry(self) -> dict[str, str]:
        return {self._algorithm: self._digest.hexdigest()}

    def matches(self, entry: dict) -> bool:
        """Whether the bytes so far have the digest that ``entry`` holds for this algorithm."""
        return entry.get(self._algorithm) == self._digest.hexdigest()


def algorithm_of(entry: dict) -> Optional[str]:
    """The algorithm whose digest a manifest entry holds (``None`` when it holds none this version knows)."""
    return next((name for name in _ALGORITHMS if isinstance(entry.get(name), str)), None)


def required_algorithm(entry: dict) -> str:
    """:func:`algorithm_of` ``entry``; raises :class:`ValueError` when it holds no digest this version knows."""
    algorithm = algorithm_of(entry)
    if algorithm is None:
        raise ValueError(f"no checksum of a known algorithm ({', '.join(_ALGORITHMS)}) in {sorted(entry)}")
    return algorithm


def of_file(path: str | os.PathLike, algorithm: str = ALGORITHM, on_bytes: Optional[Callable[[int], object]] = None) -> dict[str, str]:
    """``{algorithm: digest}`` of the file at ``path``; ``on_bytes(n)`` after each block of ``n`` bytes (a progress bar)."""
    return _digest_of_file(path, Digest(algorithm), on_bytes).entry()


def matches(entry: dict, path: str | os.PathLike) -> bool:
    """Whether the file at ``path`` has the digest of ``entry`` (made with the entry's own algorithm).

    Raises :class:`ValueError` when the entry holds no digest this version knows.
    """
    return _digest_of_file(path, Digest.like(entry)).matches(entry)


def _digest_of_file(path: str | os.PathLike, digest: Digest, on_bytes: Optional[Callable[[int], object]] = None) -> Digest:
    """``digest`` updated with the bytes of the file at ``path``, read a block at a time into one buffer."""
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            digest.update(view[:count])
            if on_bytes is not None:
                on_bytes(count)
    return digest
