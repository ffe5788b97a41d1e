"""The torch, FBGEMM, TorchRec and Lightning releases this package works with, checked when it is imported.

FBGEMM and TorchRec are built for one torch release each (FBGEMM's operators are compiled against its C++ ABI) and
their metadata does not say which, so pip can pair them wrongly; the mismatch then shows deep inside FBGEMM
(an undefined symbol, or an operator missing). :func:`check` reads the installed versions from the packages'
metadata (importing none of them: a parameter-server shard stays free of Lightning and TorchRec) and raises
:class:`UnsupportedVersionError` naming the supported set instead. pyproject.toml declares the same ranges
(tests/test_versions.py holds the two together).
"""
from __future__ import annotations

import os
from importlib import metadata
from typing import Callable, Dict, Mapping, Optional, Tuple

from packaging.version import InvalidVersion, Version

#: torch release -> (FBGEMM release, oldest TorchRec release) built for it.
PAIRED: Dict[Tuple[int, int], Tuple[Tuple[int, int], str]] = {
    (2, 11): ((1, 6), "1.6.1"),
    (2, 12): ((1, 7), "1.7.0"),
    (2, 13): ((1, 8), "1.8.0"),
}
#: Lightning releases the strategy is tested with: 2.6.x (2.5.6 fails to resume a checkpoint: its
#: ``Strategy.load_checkpoint`` takes no ``weights_only``).
LIGHTNING = ((2, 6), (2, 6))
SKIP_ENV = "LIGHTNING_PERSIA_SKIP_VERSION_CHECK"
_FBGEMM = ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-genai")


class UnsupportedVersionError(ImportError):
    """An installed torch, FBGEMM, TorchRec or Lightning release outside the supported set."""


def supported() -> str:
    """The supported set, in words (for messages and docs)."""
    pairs = "; ".join(f"torch {t[0]}.{t[1]} with FBGEMM {f[0]}.{f[1]} and TorchRec {f[0]}.{f[1]}.x (>= {r})"
                      for t, (f, r) in PAIRED.items())
    return f"{pairs}; Lightning {LIGHTNING[0][0]}.{LIGHTNING[0][1]}.x"


def installed(version_of: Callable[[str], str] = metadata.version) -> Dict[str, str]:
    """``{"torch": "2.13.0", "fbgemm": ..., "torchrec": ..., "lightning": ...}`` of what is installed (absent: left out)."""
    found = {}
    for key, names in (("torch", ("torch",)), ("fbgemm", _FBGEMM), ("torchrec", ("torchrec",)), ("lightning", ("lightning",))):
        for name in names:
            try:
                found[key] = version_of(name)
                break
            except metadata.PackageNotFoundError:
                continue
    return found


def problems(versions: Mapping[str, str]) -> list[str]:
    """What is wrong with ``versions`` (as :func:`installed` gives them); empty when they are a supported set."""
    parsed: Dict[str, Version] = {}
    for key, text in versions.items():
        try:
            parsed[key] = Version(text)
        except InvalidVersion:
            return [f"{key} {text!r} is not a version this package can check"]
    found: list[str] = []
    torch = parsed.get("torch")
    pair: Optional[Tuple[Tuple[int, int], str]] = None
    if torch is not None:
        pair = PAIRED.get(torch.release[:2])
        if pair is None:
            found.append(f"torch {versions['torch']} is installed")
    if pair is not None:
        (fbgemm_release, oldest_torchrec), torch_release = pair, torch.release[:2]
        fbgemm, torchrec = parsed.get("fbgemm"), parsed.get("torchrec")
        if fbgemm is not None and fbgemm.release[:2] != fbgemm_release:
            found.append(f"FBGEMM {versions['fbgemm']} is installed, built for another torch than "
                         f"{torch_release[0]}.{torch_release[1]} (it needs FBGEMM {fbgemm_release[0]}.{fbgemm_release[1]}.x: "
                         f"fbgemm-gpu-cpu=={fbgemm_release[0]}.{fbgemm_release[1]}.* on a CPU machine, fbgemm-gpu with CUDA)")
        if torchrec is not None and (torchrec.release[:2] != fbgemm_release or torchrec < Version(oldest_torchrec)):
            found.append(f"TorchRec {versions['torchrec']} is installed, not the {fbgemm_release[0]}.{fbgemm_release[1]}.x "
                         f"(>= {oldest_torchrec}) of torch {torch_release[0]}.{torch_release[1]}")
    lightning = parsed.get("lightning")
    if lightning is not None and not LIGHTNING[0] <= lightning.release[:2] <= LIGHTNING[1]:
        found.append(f"Lightning {versions['lightning']} is installed")
    return found


def check(versions: Optional[Mapping[str, str]] = None) -> None:
    """Raises :class:`UnsupportedVersionError` when the installed releases (or ``versions``) are not a supported set.

    Setting the environment variable ``LIGHTNING_PERSIA_SKIP_VERSION_CHECK=1`` skips the check (to try a release
    not yet supported, at one's own risk).
    """
    if os.environ.get(SKIP_ENV) == "1":
        return
    found = problems(installed() if versions is None else versions)
    if found:
        raise UnsupportedVersionError(
            f"lightning-persia does not support the installed releases: {'; '.join(found)}. Supported: {supported()} "
            f"(README, \"Install\"; {SKIP_ENV}=1 skips this check)"
        )
