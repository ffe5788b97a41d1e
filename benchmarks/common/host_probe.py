"""What the machine under a shard does to memory, reads and CPU time, measured apart from any shard.

Three probes, each a baseline for a figure of ``scale_bench.py``:

- **fresh memory**: a new anonymous mapping committed page by page (``MADV_POPULATE_WRITE``, huge pages and 4 kB
  pages), first right after another process freed as much memory, then after ``--settle`` seconds. A guest that
  hands its free memory back to its host (virtio-balloon free page reporting) pays the host for every page it
  touches again: that is the floor of a shard that loads or grows into new memory;
- **cold reads**: a file of ``--read-gb`` read from the disk through the page cache (as a load reads its
  checkpoint) and with ``O_DIRECT`` (no page cache), the page cache dropped before each (root only);
- **canary**: fixed arithmetic, no memory traffic, ~20 ms a round, on one thread per core for ``--canary-s``
  seconds: a round much slower than the median, with the thread's own CPU time grown alike and no steal, was
  slowed by the host, whatever the guest was doing.

    .venv/bin/python -m benchmarks.common.host_probe [--memory-gb 6] [--read-gb 4] [--canary-s 120] [--json]
"""

import argparse
import ctypes
import json
import mmap
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

_GB = 1 << 30
_HUGE = 2 << 20
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _commit_gb_per_s(nbytes: int, huge: bool) -> float:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    started = time.perf_counter()
    for offset in range(0, nbytes, _HUGE):
        if libc.madvise(base + offset, min(_HUGE, nbytes - offset), _MADV_POPULATE_WRITE):
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) refused (Linux >= 5.14)")
    return nbytes / (time.perf_counter() - started) / _GB


def _in_child(function, *args):
    """Runs ``function`` in a new process, so that the memory it commits is new to it and freed when it ends."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


def fresh_memory(nbytes: int, settle_s: float) -> dict:
    out = {}
    for huge in (True, False):
        kind = "huge" if huge else "4k"
        _in_child(_commit_gb_per_s, nbytes, huge)  # frees nbytes as it ends: the next commit finds them warm
        out[f"commit_{kind}_just_freed_gb_per_s"] = _in_child(_commit_gb_per_s, nbytes, huge)
        time.sleep(settle_s)
        out[f"commit_{kind}_settled_gb_per_s"] = _in_child(_commit_gb_per_s, nbytes, huge)
    return out


def drop_page_cache() -> bool:
    """Writes the dirty pages out and drops the page cache (root only): the next read of a file comes from the disk.
    False where it may not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        return False
    return True


def _read_gb_per_s(path: str, direct: bool, block: int = 8 << 20) -> float:
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT asks
    fd = os.open(path, flags)
    total, started = 0, time.perf_counter()
    try:
        while True:
            got = os.readv(fd, [buffer])
            if not got:
                break
            total += got
    finally:
        os.close(fd)
    return total / (time.perf_counter() - started) / _GB


def cold_reads(directory: str, nbytes: int, settle_s: float) -> dict:
    block = os.urandom(8 << 20)
    with tempfile.NamedTemporaryFile(dir=directory, delete=False) as f:
        path = f.name
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
    try:
        out = {}
        for name, direct in (("direct", True), ("page_cache", False)):
            if not drop_page_cache():
                return {"cold_reads": "skipped: dropping the page cache needs root"}
            time.sleep(settle_s)  # the dropped cache's memory goes back to the host meanwhile, as on a restart
            out[f"cold_read_{name}_gb_per_s"] = _read_gb_per_s(path, direct)
        return out
    finally:
        os.unlink(path)


def _canary(seconds: float, queue) -> None:
    rounds, x, ended = [], 1, time.monotonic() + seconds
    while time.monotonic() < ended:
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(200_000):
            x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        rounds.append((time.perf_counter() - wall, time.thread_time() - cpu))
    queue.put(rounds)


def _steal_s() -> float:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def canary(seconds: float) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_canary, args=(seconds, queue)) for _ in range(os.cpu_count() or 1)]
    stolen = _steal_s()
    for worker in workers:
        worker.start()
    rounds = [r for _ in workers for r in queue.get()]
    for worker in workers:
        worker.join()
    median = statistics.median(wall for wall, _ in rounds)
    worst_wall, worst_cpu = max(rounds)
    return {"canary_rounds": len(rounds), "canary_median_s": median, "canary_worst_s": worst_wall,
            "canary_worst_cpu_s": worst_cpu, "canary_over_2x": sum(wall > 2 * median for wall, _ in rounds),
            "canary_cpu_over_2x": sum(cpu > 2 * median for _, cpu in rounds), "canary_host_steal_s": _steal_s() - stolen}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-gb", type=float, default=6.0, help="memory committed by each fresh-memory probe")
    parser.add_argument("--read-gb", type=float, default=4.0, help="size of the file read cold")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds freed memory is left before it is used again")
    parser.add_argument("--canary-s", type=float, default=120.0, help="seconds of the canary (0 skips it)")
    parser.add_argument("--dir", default=".", help="folder of the file read cold (the checkpoints' disk)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args(argv)
    if args.memory_gb <= 0 or args.read_gb <= 0 or args.settle < 0 or args.canary_s < 0:
        parser.error("--memory-gb and --read-gb must be positive, --settle and --canary-s not negative")
    print(f"host_probe: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    out = fresh_memory(int(args.memory_gb * _GB), args.settle)
    print(f"fresh memory, {args.memory_gb:g} GB: huge pages {out['commit_huge_just_freed_gb_per_s']:.2f} GB/s right after a "
          f"process freed it, {out['commit_huge_settled_gb_per_s']:.2f} GB/s {args.settle:g} s later; 4 kB pages "
          f"{out['commit_4k_just_freed_gb_per_s']:.2f} and {out['commit_4k_settled_gb_per_s']:.2f} GB/s", flush=True)
    reads = cold_reads(args.dir, int(args.read_gb * _GB), args.settle)
    out.update(reads)
    if "cold_read_direct_gb_per_s" in reads:
        print(f"cold read, {args.read_gb:g} GB: O_DIRECT {reads['cold_read_direct_gb_per_s']:.2f} GB/s, through the page cache "
              f"{reads['cold_read_page_cache_gb_per_s']:.2f} GB/s", flush=True)
    else:
        print(f"cold read: {reads['cold_reads']}", flush=True)
    if args.canary_s:
        out.update(canary(args.canary_s))
        print(f"canary, {args.canary_s:g} s on {os.cpu_count()} threads: {out['canary_rounds']} rounds of "
              f"{1e3 * out['canary_median_s']:.1f} ms (median); worst {1e3 * out['canary_worst_s']:.1f} ms with "
              f"{1e3 * out['canary_worst_cpu_s']:.1f} ms of the thread's CPU; over 2x the median: {out['canary_over_2x']} by the "
              f"clock, {out['canary_cpu_over_2x']} by the thread's CPU; host steal {out['canary_host_steal_s']:.2f} s", flush=True)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
