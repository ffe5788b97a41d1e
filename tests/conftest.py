"""Fixtures shared by the whole suite."""
from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist

from lightning_persia.ops import native
from lightning_persia.ops.native.library import NATIVE_ENV
from lightning_persia.remote_ps.store import native as store_native
from lightning_persia.remote_ps.launcher import LocalShards

# What a Trainer leaves in the environment and the process; a later subprocess would take it for its own launch.
_DDP_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED")


@pytest.fixture(autouse=True, scope="session")
def ctrl_c_reaches_subprocesses():
    """The tests that press Ctrl-C on a run need it to take SIGINT as a terminal's foreground job does. A shell
    that starts the suite in the background (``make test &``) has it ignore SIGINT, and every subprocess would
    inherit that through exec; a handler here is reset to the default in them instead."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(autouse=True)
def clean_distributed():
    """Every test starts without DDP variables (a subprocess would take them for its own launch); any process
    group a test's Trainer created is destroyed after it."""
    saved = {k: os.environ.pop(k, None) for k in _DDP_ENV}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# ---- parameter-server clusters: real shard processes on loopback (`lightning-persia ps serve --port 0`) ----


@pytest.fixture
def native_kernels() -> None:
    """For tests of the C kernels themselves (``lightning_persia.ops.native``, ``lightning_persia.remote_ps.store.native``).

    They are compiled when the package is built (``make native`` in a checkout) with the machine's C compiler;
    without one there is nothing to test, and the library runs its tensor implementation instead, which is
    tested on its own (the "tensor" cases of tests/remote_ps/store/test_index.py, tests/ops/test_hashing.py).
    CI machines have a compiler, and ``make test`` builds the library first.
    """
    if not (native.available() and store_native.available()):
        pytest.skip(f"the native kernels are not in use: {_why_no_native()}. The library then runs its tensor "
                    "implementation, which has its own tests (test_index.py 'tensor' cases, test_hashing.py)")


@pytest.fixture
def disk_tier_kernels() -> None:
    """For tests of ``storage: disk`` tables: the disk tier's id map and record reads exist in C only, so without
    the native kernels a disk table is refused (with an error naming why), and there is nothing to test."""
    if not store_native.available():
        pytest.skip(f"the disk tier needs the native kernels, which are not in use: {_why_no_native()}. Without "
                    "them a disk table is refused with an error saying so (remote_ps/store/disk/tier.py)")


def _why_no_native() -> str:
    if os.environ.get(NATIVE_ENV) == "0":
        return f"{NATIVE_ENV}=0 switches them off for this run"
    return ("the libraries are not built from these sources (`make native`; a build without a working C compiler "
            "skips it; the warning above says more)")

@pytest.fixture(scope="session")
def start_ps_cluster():
    """``start_ps_cluster(num_shards, **LocalShards kwargs) -> LocalShards``; every cluster stops at session end.

    Safe to call from several threads at once (clusters then start in parallel).
    """
    started: list[LocalShards] = []

    def start(num_shards: int, **kwargs) -> LocalShards:
        shards = LocalShards(num_shards, **kwargs)
        started.append(shards)
        return shards

    yield start
    for shards in started:
        shards.stop()


@pytest.fixture(scope="session")
def ps_cluster(start_ps_cluster) -> LocalShards:
    """Two shards (seed 5) shared by the session; tests keep to their own table names."""
    return start_ps_cluster(2, overrides=["seed=5"])
