"""A shard process keeps the memory its requests free on its heap (no map and unmap per request)."""
import subprocess
import sys

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
