"""Building and loading the native kernels, and their agreement with the tensor hashing."""
import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_persia.ops import hashing, native
from lightning_persia.ops.native._source import library_name


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader with no library loaded and not switched off; ``use(directory)`` makes it look there."""
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    native._library.cache_clear()

    def use(directory: Path) -> None:
        monkeypatch.setattr(native, "_DIRECTORY", directory)
        native._library.cache_clear()

    yield use
    native._library.cache_clear()


def _build(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``setup.py build_ext`` (what pip and ``python -m build`` run) into ``tmp_path``; the package folder it fills."""
    result = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env}, timeout=120,
    )
    return result, tmp_path / "lib" / "lightning_persia" / "ops" / "native"


def test_the_package_build_compiles_the_library_the_loader_loads(fresh_loader, tmp_path):
    if not os.environ.get("CC") and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("this test checks the build itself, and this machine has no C compiler (no $CC, cc or gcc) to "
                    "build with; what the package does without one is test_a_build_without_a_compiler_installs_without_the_library")
    result, folder = _build(tmp_path)
    assert result.returncode == 0, result.stderr
    built = [p.name for p in folder.glob("_kernels_*")]
    assert len(built) == 1 and built[0].startswith(library_name() + "."), built
    fresh_loader(folder)
    assert native.available()
    assert native.first_foreign(torch.tensor([5, 6, 7]), 1, 0) == -1


def test_a_build_without_a_compiler_installs_without_the_library_and_the_tensor_path_runs(fresh_loader, tmp_path):
    result, folder = _build(tmp_path, CC="/bin/false")
    assert result.returncode == 0, result.stderr  # optional extension: the install goes on
    assert "/bin/false" in result.stderr and "failed" in result.stderr
    assert not list(folder.glob("_kernels_*"))
    fresh_loader(folder)
    with pytest.warns(UserWarning, match=f"native kernels unavailable .*no {library_name()}.* built from this kernels.c"):
        assert not native.available()
    with pytest.raises(RuntimeError, match="not available"):
        native.first_foreign(torch.arange(3), 2, 0)
    ids = torch.arange(-100, 100)
    expected = int(torch.nonzero(hashing.shard_of(ids, 3) != 1)[0, 0])
    assert hashing.first_foreign(ids, 3, 1) == expected  # the tensor path answers instead


def test_a_library_built_from_another_version_of_the_source_is_not_loaded(fresh_loader, tmp_path):
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (tmp_path / f"_kernels_0123456789abcdef{suffix}").write_bytes(b"built from another kernels.c")
    fresh_loader(tmp_path)
    with pytest.warns(UserWarning, match="built from this kernels.c"):
        assert not native.available()


def test_switched_off_by_the_environment(fresh_loader, monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert not native.available()


@pytest.mark.parametrize("num_shards", [2, 3, 7])
def test_first_foreign_matches_shard_of(native_kernels, num_shards):
    ids = torch.cat([torch.arange(-500, 500), torch.tensor([(1 << 63) - 1, -(1 << 63)])])
    owners = hashing.shard_of(ids, num_shards)
    for shard in range(num_shards):
        mine = ids[owners == shard]
        assert native.first_foreign(mine, num_shards, shard) == -1
        foreign = torch.nonzero(owners != shard)
        assert native.first_foreign(ids, num_shards, shard) == int(foreign[0, 0])
    assert native.first_foreign(ids[:0], num_shards, 0) == -1


@pytest.mark.parametrize("low,high", [(-1.0, 1.0), (-0.0123, 0.0123), (0.2, 7.7)])
def test_initial_rows_in_c_equal_the_tensor_ones_bit_for_bit(native_kernels, monkeypatch, low, high):
    from lightning_persia.remote_ps.store.initializers import initial_rows
    from lightning_persia.remote_ps.table_config import Normal, Uniform

    ids = torch.cat([torch.arange(-20_000, 20_000), torch.tensor([(1 << 63) - 1, -(1 << 63)])])
    native_rows = [initial_rows(init, 7, "t", ids, 12) for init in (Uniform(low, high), Normal(low, high - low))]
    monkeypatch.setattr(native, "available", lambda: False)
    tensor_rows = [initial_rows(init, 7, "t", ids, 12) for init in (Uniform(low, high), Normal(low, high - low))]
    for a, b in zip(native_rows, tensor_rows):
        assert torch.equal(a, b)
