"""A shard process's malloc: jemalloc where the system has it (the launchers preload it); else glibc's, keeping
the memory its requests free on its heap (no map and unmap per request)."""
import ctypes.util
import os
import subprocess
import sys

import pytest

from lightning_persia.remote_ps.allocator import JEMALLOC, SYSTEM, shard_environment

_NEEDS_JEMALLOC = pytest.mark.skipif(
    ctypes.util.find_library(JEMALLOC) is None,
    reason="checks that shards run on jemalloc, which this system lacks (to run it: apt install libjemalloc2). "
    "jemalloc is optional: without it the shards run on the system's malloc, which this file's other tests check",
)

# A fresh interpreter (the settings are the process's): count the blocks malloc maps on their own for 8 MB
# allocations, freed in between, as a request's temporary tensors are.
_SCRIPT = """
import ctypes, sys
from lightning_persia.remote_ps.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
mapped, before = 0, libc.mallinfo2().hblks  # importing the package mapped some blocks already
for size in (8 << 20, 12 << 20, 16 << 20):
    block = libc.malloc(size)
    mapped += libc.mallinfo2().hblks - before
    libc.free(block)
print(mapped)
"""


def _mapped_blocks(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_requests_temporary_blocks_come_from_the_heap_once_the_shard_keeps_freed_memory():
    assert _mapped_blocks("default") > 0  # glibc maps blocks of MBs on their own by default
    assert _mapped_blocks("keep") == 0


def test_a_process_without_glibcs_mallopt_keeps_its_defaults(monkeypatch):
    from lightning_persia.remote_ps import allocator

    class NoMallopt:
        def __init__(self, name):
            pass

    monkeypatch.setattr(allocator.ctypes, "CDLL", NoMallopt)
    assert allocator.keep_freed_memory() is False


def test_the_launchers_environment_preloads_jemalloc_where_the_system_has_it(monkeypatch):
    from lightning_persia.remote_ps import allocator

    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: "libjemalloc.so.2" if name == "jemalloc" else None)
    env = {"PATH": "/bin", "LD_PRELOAD": "libother.so"}
    assert allocator.shard_environment("auto", env) == {"PATH": "/bin", "LD_PRELOAD": "libjemalloc.so.2 libother.so"}
    assert allocator.shard_environment("jemalloc", {})["LD_PRELOAD"] == "libjemalloc.so.2"
    assert allocator.shard_environment("system", env) == env
    already = {"LD_PRELOAD": "/opt/lib/libjemalloc.so.2"}
    assert allocator.shard_environment("auto", already) == already  # not preloaded twice


def test_without_jemalloc_auto_keeps_the_environment_and_jemalloc_is_an_error(monkeypatch):
    from lightning_persia.remote_ps import allocator

    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
    assert allocator.shard_environment("auto", {"PATH": "/bin"}) == {"PATH": "/bin"}
    with pytest.raises(allocator.AllocatorError, match="no libjemalloc on this system.*apt install libjemalloc2"):
        allocator.shard_environment("jemalloc", {})
    with pytest.raises(ValueError, match="allocator must be one of auto, jemalloc, system; got 'tcmalloc'"):
        allocator.shard_environment("tcmalloc", {})


def _maps_jemalloc(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libjemalloc" in maps.read()


@_NEEDS_JEMALLOC
def test_local_shards_run_under_jemalloc_unless_told_otherwise():
    from lightning_persia.remote_ps.launcher import LocalShards

    with LocalShards(1) as shards:
        assert _maps_jemalloc(shards.processes[0].pid)
        assert "malloc is jemalloc's" in shards.output(0)
    with LocalShards(1, allocator=SYSTEM, env={"LD_PRELOAD": ""}) as shards:
        assert not _maps_jemalloc(shards.processes[0].pid)


@pytest.mark.parametrize("allocator", [SYSTEM, pytest.param(JEMALLOC, marks=_NEEDS_JEMALLOC)])
def test_a_process_reports_the_malloc_it_runs_with(allocator):
    script = ("from lightning_persia.remote_ps.allocator import keep_freed_memory, running_allocator; "
              "print(running_allocator(), keep_freed_memory())")
    env = shard_environment(allocator, {**os.environ, "LD_PRELOAD": ""})
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [allocator, "True"]  # glibc's settings taken, or nothing to set under jemalloc
