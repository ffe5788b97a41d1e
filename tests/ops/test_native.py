"""Building and loading the native kernels (the trainer's and the store's libraries), and their agreement with the
tensor implementation."""
import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_persia.ops import native
from lightning_persia.ops.hashing import _SHARD_SALT, mix64, slot_of
from lightning_persia.ops.shard_map import ShardMap, shard_of
from lightning_persia.ops.native import ids as native_ids
from lightning_persia.ops.native._source import library_name, sources
from lightning_persia.ops.native.library import NATIVE_ENV, Library
from lightning_persia.remote_ps.store import native as store_native
from lightning_persia.remote_ps.store.native import rows as native_rows

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"lightning_persia/ops/native": (native, native_ids), "lightning_persia/remote_ps/store/native": (store_native, native_rows)}


def _build(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``setup.py build_ext`` (what pip and ``python -m build`` run) into ``tmp_path``; the folder it fills."""
    result = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env}, timeout=300,
    )
    return result, tmp_path / "lib"


def _installed(tmp_path: Path, folder: str, built: Path) -> Path:
    """``folder``'s sources and what the build put there, side by side as an installed package holds them."""
    target = tmp_path / "installed" / folder
    target.mkdir(parents=True)
    for path in sources(ROOT / folder):
        shutil.copy2(path, target / path.name)
    for path in (built / folder).glob("_kernels_*"):
        shutil.copy2(path, target / path.name)
    return target


@pytest.fixture
def loaders(monkeypatch):
    """``use(package, binding, folder)``: ``package``'s library becomes the one of ``folder``, not loaded yet, with
    ``binding``'s functions declared."""
    monkeypatch.delenv(NATIVE_ENV, raising=False)

    def use(package, binding, folder: Path) -> Library:
        library = Library(folder, "the kernels under test", package.__name__)
        library.declare(binding.SIGNATURES)
        monkeypatch.setattr(package, "LIBRARY", library)
        return library

    return use


def test_the_package_build_compiles_each_library_its_loader_loads(loaders, tmp_path):
    if not os.environ.get("CC") and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("this test checks the build itself, and this machine has no C compiler (no $CC, cc or gcc) to "
                    "build with; what the package does without one is test_a_build_without_a_compiler_installs_without_the_library")
    result, built = _build(tmp_path)
    assert result.returncode == 0, result.stderr
    for folder, (package, binding) in FOLDERS.items():
        libraries = [p.name for p in (built / folder).glob("_kernels_*")]
        assert len(libraries) == 1 and libraries[0].startswith(library_name(ROOT / folder) + "."), libraries
        assert loaders(package, binding, _installed(tmp_path, folder, built)).available()
    assert native_ids.first_foreign(torch.tensor([5, 6, 7]), ShardMap.uniform(1).table, 0) == -1
    assert native_rows.row_bits(torch.tensor([5]), 7, 2).shape == (1, 2)


def test_a_build_without_a_compiler_installs_without_the_library_and_the_tensor_path_runs(loaders, tmp_path):
    result, built = _build(tmp_path, CC="/bin/false")
    assert result.returncode == 0, result.stderr  # optional extensions: the install goes on
    assert "/bin/false" in result.stderr and "failed" in result.stderr
    for folder, (package, binding) in FOLDERS.items():
        assert not list((built / folder).glob("_kernels_*"))
        library = loaders(package, binding, _installed(tmp_path, folder, built))
        with pytest.warns(UserWarning, match=f"unavailable .*no {library_name(ROOT / folder)}.* built from the sources there"):
            assert not library.available()
    with pytest.raises(RuntimeError, match="not available"):
        native_ids.first_foreign(torch.arange(3), ShardMap.uniform(2).table, 0)
    with pytest.raises(RuntimeError, match="not available"):
        native_rows.row_bits(torch.arange(3), 7, 2)
    ids = torch.arange(-100, 100)
    expected = int(torch.nonzero(shard_of(ids, 3) != 1)[0, 0])
    assert ShardMap.uniform(3).first_foreign(ids, 1) == expected  # the tensor path answers instead
    assert torch.equal(slot_of(ids, 4096), mix64(ids ^ _SHARD_SALT) & 4095)


def test_a_library_built_from_another_version_of_the_sources_is_not_loaded(tmp_path):
    folder = ROOT / "lightning_persia/remote_ps/store/native"
    copy = tmp_path / "native"
    copy.mkdir()
    for path in sources(folder):
        shutil.copy2(path, copy / path.name)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (copy / f"{library_name(copy)}{suffix}").write_bytes(b"built from these sources")
    (copy / "store.h").write_text((copy / "store.h").read_text() + "\n")  # a header is a source too
    with pytest.warns(UserWarning, match="built from the sources there"):
        assert not Library(copy, "the kernels under test", "tests").available()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(NATIVE_ENV, "0")
    for folder in FOLDERS:
        assert not Library(ROOT / folder, "the kernels under test", "tests").available()


@pytest.mark.parametrize("shard_map", [ShardMap.uniform(2), ShardMap.uniform(3), ShardMap.uniform(2).resized(3).resized(7)],
                         ids=["uniform-2", "uniform-3", "resized-7"])
def test_first_foreign_matches_the_maps_owners(native_kernels, shard_map):
    ids = torch.cat([torch.arange(-500, 500), torch.tensor([(1 << 63) - 1, -(1 << 63)])])
    owners = shard_map.shard_of(ids)
    for shard in range(shard_map.num_shards):
        mine = ids[owners == shard]
        assert native_ids.first_foreign(mine, shard_map.table, shard) == -1
        foreign = torch.nonzero(owners != shard)
        assert native_ids.first_foreign(ids, shard_map.table, shard) == int(foreign[0, 0])
    assert native_ids.first_foreign(ids[:0], shard_map.table, 0) == -1


def test_first_foreign_refuses_a_table_that_is_not_a_power_of_two(native_kernels):
    with pytest.raises(ValueError, match="power-of-two number of slots, got 3"):
        native_ids.first_foreign(torch.arange(4), torch.zeros(3, dtype=torch.int64), 0)


@pytest.mark.parametrize("slots", [1, 2, 4096, 1 << 20])
def test_slot_of_in_c_equals_the_tensor_hash(native_kernels, slots):
    ids = torch.cat([torch.arange(-500, 500), torch.tensor([(1 << 63) - 1, -(1 << 63)]),
                     torch.randint(-(1 << 62), 1 << 62, (10_000,), generator=torch.Generator().manual_seed(slots))])
    expected = mix64(ids ^ _SHARD_SALT) & (slots - 1)
    assert torch.equal(native_ids.slot_of(ids, slots), expected)
    assert torch.equal(slot_of(ids, slots), expected)  # the hash's own entry point takes the kernel
    assert torch.equal(slot_of(ids.view(2, -1), slots), expected.view(2, -1))  # the tensor path keeps other shapes
    assert native_ids.slot_of(ids[:0], slots).numel() == 0


def test_slot_of_refuses_a_slot_count_that_is_not_a_power_of_two(native_kernels):
    with pytest.raises(ValueError, match="slots must be a power of two, got 3"):
        native_ids.slot_of(torch.arange(4), 3)
    with pytest.raises(ValueError, match="ids must be a 1-D torch.int64 CPU tensor"):
        native_ids.slot_of(torch.arange(4, dtype=torch.int32), 4)


@pytest.mark.parametrize("low,high", [(-1.0, 1.0), (-0.0123, 0.0123), (0.2, 7.7)])
def test_initial_rows_in_c_equal_the_tensor_ones_bit_for_bit(native_kernels, monkeypatch, low, high):
    from lightning_persia.remote_ps.store.initializers import initial_rows
    from lightning_persia.remote_ps.table_config import Normal, Uniform

    ids = torch.cat([torch.arange(-20_000, 20_000), torch.tensor([(1 << 63) - 1, -(1 << 63)])])
    c_rows = [initial_rows(init, 7, "t", ids, 12) for init in (Uniform(low, high), Normal(low, high - low))]
    monkeypatch.setattr(store_native, "available", lambda: False)
    tensor_rows = [initial_rows(init, 7, "t", ids, 12) for init in (Uniform(low, high), Normal(low, high - low))]
    for a, b in zip(c_rows, tensor_rows):
        assert torch.equal(a, b)
