"""The supported releases: checked at import with a message naming them, and declared alike in pyproject.toml."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from lightning_persia import _versions

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"torch": "2.13.0+cpu", "fbgemm": "1.8.0", "torchrec": "1.8.0", "lightning": "2.6.6"}


def _constraints(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "scripts" / "constraints" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            pins[requirement.name] = str(next(iter(requirement.specifier)).version)
    return pins


@pytest.mark.parametrize("name", ["known-good.txt", "oldest.txt"])
def test_the_constraint_files_are_supported_sets(name):
    pins = _constraints(name)
    assert pins["fbgemm-gpu"] == pins["fbgemm-gpu-cpu"]
    assert _versions.problems({"torch": pins["torch"], "fbgemm": pins["fbgemm-gpu"], "torchrec": pins["torchrec"],
                               "lightning": pins["lightning"]}) == []


@pytest.mark.parametrize("changed, message", [
    ({"torch": "2.10.0"}, "torch 2.10.0 is installed"),
    ({"torch": "2.14.1"}, "torch 2.14.1 is installed"),
    ({"torch": "2.11.0+cu130"}, r"FBGEMM 1\.8\.0 is installed, built for another torch than 2\.11 \(it needs FBGEMM 1\.6\.x: "
                                r"fbgemm-gpu-cpu==1\.6\.\*"),
    ({"torch": "2.11.0", "fbgemm": "1.6.0", "torchrec": "1.6.0"}, r"TorchRec 1\.6\.0 is installed, not the 1\.6\.x \(>= 1\.6\.1\)"),
    ({"lightning": "2.5.6"}, "Lightning 2.5.6 is installed"),
])
def test_a_release_outside_the_supported_set_is_named_with_the_set(changed, message):
    assert _versions.problems(GOOD) == []
    with pytest.raises(_versions.UnsupportedVersionError, match=message) as raised:
        _versions.check({**GOOD, **changed})
    assert "Supported: torch 2.11 with FBGEMM 1.6 and TorchRec 1.6.x (>= 1.6.1); " in str(raised.value)
    assert "torch 2.13 with FBGEMM 1.8 and TorchRec 1.8.x (>= 1.8.0); Lightning 2.6.x" in str(raised.value)


def _import_with_torch(version: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """``import lightning_persia`` in a process where the installed torch's metadata says ``version``."""
    info = tmp_path / f"torch-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import lightning_persia; print('imported')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_import_fails_naming_the_supported_range(tmp_path):
    done = _import_with_torch("2.10.0", tmp_path)
    assert done.returncode != 0
    assert ("lightning_persia._versions.UnsupportedVersionError: lightning-persia does not support the installed "
            "releases: torch 2.10.0 is installed. Supported: torch 2.11 with FBGEMM 1.6") in done.stderr
    skipped = _import_with_torch("2.10.0", tmp_path, LIGHTNING_PERSIA_SKIP_VERSION_CHECK="1")
    assert skipped.returncode == 0 and skipped.stdout.strip() == "imported"


def test_pyproject_declares_the_checked_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["cuda"]
                    + project["optional-dependencies"]["cpu"]]
    spec = {r.name: r.specifier for r in requirements}
    torch_releases = sorted(_versions.PAIRED)
    for (major, minor), ((f_major, f_minor), oldest_torchrec) in _versions.PAIRED.items():
        assert f"{major}.{minor}.0" in spec["torch"]
        for name in ("fbgemm-gpu", "fbgemm-gpu-cpu"):
            assert f"{f_major}.{f_minor}.0" in spec[name]
        assert oldest_torchrec in spec["torchrec"]
    (low_major, low_minor), (high_major, high_minor) = torch_releases[0], torch_releases[-1]
    assert f"{low_major}.{low_minor - 1}.0" not in spec["torch"] and f"{high_major}.{high_minor + 1}.0" not in spec["torch"]
    (f_low, _), (f_high, _) = _versions.PAIRED[torch_releases[0]], _versions.PAIRED[torch_releases[-1]]
    for name in ("fbgemm-gpu", "fbgemm-gpu-cpu", "torchrec"):
        assert f"{f_low[0]}.{f_low[1] - 1}.0" not in spec[name] and f"{f_high[0]}.{f_high[1] + 1}.0" not in spec[name]
    (l_major, l_low), (_, l_high) = _versions.LIGHTNING
    assert f"{l_major}.{l_low}.0" in spec["lightning"] and f"{l_major}.{l_high + 1}.0" not in spec["lightning"]
    assert f"{l_major}.{l_low - 1}.9" not in spec["lightning"]
