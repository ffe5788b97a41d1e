"""Building and loading the native kernels, and their agreement with the tensor hashing."""
import os
import shutil

import pytest
import torch

from lightning_persia.ops import hashing, native


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The loader with an empty cache, no library loaded and not switched off; restored afterwards."""
    monkeypatch.setenv("LIGHTNING_PERSIA_CACHE", str(tmp_path))
    monkeypatch.delenv("LIGHTNING_PERSIA_NATIVE", raising=False)
    native._library.cache_clear()
    yield tmp_path
    native._library.cache_clear()


def test_builds_into_the_cache_where_a_compiler_exists(fresh_build):
    if not os.environ.get("CC") and shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("this test checks the build itself, and this machine has no C compiler (no $CC, cc or gcc) to "
                    "build with; what the library does without one is test_a_failing_compiler_falls_back_with_a_warning_naming_it")
    assert native.available()
    built = list((fresh_build / "native").glob("kernels-*.so"))
    assert len(built) == 1 and not list((fresh_build / "native").glob("*.partial"))


def test_a_failing_compiler_falls_back_with_a_warning_naming_it(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    with pytest.warns(UserWarning, match="native kernels unavailable.*/bin/false could not build kernels.c"):
        assert not native.available()
    with pytest.raises(RuntimeError, match="not available"):
        native.first_foreign(torch.arange(3), 2, 0)
    ids = torch.arange(-100, 100)
    expected = int(torch.nonzero(hashing.shard_of(ids, 3) != 1)[0, 0])
    assert hashing.first_foreign(ids, 3, 1) == expected  # the tensor path answers instead


def test_switched_off_by_the_environment(fresh_build, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PERSIA_NATIVE", "0")
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
