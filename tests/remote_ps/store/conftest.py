"""Fixtures of the store tests."""
import pytest

from lightning_persia.remote_ps.store import background, chunked_rows


@pytest.fixture(autouse=True)
def _no_background_pass_outlives_its_test():
    """A shard store's demoter or expirer left running would go on working on its tables during the next tests,
    whose patches of the store's modules it would see (a compaction test counting reads saw its reads)."""
    yield
    background.stop_all()


@pytest.fixture(params=["native", "tensor"])
def store_kernels(request, monkeypatch):
    """Runs a test with the native kernels and with the tensor implementation (same results expected)."""
    if request.param == "native":
        request.getfixturevalue("native_kernels")
    else:
        monkeypatch.setattr(chunked_rows.native, "available", lambda: False)
    return request.param


@pytest.fixture
def small_chunks(monkeypatch):
    """Tables in chunks of 1,024 rows (the smallest), so that a few thousand rows span several chunks."""
    monkeypatch.setattr(chunked_rows, "CHUNK_BYTES", 1)
    return 1024
