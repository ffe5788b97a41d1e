"""Parameter-server scale benchmark: one table grown to hundreds of millions of rows in real shard processes.

Grows a table of dim 16 (row-wise Adagrad) through gRPC, as a trainer would (training lookups of new ids,
``--request-ids`` = 65,536 ids a request), and at each size of ``--sizes`` (up to ``--max-rows``) prints:

- lookup rows/s of stored ids (uniform over them, and Zipf 1.1) and update rows/s, 65,536-id requests, one at a time;
- the worst latency of an inserting request so far (the table growing: chunk allocation, index growth), as the
  client saw it (with the time the hypervisor stole from this machine's cores meanwhile, from ``/proc/stat``), as
  the shard held the table's lock for it (what it cost the shard's other requests), and the CPU time that took (the
  same on a machine of its own: wall times here include waiting for the shared cores);
- beside it, the control: the worst latency of the requests that insert nothing (a training lookup of
  ``--request-ids`` stored ids after every ``--control-every`` inserting requests), and how many requests of each kind
  took over 0.1 s: a machine that stalls every process now and then shows as slow requests of both kinds;
- the shard's resident memory (VmRSS), bytes per row and per parameter;
- save and load seconds (``Save``/``Load`` RPCs of the whole shard; the load replaces the grown table) beside a
  plain write and read of as many bytes in the same folder, the shard's CPU time in each (its own code's, and the
  kernel's: page cache copies, and for a load committing the fresh memory of every row), the extra peak memory of each over the shard's resident
  memory before it (VmHWM, reset before each), and, from a second save while another client trains (lookup +
  update rounds of 65,536 ids), that client's worst round trip: how long the save stops training;
- with ``--restart``, the load of the same checkpoint into a restarted shard process (which holds no table, so it
  reads the checkpoint once, checking the checksums as it reads the rows), with ``--cold`` from the disk, beside a
  plain read of the checkpoint's files from the disk (the page cache dropped before each); the table then grows
  on in that process.

With ``--storage disk`` the table keeps ``--memory-rows`` rows in memory (its budget) and the rest in the shard's
disk tier (``--disk-dir``): each size also prints the rows and bytes on disk, and the Zipf(1.1) lookup rate against
that of an all-in-memory table of ``--memory-baseline-rows`` rows grown first in a shard of its own (the same
stream: same seed and exponent, each over its own table's rows; where the disk table reaches that size, both are
measured there in turns of 25 requests, the memory table's shard kept up until then and the disk table's stopped
during the memory table's turns: ``paired_zipf_rates``): the steady rate, after ``--zipf-warmup`` requests timed
apart (the cold rate: the growth leaves the newest ids in memory, the stream's head on disk, and the LRU policy
replaces them only as the stream brings rows in: at 100M rows, 40M in memory, a request of 131,072 ids promoted
10.5k rows over the first 1,000 requests and ~3.5k from the 6,000th on, so ``--zipf-warmup 6000`` measures the
steady state there) with the CPU of a steady request by process (the disk shard's demoter apart), and the worst
CPU the disk tier's work (reads, promotions, demotions) took in one request or one step of the shard's demoter,
beside the slowest run of a memory-bound canary job in this process over the same wall time (``MemoryCanary``: a
stall of the whole machine shows in both), and the worst of the table's few worst during which the canary saw no
stall. Growth stops before the disk's free space falls under ``--reserve-disk-gb``.

Then, with ``--multi-shard``, the same table spread over 1, 2 and 4 shard processes on this machine: memory and
aggregate rows/s. Every size of one run is measured in the same shard process; the machine is shared with the
client (2 cores here), so compare figures of one run. ``--json`` prints one JSON object on the last line.

    .venv/bin/python -m benchmarks.ps.scale_bench --json                         # fp32 and fp16 up to --max-rows
    .venv/bin/python -m benchmarks.ps.scale_bench --dtypes fp16 --max-rows 3.2e8
    .venv/bin/python -m benchmarks.ps.scale_bench --quick                        # 2M rows, a minute
    .venv/bin/python -m benchmarks.ps.scale_bench --storage disk --dtypes fp16 --sizes 1e8,5e8,1e9 --max-rows 1e9 \
        --memory-rows 5e7 --disk-dir /work/tmp-tier --multi-shard "" --save-from 1e9 --json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from benchmarks.common.host_probe import drop_page_cache
from benchmarks.ps.ps_bench import rss_bytes
from lightning_persia.remote_ps.allocator import ALLOCATORS, JEMALLOC, preloads_jemalloc, shard_environment
from lightning_persia.remote_ps.client import PSClient, PSError
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

TABLE = "scale"
DIM = 16
_MULTIPLIER = 0x9E3779B1  # odd: the i-th stored id, i * M + 7, is distinct for every i
_GB = 1e9
_SLOW_S = 0.1
"""A request slower than this counts as slow (the issue's bound on an inserting request)."""
_HELD_PARTS = {"worst_insert_held_s": "worst_insert_s", "worst_insert_cpu_s": "worst_insert_cpu_s",
               "worst_insert_runnable_s": "worst_insert_runnable_s", "worst_insert_blocked_s": "worst_insert_blocked_s"}
"""This benchmark's figures of the longest an inserting request held its table, from the shard's table stats."""


def stored_id(index: torch.Tensor) -> torch.Tensor:
    """The id of the ``index``-th row the benchmark stored."""
    return index * _MULTIPLIER + 7


_WORST_DISK_WORK = ("cpu_s", "of", "sys_s", "demoting_s")  # the table stats worst_disk_work_<key> a run keeps
PAIRED_BLOCK = 25  # Zipf requests of one table before the other's turn, in a paired measurement
_STALLED = 3.0
"""A canary run this many times its median or slower says the machine stalled (its runs otherwise stay under 2x)."""


def zipf_indices(n: int, count: int, generator: torch.Generator, exponent: float = 1.1) -> torch.Tensor:
    """``count`` indices in ``[0, n)`` drawn from a (continuous, truncated) power law of ``exponent``: index 0 hottest."""
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    a = 1.0 - exponent
    x = ((n ** a - 1.0) * u + 1.0) ** (1.0 / a)
    return (x.long() - 1).clamp(0, n - 1)


def unique_batch(indices: torch.Tensor) -> torch.Tensor:
    return stored_id(torch.unique(indices))


@dataclass
class Shards:
    """The shard processes of one configuration and a client."""

    shards: LocalShards
    client: PSClient

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.shards.processes]

    def rss(self) -> int:
        return sum(rss_bytes(pid) for pid in self.pids)

    def cpu_s(self) -> tuple[float, float]:
        """Seconds of CPU the shard processes have used so far: in their own code (user) and in the kernel."""
        ticks = os.sysconf("SC_CLK_TCK")
        user = kernel = 0.0
        for pid in self.pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            user, kernel = user + int(fields[11]) / ticks, kernel + int(fields[12]) / ticks
        return user, kernel

    def reset_peaks(self) -> None:
        for pid in self.pids:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current VmRSS

    def peaks(self) -> int:
        return sum(rss_bytes(pid, "VmHWM") for pid in self.pids)

    def close(self) -> None:
        self.client.close()
        self.shards.stop()


def start(num_shards: int, dtype: str, overrides: Sequence[str], configure: bool = True, memory_rows: int = 0,
          eviction: str = "lru", allocator: str = "auto", env: Optional[dict] = None) -> Shards:
    """Shard processes and a client; ``memory_rows`` makes the table a disk table of that memory budget (the
    overrides then name the shards' ``disk_dir``), whose ``eviction`` policy chooses the rows it demotes. ``env``:
    variables the shards' environment adds (``LocalShards``)."""
    shards = LocalShards(num_shards, overrides=["max_ids_per_request=4194304", "torch_threads=1", *overrides], allocator=allocator,
                         env=env)
    client = PSClient(shards.addresses, timeout_s=600.0, checkpoint_timeout_s=7200.0)
    client.wait_healthy(120)
    if configure:
        storage = {"capacity": memory_rows, "storage": "disk"} if memory_rows else {"capacity": (1 << 31) - 1}
        client.configure([TableConfig(TABLE, DIM, optimizer=Adagrad(lr=0.01, rowwise=True), storage_dtype=dtype, eviction=eviction,
                                      **storage)])
    return Shards(shards, client)


def zipf_rates(shards: Shards, rows: int, request_ids: int, repeats: int, warmup: int) -> tuple[float, float]:
    """Training-lookup rows/s of the benchmark's Zipf(1.1) stream over ``rows`` stored rows (a fixed seed): over its
    first ``warmup`` requests (cold: a disk table's hot rows are where the growth left them), then over the
    ``repeats`` requests that follow (the stream's steady rate, its head in memory as a trainer's would be)."""
    generator = torch.Generator().manual_seed(1234)
    batches = [unique_batch(zipf_indices(rows, request_ids, generator)) for _ in range(warmup + repeats)]
    def call(batch: torch.Tensor) -> None:
        shards.client.lookup({TABLE: batch}, train=True)

    cold = _timed_rate(call, batches[:warmup]) if warmup else float("nan")
    return cold, _timed_rate(call, batches[warmup:])


def paired_zipf_rates(disk: Shards, memory: Shards, rows: int, request_ids: int, repeats: int, warmup: int) -> dict:
    """The Zipf rates of :func:`zipf_rates` for a disk table and an all-in-memory one of the same ``rows``, over the
    same stream, measured in alternating blocks of :data:`PAIRED_BLOCK` requests: both tables see the machine of the
    same minutes (the memory table's rate measured alone moved between 2.9M and 6.3M rows/s from run to run on this
    VM). The disk shard's processes are stopped (SIGSTOP) during the memory table's blocks, so that its background
    work (the demoter bringing in, demoting and compacting what the disk table's requests left it) runs during the
    disk table's own blocks, and counts in its rate alone.

    Also the CPU of a steady request, in ms (``cpu_ms_per_request``): each table's shard processes (``disk_shard``,
    ``memory_shard``; the disk shard's demoter thread apart, ``disk_demoter``, from the shard's stats) and this
    process, the client (``client_disk``, ``client_memory``), each over its table's blocks; and the wall time a
    steady request waited for each table's lock (``lock_wait_ms_per_request``: behind the disk table's demoter)."""
    generator = torch.Generator().manual_seed(1234)
    batches = [unique_batch(zipf_indices(rows, request_ids, generator)) for _ in range(warmup + repeats)]
    phases = (batches[:warmup], batches[warmup:])
    spent = {"disk": [0.0, 0.0], "memory": [0.0, 0.0]}
    cpu = {"disk_shard": 0.0, "memory_shard": 0.0, "client_disk": 0.0, "client_memory": 0.0}  # the steady phase's
    turns: list[list[float]] = [[], []]  # of each phase, the memory table's time of each turn over the disk table's
    for phase, part in enumerate(phases):
        if phase == 1:
            demoter_before = demoter_cpu_s(disk)
            waited_before = {name: lock_wait_s(shards) for name, shards in (("disk", disk), ("memory", memory))}
        for first in range(0, len(part), PAIRED_BLOCK):
            block = part[first : first + PAIRED_BLOCK]
            took = {}
            for name, shards in (("disk", disk), ("memory", memory)):
                with stopped(disk) if name == "memory" else contextlib.nullcontext():
                    shard_cpu, client_cpu, began = sum(shards.cpu_s()), time.process_time(), time.perf_counter()
                    for batch in block:
                        shards.client.lookup({TABLE: batch}, train=True)
                    took[name] = time.perf_counter() - began
                    spent[name][phase] += took[name]
                    if phase == 1:
                        cpu[f"{name}_shard"] += sum(shards.cpu_s()) - shard_cpu
                        cpu[f"client_{name}"] += time.process_time() - client_cpu
            turns[phase].append(took["memory"] / took["disk"])
    cpu["disk_demoter"] = demoter_cpu_s(disk) - demoter_before if phases[1] else 0.0
    waited = {name: (lock_wait_s(shards) - waited_before[name]) * 1e3 / len(phases[1]) if phases[1] else 0.0
              for name, shards in (("disk", disk), ("memory", memory))}
    looked_up = [sum(b.numel() for b in part) for part in phases]

    def rates(name: str) -> tuple[float, float]:  # (over the warmup, steady)
        return tuple(looked_up[p] / spent[name][p] if spent[name][p] else float("nan") for p in (0, 1))

    def spread(ratios: list[float]) -> tuple[float, float, float]:  # (lowest, median, highest) of the turns' ratios
        ratios = sorted(ratios)
        return (ratios[0], ratios[len(ratios) // 2], ratios[-1]) if ratios else (float("nan"),) * 3

    return {"disk": rates("disk"), "memory": rates("memory"), "turn_ratios": spread(turns[1]), "turn_ratios_cold": spread(turns[0]),
            "cpu_ms_per_request": {key: seconds * 1e3 / max(len(phases[1]), 1) for key, seconds in cpu.items()},
            "lock_wait_ms_per_request": waited}


def lock_wait_s(shards: Shards) -> float:
    """Seconds requests have waited for the benchmark table's lock on ``shards`` so far (NaN: a shard that does not count it)."""
    return sum(shard["tables"][TABLE].get("lock_wait_s", float("nan")) for shard in shards.client.stats())


def demoter_cpu_s(shards: Shards) -> float:
    """CPU seconds the demoter threads of ``shards`` have spent so far (the shards' stats; NaN: a shard whose code does
    not count it)."""
    return sum(shard["server"].get("background_cpu_s", {}).get("demoter", float("nan")) for shard in shards.client.stats())


@contextlib.contextmanager
def stopped(shards: Shards) -> Iterator[None]:
    """``shards``' processes stopped (every thread of them) meanwhile."""
    for pid in shards.pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in shards.pids:
            os.kill(pid, signal.SIGCONT)


def memory_baseline(args, dtype: str, keep: bool = False) -> tuple[dict, Optional[Shards]]:
    """The Zipf lookup rate of an all-in-memory table of ``--memory-baseline-rows`` rows, in a shard of its own;
    with ``keep``, that shard stays up (returned) for a :func:`paired_zipf_rates` measurement at the same size."""
    shards = start(1, dtype, [o for o in args.ps_override if not o.startswith("disk_dir=")], allocator=args.allocator)
    try:
        rows = 0
        while rows < args.memory_baseline_rows:
            count = min(args.request_ids, args.memory_baseline_rows - rows)
            shards.client.lookup({TABLE: stored_id(torch.arange(rows, rows + count))}, train=True)
            rows += count
        out = {"rows": rows, "rss_bytes": shards.rss()}
        if not keep:
            cold, steady = zipf_rates(shards, rows, args.request_ids, args.repeats, args.zipf_warmup)
            out.update(zipf_rows_per_s=steady, zipf_cold_rows_per_s=cold)
    except BaseException:
        shards.close()
        raise
    if keep:
        print(f"[{dtype}] memory baseline: {rows:,} rows in memory, RSS {out['rss_bytes'] / _GB:.2f} GB; its Zipf lookups "
              f"are measured in turns with the disk table's at {rows:,} rows", flush=True)
        return out, shards
    shards.close()
    print(f"[{dtype}] memory baseline: {rows:,} rows in memory, Zipf lookups {out['zipf_rows_per_s'] / 1e6:.2f} M rows/s "
          f"(its first {args.zipf_warmup} requests {out['zipf_cold_rows_per_s'] / 1e6:.2f}), "
          f"RSS {out['rss_bytes'] / _GB:.2f} GB", flush=True)
    return out, None


def disk_free() -> int:
    """Bytes free on the file system of the disk tier (or of the working folder)."""
    return shutil.disk_usage(_DISK_DIR[0] if _DISK_DIR else ".").free


_DISK_DIR: list[str] = []


def rate(call, batches: list[torch.Tensor]) -> float:
    """Rows per second of ``call`` over ``batches`` (one request at a time), after one warm-up request."""
    call(batches[0])
    return _timed_rate(call, batches)


def _timed_rate(call, batches: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    for batch in batches:
        call(batch)
    return sum(b.numel() for b in batches) / (time.perf_counter() - started)


def measure_rates(shards: Shards, rows: int, request_ids: int, repeats: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    uniform = [unique_batch(torch.randint(0, rows, (request_ids,), generator=generator)) for _ in range(repeats)]
    zipf = [unique_batch(zipf_indices(rows, request_ids, generator)) for _ in range(repeats)]
    grads = torch.randn(request_ids, DIM, generator=generator) * 1e-3
    client = shards.client
    return {
        "lookup_rows_per_s": rate(lambda b: client.lookup({TABLE: b}, train=True), uniform),
        "lookup_zipf_rows_per_s": rate(lambda b: client.lookup({TABLE: b}, train=True), zipf),
        "zipf_unique_ratio": sum(b.numel() for b in zipf) / (repeats * request_ids),
        "update_rows_per_s": rate(lambda b: client.update({TABLE: (b, grads[: b.numel()])}), uniform),
    }


class _Trainer(threading.Thread):
    """Another client that looks up and updates stored rows while a save runs; records its worst round trip."""

    def __init__(self, addresses: list[str], rows: int, request_ids: int) -> None:
        super().__init__(daemon=True)
        self.client = PSClient(addresses, timeout_s=600.0)
        self.rows, self.request_ids = rows, request_ids
        self.stop = threading.Event()
        self.worst = 0.0
        self.rounds = 0
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        generator = torch.Generator().manual_seed(99)
        grads = torch.randn(self.request_ids, DIM, generator=generator) * 1e-3
        try:
            while not self.stop.is_set():
                ids = unique_batch(torch.randint(0, self.rows, (self.request_ids,), generator=generator))
                started = time.perf_counter()
                self.client.lookup({TABLE: ids}, train=True)
                self.client.update({TABLE: (ids, grads[: ids.numel()])})
                self.worst = max(self.worst, time.perf_counter() - started)
                self.rounds += 1
        except BaseException as error:  # noqa: BLE001 - reported by the caller
            self.error = error
        finally:
            self.client.close()


def disk_speeds(directory: str, nbytes: int, block: int = 8 << 20) -> tuple[float, float]:
    """GB/s of a plain sequential write (then fsync) and read of ``nbytes`` in ``directory``: what a save and a load
    would reach if they cost nothing but the file system, measured right before them."""
    path = os.path.join(directory, "disk-speed.bin")
    data = os.urandom(block)
    os.makedirs(directory, exist_ok=True)
    started = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // block)):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - started) / _GB
    started = time.perf_counter()
    with open(path, "rb") as f:
        buffer = bytearray(block)
        while f.readinto(buffer):
            pass
    read = nbytes / (time.perf_counter() - started) / _GB
    os.unlink(path)
    return write, read


def _fmt_ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _fmt_s(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s"


def folder_bytes(directory: str) -> int:
    """Bytes of every file under ``directory`` (a checkpoint's size)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def save_and_load(shards: Shards, directory: str, rows: int, request_ids: int, train_during_save: bool = True) -> dict:
    """Saves the shard(s) twice, alone (its speed) and with a training client running (the client's worst round
    trip: how long the save stops training; left out without ``train_during_save``), then loads the checkpoint back
    in place."""
    shutil.rmtree(directory, ignore_errors=True)
    disk_write, disk_read = disk_speeds(directory, min(2 << 30, rows * 100))
    before = shards.rss()
    shards.reset_peaks()
    cpu, started = shards.cpu_s(), time.perf_counter()
    shards.client.save(directory)
    save_s = time.perf_counter() - started
    save_cpu = [after - before for before, after in zip(cpu, shards.cpu_s())]
    save_peak = shards.peaks() - before
    size = folder_bytes(directory)
    trained_save_s = trained_save_peak = worst_round = rounds = None
    if train_during_save:
        trainer = _Trainer(shards.shards.addresses, rows, request_ids)
        shutil.rmtree(directory, ignore_errors=True)
        shards.reset_peaks()
        trainer.start()
        time.sleep(0.5)
        started = time.perf_counter()
        shards.client.save(directory)
        trained_save_s = time.perf_counter() - started
        trainer.stop.set()
        trainer.join()
        if trainer.error is not None:
            raise RuntimeError(f"the training client failed during the save: {trainer.error}")
        trained_save_peak = shards.peaks() - before
        worst_round, rounds = trainer.worst, trainer.rounds
    before_load = shards.rss()
    shards.reset_peaks()
    cpu, started = shards.cpu_s(), time.perf_counter()
    shards.client.load(directory)
    load_s = time.perf_counter() - started
    load_cpu = [after - before for before, after in zip(cpu, shards.cpu_s())]
    load_peak = shards.peaks()
    return {"disk_write_gb_per_s": disk_write, "disk_read_gb_per_s": disk_read,
            "save_s": save_s, "save_peak_extra_bytes": max(save_peak, trained_save_peak or 0), "checkpoint_bytes": size,
            "save_gb_per_s": size / save_s / _GB, "save_while_training_s": trained_save_s,
            "save_user_cpu_s": save_cpu[0], "save_kernel_cpu_s": save_cpu[1],
            "load_s": load_s, "load_gb_per_s": size / load_s / _GB, "load_user_cpu_s": load_cpu[0], "load_kernel_cpu_s": load_cpu[1],
            "load_peak_bytes": load_peak, "rss_before_load": before_load, "worst_train_round_during_save_s": worst_round,
            "train_rounds_during_save": rounds}


def restart_and_load(shards: Shards, directory: str, dtype: str, cold: bool, overrides: Sequence[str],
                     allocator: str = "auto") -> tuple[Shards, dict]:
    """Stops the shard process(es) and loads the checkpoint at ``directory`` into new ones, as a restarted
    shard does (a shard that holds no table reads the checkpoint once: checksums as it reads the rows); with
    ``cold``, from the disk (the page cache dropped first: root only). Returns the new shards and the figures."""
    count = len(shards.pids)
    shards.close()
    size = folder_bytes(directory)
    dropped, plain_read = False, None
    if cold:
        dropped = drop_page_cache()
        if not dropped:
            print("restart: the page cache stays (dropping it needs root): the load reads what it holds", flush=True)
        else:
            # the baseline of a load from the disk: the same files read plainly, from the disk, the same minute
            started = time.perf_counter()
            _read_folder(directory)
            plain_read = size / (time.perf_counter() - started) / _GB
            drop_page_cache()
    shards = start(count, dtype, overrides, configure=False, allocator=allocator)
    cpu, started = shards.cpu_s(), time.perf_counter()
    shards.client.load(directory)
    seconds = time.perf_counter() - started
    used = [after - before for before, after in zip(cpu, shards.cpu_s())]
    return shards, {"restart_load_s": seconds, "restart_load_gb_per_s": size / seconds / _GB, "restart_load_cold": dropped,
                    "restart_plain_read_gb_per_s": plain_read,
                    "restart_load_user_cpu_s": used[0], "restart_load_kernel_cpu_s": used[1]}


def _read_folder(directory: str, block: int = 8 << 20) -> None:
    """Reads every file under ``directory`` once, sequentially, through the page cache (as ``cat`` does)."""
    buffer = bytearray(block)
    for folder, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(folder, name), "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass


class MemoryCanary:
    """A fixed memory-bound job run every 20 ms on a thread of this process (a gather of 65,536 random values of a
    256 MB tensor, ~2 ms): its CPU time a run says when the whole machine's memory accesses slowed (a host stall slows
    every thread of every process alike; on this VM one took a lookup's probe of the index from ~5 ms to 43 ms while
    this job's run took 5x its median, benchmarks/results/disk-tier/2026-11-26-17-promotions-left-to-the-demoter.md). :meth:`during` gives the slowest run
    within a span of wall time, e.g. the shard's worst disk work."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self._interval_s = interval_s
        self._runs: list[tuple[float, float, float]] = []  # (start, end) in Unix time, and the thread's CPU seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-canary", daemon=True)

    def start(self) -> "MemoryCanary":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        values = torch.arange(32 << 20)  # 256 MB
        picks = torch.randint(0, values.numel(), (1 << 16,), generator=torch.Generator().manual_seed(3))
        while not self._stop.wait(self._interval_s):
            began, cpu = time.time(), time.thread_time()
            values[picks].sum()
            self.add_run(began, time.time(), time.thread_time() - cpu)

    def add_run(self, start: float, end: float, cpu_s: float) -> None:
        """A run of the job from ``start`` to ``end`` (Unix time) that took ``cpu_s`` of its thread's CPU."""
        self._runs.append((start, end, cpu_s))

    @property
    def median_s(self) -> Optional[float]:
        runs = sorted(cpu for _, _, cpu in self._runs)
        return runs[len(runs) // 2] if runs else None

    def during(self, ended_at: float, wall_s: float) -> Optional[float]:
        """The most CPU a run took among those that overlapped the ``wall_s`` before ``ended_at`` (Unix time)."""
        overlapping = [cpu for start, end, cpu in self._runs if end >= ended_at - wall_s and start <= ended_at]
        return max(overlapping) if overlapping else None

    def worst_calm(self, operations: list[dict]) -> tuple[Optional[dict], Optional[float]]:
        """Of ``operations`` (a table's ``worst_disk_works``), the heaviest during which no run of this job took
        :data:`_STALLED` times its median or more (a run overlapped it: a span no run saw is not called calm), and
        this job's slowest run during it; ``(None, None)`` when the machine stalled during each."""
        median = self.median_s
        for operation in sorted(operations, key=lambda o: -o["cpu_s"]):
            slowest = self.during(operation["at"], operation["wall_s"])
            if median and slowest is not None and slowest < _STALLED * median:
                return operation, slowest
        return None, None


def host_steal_s() -> float:
    """Seconds the hypervisor has kept this machine's cores from running it, summed over the cores (0 on bare
    metal): a request's latency that grew with it was the host's, not the shard's."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return 0.0
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def memory_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def grow(args, dtype: str) -> dict:
    """Grows one shard's table through ``args.sizes``; returns what was measured at each size."""
    baseline, paired = None, None  # a baseline of a size the disk table passes is measured in turns with it there
    if args.storage == "disk" and args.memory_baseline_rows:
        baseline, paired = memory_baseline(args, dtype, keep=args.memory_baseline_rows in args.sizes)
    try:
        shards = start(1, dtype, args.ps_override, memory_rows=args.memory_rows if args.storage == "disk" else 0,
                       eviction=args.eviction, allocator=args.allocator)
    except BaseException:
        if paired is not None:
            paired.close()
        raise
    out = {"dtype": dtype, "storage": args.storage, "sizes": [], "max_rows": 0, "stopped": "", "memory_baseline": baseline}
    checkpoint_dir = tempfile.mkdtemp(prefix="scale-bench-", dir=args.checkpoint_dir)
    state = {"shards": shards, "paired": paired, "canary": MemoryCanary().start()}
    try:
        return _grow_sizes(args, dtype, state, out, baseline, checkpoint_dir)
    except KeyboardInterrupt:  # Ctrl-C (or SIGINT) ends the run with the sizes measured so far
        out["stopped"] = f"interrupted after {out['sizes'][-1]['rows'] if out['sizes'] else 0:,} rows measured"
        return out
    finally:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        state["shards"].close()
        state["canary"].stop()
        if state["paired"] is not None:
            state["paired"].close()


def _grow_sizes(args, dtype: str, state: dict, out: dict, baseline: Optional[dict], checkpoint_dir: str) -> dict:
    """The growth and the figures of each size (``state["shards"]``: the shards, replaced by a restart)."""
    shards = state["shards"]
    rows = 0
    worst_insert = worst_insert_steal = 0.0
    worst_parts = dict.fromkeys(_HELD_PARTS, 0.0)  # the table's own worst figures restart with each load
    inserts: list[float] = []
    controls: list[float] = []  # training lookups of stored ids only, between the inserting requests
    generator = torch.Generator().manual_seed(7)
    for size in args.sizes:
        segment_ids, segment_s = 0, 0.0  # the inserting requests since the previous size
        while rows < size:
            count = min(args.request_ids, size - rows)
            per_row = shards.rss() / max(rows, 1) if rows > 1_000_000 else 0
            # stop before the kernel has to kill something: room for this step, a save's chunk and the client
            if per_row and memory_available() < args.reserve_gb * _GB + count * per_row:
                out["stopped"] = f"stopped growing at {rows:,} rows: {memory_available() / _GB:.1f} GB left on the machine"
                return out
            if args.storage == "disk" and len(inserts) % 64 == 0 and disk_free() < args.reserve_disk_gb * _GB:
                out["stopped"] = f"stopped growing at {rows:,} rows: {disk_free() / _GB:.1f} GB left on the disk"
                return out
            ids = stored_id(torch.arange(rows, rows + count))
            stolen, started = host_steal_s(), time.perf_counter()
            shards.client.lookup({TABLE: ids}, train=True)
            inserts.append(time.perf_counter() - started)
            segment_ids, segment_s = segment_ids + count, segment_s + inserts[-1]
            if inserts[-1] > worst_insert:
                worst_insert, worst_insert_steal = inserts[-1], host_steal_s() - stolen
            rows += count
            if len(inserts) % args.control_every == 0:
                stored = unique_batch(torch.randint(0, rows, (args.request_ids,), generator=generator))
                started = time.perf_counter()
                shards.client.lookup({TABLE: stored}, train=True)
                controls.append(time.perf_counter() - started)
        stats = shards.client.stats()[0]["tables"][TABLE]
        rss = shards.rss()
        worst_parts = {key: max(worst_parts[key], stats[stat]) for key, stat in _HELD_PARTS.items()}
        entry = {"rows": rows, "worst_insert_s": worst_insert, "worst_insert_host_steal_s": worst_insert_steal, **worst_parts,
                 "insert_p99_s": sorted(inserts)[int(0.99 * (len(inserts) - 1))],
                 "insert_rows_per_s": segment_ids / segment_s if segment_s else None,
                 "slow_inserts": sum(t > _SLOW_S for t in inserts), "inserts": len(inserts),
                 "worst_control_s": max(controls, default=0.0), "slow_controls": sum(t > _SLOW_S for t in controls),
                 "controls": len(controls),
                 "rss_bytes": rss, "bytes_per_row": rss / rows,
                 "bytes_per_param": rss / rows / DIM, "store_bytes_per_row": stats["bytes"] / rows,
                 "index_bytes_per_row": stats["index_bytes"] / rows}
        if args.storage == "disk":
            entry.update({"disk_rows": stats["disk_rows"], "disk_bytes": stats["disk_bytes"], "memory_rows": stats["rows"],
                          "disk_map_bytes": stats["disk_map_bytes"], "shards_rss_bytes": rss,
                          "demoted": stats["demoted"], "promoted": stats["promoted"]})
        entry.update(measure_rates(shards, rows, args.request_ids, args.repeats, seed=rows))
        if args.storage == "disk":
            promoted = shards.client.stats()[0]["tables"][TABLE]["promoted"]
            if state["paired"] is not None and rows == baseline["rows"]:
                paired = paired_zipf_rates(shards, state["paired"], rows, args.request_ids, args.repeats, args.zipf_warmup)
                state["paired"].close()  # its memory goes back before the table grows on
                state["paired"] = None
                (cold, steady), (memory_cold, memory_steady) = paired["disk"], paired["memory"]
                baseline.update(zipf_rows_per_s=memory_steady, zipf_cold_rows_per_s=memory_cold, paired=True)
                low, median, high = paired["turn_ratios"]
                entry["lookup_ratio_disk_vs_memory_turns"] = [low, median, high]
                entry["lookup_ratio_disk_vs_memory_turns_cold"] = list(paired["turn_ratios_cold"])
                entry["zipf_cpu_ms_per_request"] = used = paired["cpu_ms_per_request"]
                entry["zipf_lock_wait_ms_per_request"] = waited = paired["lock_wait_ms_per_request"]
                print(f"[{dtype}] memory baseline, in turns of {PAIRED_BLOCK} requests with the disk table (its shard stopped "
                      f"meanwhile): Zipf lookups {memory_steady / 1e6:.2f} M rows/s (its first {args.zipf_warmup} requests "
                      f"{memory_cold / 1e6:.2f}); the disk table's rate over the memory table's, turn by turn after the "
                      f"first {args.zipf_warmup}: median {median:.2f}x, from {low:.2f}x to {high:.2f}x; CPU a steady request: "
                      f"disk shard {used['disk_shard']:.2f} ms (its demoter {used['disk_demoter']:.2f}), memory shard "
                      f"{used['memory_shard']:.2f} ms; the client {used['client_disk']:.2f} ms and "
                      f"{used['client_memory']:.2f} ms; waiting for the table's lock {waited['disk']:.2f} ms and "
                      f"{waited['memory']:.2f} ms", flush=True)
            else:
                cold, steady = zipf_rates(shards, rows, args.request_ids, args.repeats, args.zipf_warmup)
            entry["zipf_same_stream_rows_per_s"], entry["zipf_same_stream_cold_rows_per_s"] = steady, cold
            table_stats = shards.client.stats()[0]["tables"][TABLE]
            for key in _WORST_DISK_WORK:
                entry[f"worst_disk_work_{key}"] = table_stats[f"worst_disk_work_{key}"]
            canary = state["canary"]
            entry["canary_median_s"] = canary.median_s
            entry["canary_during_worst_disk_work_s"] = canary.during(table_stats["worst_disk_work_at"],
                                                                     table_stats["worst_disk_work_wall_s"])
            calm, calm_canary = canary.worst_calm(table_stats["worst_disk_works"])
            entry["worst_calm_disk_work_cpu_s"] = calm["cpu_s"] if calm else None
            entry["worst_calm_disk_work_of"] = calm["of"] if calm else ""
            entry["worst_calm_disk_work_demoting_s"] = calm["demoting_s"] if calm else None
            entry["canary_during_worst_calm_disk_work_s"] = calm_canary
            entry["worst_disk_works"] = table_stats["worst_disk_works"]
            entry["disk_mapped_bytes"], entry["rss_after_zipf_bytes"] = table_stats["disk_mapped_bytes"], shards.rss()
            entry["disk_bytes_after_zipf"], entry["promoted_in_zipf"] = table_stats["disk_bytes"], table_stats["promoted"] - promoted
            if baseline is not None and "zipf_rows_per_s" in baseline:
                entry["lookup_ratio_disk_vs_memory"] = steady / baseline["zipf_rows_per_s"]
                entry["lookup_ratio_disk_vs_memory_cold"] = cold / baseline["zipf_cold_rows_per_s"]
            print(f"[{dtype}] {rows:>13,} rows  disk tier: {entry['memory_rows']:,} rows in memory, {entry['disk_rows']:,} on disk "
                  f"({entry['disk_bytes'] / _GB:.2f} GB; map {entry['disk_map_bytes'] / _GB:.2f} GB)  Zipf lookups "
                  f"{entry['zipf_same_stream_rows_per_s'] / 1e6:.2f} M rows/s"
                  + (f" = {entry['lookup_ratio_disk_vs_memory']:.2f}x the {baseline['rows']:,}-row table in memory"
                     if "lookup_ratio_disk_vs_memory" in entry else "")
                  + f" (its first {args.zipf_warmup} requests {cold / 1e6:.2f} M rows/s"
                  + (f" = {entry['lookup_ratio_disk_vs_memory_cold']:.2f}x" if "lookup_ratio_disk_vs_memory" in entry else "") + ")"
                  + f"; the worst CPU of the disk tier's work in one request or demoter step {entry['worst_disk_work_cpu_s']:.3f} s"
                  + f" ({entry['worst_disk_work_of']}: {entry['worst_disk_work_sys_s']:.3f} s of it in the kernel,"
                  + f" {entry['worst_disk_work_demoting_s']:.3f} s demoting; the memory canary's slowest run during it "
                  + f"{_fmt_ms(entry['canary_during_worst_disk_work_s'])} against its median {_fmt_ms(entry['canary_median_s'])})"
                  + (f"; the worst of the table's {len(table_stats['worst_disk_works'])} worst during which the canary ran under"
                     f" {_STALLED:g}x its median: {_fmt_s(entry['worst_calm_disk_work_cpu_s'])} ({entry['worst_calm_disk_work_of']},"
                     f" {_fmt_s(entry['worst_calm_disk_work_demoting_s'])} demoting; the canary's slowest run during it"
                     f" {_fmt_ms(calm_canary)})" if calm else
                     f"; the canary ran {_STALLED:g}x its median or slower during each of the table's"
                     f" {len(table_stats['worst_disk_works'])} worst")
                  + f"; after them {entry['disk_mapped_bytes'] / _GB:.2f} GB of records mapped,"
                  + f" RSS {entry['rss_after_zipf_bytes'] / _GB:.2f} GB, {entry['promoted_in_zipf']:,} rows promoted,"
                  + f" disk {entry['disk_bytes_after_zipf'] / _GB:.2f} GB",
                  flush=True)
        print(f"[{dtype}] {rows:>13,} rows  lookup {entry['lookup_rows_per_s'] / 1e6:5.2f} M/s  "
              f"update {entry['update_rows_per_s'] / 1e6:5.2f} M/s  insert {_fmt_rate(entry['insert_rows_per_s'])}/s  worst insert {worst_insert:5.3f} s "
              f"(host steal in it {worst_insert_steal:5.3f} s; table held {entry['worst_insert_held_s']:5.3f} s: at most {entry['worst_insert_cpu_s']:5.3f} s of CPU, "
              f"{entry['worst_insert_runnable_s']:5.3f} s waiting for a core, {entry['worst_insert_blocked_s']:5.3f} s blocked)  "
              f"RSS {rss / _GB:5.2f} GB  {entry['bytes_per_param']:.2f} B/param", flush=True)
        print(f"[{dtype}] {rows:>13,} rows  control: worst lookup of stored ids {entry['worst_control_s']:5.3f} s; over {_SLOW_S} s "
              f"so far: {entry['slow_inserts']} of {entry['inserts']} inserting requests, {entry['slow_controls']} of "
              f"{entry['controls']} lookups of stored ids", flush=True)
        if rows >= args.save_from and (not args.save_sizes or rows in args.save_sizes):
            try:
                entry.update(save_and_load(shards, checkpoint_dir, rows, args.request_ids, not args.no_train_during_save))
                if args.restart:
                    shards, restarted = restart_and_load(shards, checkpoint_dir, dtype, args.cold, args.ps_override, args.allocator)
                    state["shards"] = shards
                    entry.update(restarted)
            except (PSError, RuntimeError, OSError) as error:
                out["stopped"] = f"save/load at {rows:,} rows failed: {error}"
                out["sizes"].append(entry)
                return out
            print(f"[{dtype}] {rows:>13,} rows  save {entry['save_s']:.1f} s ({entry['save_gb_per_s']:.2f} GB/s; plain write "
                  f"{entry['disk_write_gb_per_s']:.2f}; +{entry['save_peak_extra_bytes'] / _GB:.2f} GB peak, worst train round "
                  f"{_fmt_s(entry['worst_train_round_during_save_s'])})  load {entry['load_s']:.1f} s ({entry['load_gb_per_s']:.2f} GB/s; "
                  f"plain read {entry['disk_read_gb_per_s']:.2f})", flush=True)
            print(f"[{dtype}] {rows:>13,} rows  shard CPU: save {entry['save_user_cpu_s']:.1f} s own code + {entry['save_kernel_cpu_s']:.1f} s kernel, "
                  f"load {entry['load_user_cpu_s']:.1f} s own code + {entry['load_kernel_cpu_s']:.1f} s kernel", flush=True)
            if args.restart:
                print(f"[{dtype}] {rows:>13,} rows  restarted shard: load {entry['restart_load_s']:.1f} s "
                      f"({entry['restart_load_gb_per_s']:.2f} GB/s, {'from the disk' if entry['restart_load_cold'] else 'page cache kept'}; "
                      + (f"a plain read of its files from the disk {entry['restart_plain_read_gb_per_s']:.2f} GB/s; "
                         if entry["restart_plain_read_gb_per_s"] is not None else "") +
                      f"shard CPU {entry['restart_load_user_cpu_s']:.1f} s own code + {entry['restart_load_kernel_cpu_s']:.1f} s kernel)",
                      flush=True)
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
            out["max_rows"] = rows
        out["sizes"].append(entry)
    return out


def multi_shard(args) -> list[dict]:
    """The same table over 1, 2 and 4 shard processes: memory and aggregate rows/s."""
    out = []
    for count in args.multi_shard:
        shards = start(count, "fp16", args.ps_override, allocator=args.allocator)
        try:
            rows = 0
            while rows < args.multi_rows:
                n = min(args.request_ids, args.multi_rows - rows)
                shards.client.lookup({TABLE: stored_id(torch.arange(rows, rows + n))}, train=True)
                rows += n
            entry = {"shards": count, "rows": rows, "rss_bytes": shards.rss(), "bytes_per_row": shards.rss() / rows}
            entry.update(measure_rates(shards, rows, args.request_ids, args.repeats, seed=count))
            out.append(entry)
            print(f"[{count} shard(s)] {rows:,} rows  lookup {entry['lookup_rows_per_s'] / 1e6:5.2f} M/s  "
                  f"update {entry['update_rows_per_s'] / 1e6:5.2f} M/s  RSS {entry['rss_bytes'] / _GB:.2f} GB", flush=True)
        finally:
            shards.close()
    return out


def _fmt_rate(value: Optional[float]) -> str:
    return f"{value / 1e6:.2f}M" if value else "-"


def print_tables(results: dict) -> None:
    for run in results["grow"]:
        print(f"\n### storage {run['dtype']}: one shard process, dim {DIM}, row-wise Adagrad"
              + (f" ({run['stopped']})" if run["stopped"] else ""))
        print("| rows | lookup rows/s | zipf lookup rows/s | update rows/s | new ids/s | worst insert: client [host steal in it] (table held; at most: CPU, waiting for a core, blocked) | control: worst stored-id lookup (over 0.1 s: inserts, lookups) | RSS | B/row | B/param "
              "| save s (GB/s; plain write) | save extra peak | worst train round in save | load s (GB/s; plain read) [shard CPU s: own code + kernel] | load peak |")
        print("|" + "---|" * 15)
        for e in run["sizes"]:
            saved = "save_s" in e
            print(f"| {e['rows']:,} | {_fmt_rate(e['lookup_rows_per_s'])} | {_fmt_rate(e['lookup_zipf_rows_per_s'])} "
                  f"| {_fmt_rate(e['update_rows_per_s'])} | {_fmt_rate(e['insert_rows_per_s'])} | {e['worst_insert_s']:.3f} s [{e['worst_insert_host_steal_s']:.3f}] ({e['worst_insert_held_s']:.3f}; "
                  f"{e['worst_insert_cpu_s']:.3f}, {e['worst_insert_runnable_s']:.3f}, {e['worst_insert_blocked_s']:.3f}) "
                  f"| {e['worst_control_s']:.3f} s ({e['slow_inserts']}/{e['inserts']}, {e['slow_controls']}/{e['controls']}) "
                  f"| {e['rss_bytes'] / _GB:.2f} GB "
                  f"| {e['bytes_per_row']:.1f} | {e['bytes_per_param']:.2f} "
                  + (f"| {e['save_s']:.1f} ({e['save_gb_per_s']:.2f}; {e['disk_write_gb_per_s']:.2f}) | {e['save_peak_extra_bytes'] / _GB:.2f} GB "
                     f"| {_fmt_s(e['worst_train_round_during_save_s'])} | {e['load_s']:.1f} ({e['load_gb_per_s']:.2f}; {e['disk_read_gb_per_s']:.2f}) [{e['load_user_cpu_s']:.1f} + {e['load_kernel_cpu_s']:.1f}] "
                     f"| {e['load_peak_bytes'] / _GB:.2f} GB |" if saved else "| - | - | - | - | - |"))
    if results["multi_shard"]:
        print("\n### one table over several shard processes on this machine (fp16 storage)")
        print("| shards | rows | RSS (all) | B/row | lookup rows/s | update rows/s |")
        print("|---|---|---|---|---|---|")
        for e in results["multi_shard"]:
            print(f"| {e['shards']} | {e['rows']:,} | {e['rss_bytes'] / _GB:.2f} GB | {e['bytes_per_row']:.1f} "
                  f"| {_fmt_rate(e['lookup_rows_per_s'])} | {_fmt_rate(e['update_rows_per_s'])} |")


def summary(results: dict) -> dict:
    out: dict = {}
    for run in results["grow"]:
        out[f"max_rows_{run['dtype']}"] = run["max_rows"]
        for e in run["sizes"]:
            key = f"{run['dtype']}_{e['rows']}"
            out[f"lookup_rows_per_s_{key}"] = e["lookup_rows_per_s"]
            out[f"update_rows_per_s_{key}"] = e["update_rows_per_s"]
    sizes = [e for run in results["grow"] for e in run["sizes"]]
    worst = max(sizes, key=lambda e: e["worst_insert_s"], default=None)
    out["worst_insert_s"] = worst["worst_insert_s"] if worst else None
    out["worst_insert_host_steal_s"] = worst["worst_insert_host_steal_s"] if worst else None
    out["worst_control_s"] = max((e["worst_control_s"] for e in sizes), default=None)
    last = [run["sizes"][-1] for run in results["grow"] if run["sizes"]]  # the counts are cumulative over a run
    for key in ("slow_inserts", "inserts", "slow_controls", "controls"):
        out[key] = sum(e[key] for e in last)
    for key in _HELD_PARTS:
        out[key] = max((e[key] for e in sizes), default=None)
    out["save_peak_extra_bytes"] = max((e["save_peak_extra_bytes"] for e in sizes if "save_s" in e), default=None)
    disk = [e for e in sizes if "disk_rows" in e]
    if disk:
        largest = max(disk, key=lambda e: e["rows"])
        for key in ("disk_rows", "disk_bytes", "shards_rss_bytes", "memory_rows", "disk_map_bytes"):
            out[key] = largest[key]
        out["rows"] = largest["rows"]
        out["shards_rss_bytes_max"] = max(max(e["shards_rss_bytes"], e.get("rss_after_zipf_bytes", 0)) for e in disk)
        ratios = [e["lookup_ratio_disk_vs_memory"] for e in disk if "lookup_ratio_disk_vs_memory" in e]
        out["lookup_ratio_disk_vs_memory"] = ratios[-1] if ratios else None
        out["lookup_ratio_disk_vs_memory_min"] = min(ratios) if ratios else None
        colds = [e["lookup_ratio_disk_vs_memory_cold"] for e in disk if "lookup_ratio_disk_vs_memory_cold" in e]
        out["lookup_ratio_disk_vs_memory_cold"] = colds[-1] if colds else None
        turns = [e["lookup_ratio_disk_vs_memory_turns"] for e in disk if "lookup_ratio_disk_vs_memory_turns" in e]
        out["lookup_ratio_disk_vs_memory_turns_median"] = turns[-1][1] if turns else None
        worst = max(disk, key=lambda e: e["worst_disk_work_cpu_s"])
        for key in _WORST_DISK_WORK:
            out[f"worst_disk_work_{key}"] = worst[f"worst_disk_work_{key}"]
        out["canary_during_worst_disk_work_s"], out["canary_median_s"] = worst["canary_during_worst_disk_work_s"], worst["canary_median_s"]
        calm = [e for e in disk if e["worst_calm_disk_work_cpu_s"] is not None]
        if calm:
            worst = max(calm, key=lambda e: e["worst_calm_disk_work_cpu_s"])
            for key in ("worst_calm_disk_work_cpu_s", "worst_calm_disk_work_of", "worst_calm_disk_work_demoting_s",
                        "canary_during_worst_calm_disk_work_s"):
                out[key] = worst[key]
        for key in ("save_s", "load_s", "restart_load_s", "checkpoint_bytes"):
            if key in largest:
                out[key] = largest[key]
    for run in results["grow"]:
        by_rows = {e["rows"]: e for e in run["sizes"]}
        if 1_000_000 in by_rows and 100_000_000 in by_rows:
            out[f"lookup_ratio_100m_vs_1m_{run['dtype']}"] = by_rows[100_000_000]["lookup_rows_per_s"] / by_rows[1_000_000]["lookup_rows_per_s"]
        if run["dtype"] == "fp16" and run["sizes"]:
            out["bytes_per_param_fp16"] = run["sizes"][-1]["bytes_per_param"]
    ratios = [v for k, v in out.items() if k.startswith("lookup_ratio_100m_vs_1m_")]
    out["lookup_ratio_100m_vs_1m"] = min(ratios) if ratios else None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp32,fp16", help="storage dtypes to grow a table with, in turn")
    parser.add_argument("--sizes", default="1e6,1e7,5e7,1e8,2e8,2.3e8,3e8,3.5e8", help="rows at which to measure")
    parser.add_argument("--max-rows", type=float, default=3.5e8, help="stop growing here")
    parser.add_argument("--save-from", type=float, default=1e6, help="save and load at every size from this one")
    parser.add_argument("--save-sizes", default="", help="save and load only at these sizes (of --sizes; '' : every size from --save-from)")
    parser.add_argument("--request-ids", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=20, help="requests per rate figure")
    parser.add_argument("--control-every", type=int, default=4, help="a lookup of stored ids after this many inserting requests")
    parser.add_argument("--no-train-during-save", action="store_true",
                        help="save once, without the training client beside it (whose uniform lookups of stored ids, at a "
                             "billion rows on this VM, are reads of the disk that hold the table for seconds each)")
    parser.add_argument("--restart", action="store_true", help="after each load, also load the checkpoint into a restarted shard")
    parser.add_argument("--cold", action="store_true", help="--restart from the disk: drop the page cache first (root)")
    parser.add_argument("--reserve-gb", type=float, default=1.5, help="stop growing when less memory than this would be left")
    parser.add_argument("--checkpoint-dir", default=None, help="where the checkpoints go (deleted after each load)")
    parser.add_argument("--multi-shard", default="1,2,4", help="shard counts for the multi-process figures ('' skips)")
    parser.add_argument("--multi-rows", type=float, default=2e7, help="rows of the multi-process figures")
    parser.add_argument("--quick", action="store_true", help="2M rows, 1 and 2 shards of 1M rows: a smoke run")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--storage", choices=("memory", "disk"), default="memory", help="the table's storage")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                        help="the shards' malloc (LocalShards: jemalloc where the system has it, by default)")
    parser.add_argument("--memory-rows", type=float, default=5e7, help="--storage disk: the table's memory budget (rows)")
    parser.add_argument("--eviction", choices=("lru", "lfu"), default="lru",
                        help="--storage disk: which rows the table demotes (the least recently or least often looked up)")
    parser.add_argument("--disk-dir", default=None, help="--storage disk: the shards' disk_dir (a fresh folder under it; deleted after)")
    parser.add_argument("--memory-baseline-rows", type=float, default=1e8,
                        help="--storage disk: rows of the all-in-memory table whose Zipf lookup rate is the baseline (0: none)")
    parser.add_argument("--zipf-warmup", type=int, default=20,
                        help="Zipf requests timed apart (cold) before the --repeats that give the stream's steady rate")
    parser.add_argument("--reserve-disk-gb", type=float, default=10.0, help="--storage disk: stop growing with less disk free than this")
    parser.add_argument("--ps-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a PS config setting of the shard processes, e.g. malloc_trim_interval_s=0 (repeatable)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.max_rows, args.multi_rows, args.multi_shard, args.repeats = "1e6,2e6", 2e6, 1e6, "1,2", 5
    args.sizes = [int(float(s)) for s in args.sizes.split(",") if float(s) <= args.max_rows]
    args.save_from = int(args.save_from)
    args.save_sizes = {int(float(s)) for s in args.save_sizes.split(",") if s}
    args.multi_rows = int(args.multi_rows)
    args.multi_shard = [int(s) for s in args.multi_shard.split(",") if s]
    args.memory_rows = int(args.memory_rows)
    args.memory_baseline_rows = int(args.memory_baseline_rows)
    tier_dir = None
    if args.storage == "disk":
        tier_dir = tempfile.mkdtemp(prefix="scale-bench-tier-", dir=args.disk_dir)
        _DISK_DIR.append(tier_dir)
        args.ps_override = [*args.ps_override, f"disk_dir={tier_dir}"]
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not args.sizes or any(d not in ("fp16", "fp32") for d in dtypes):
        parser.error("--sizes needs a size <= --max-rows and --dtypes only fp16, fp32")
    if args.control_every < 1:
        parser.error("--control-every must be at least 1")
    malloc = JEMALLOC if preloads_jemalloc(shard_environment(args.allocator, os.environ)) else "the system's"
    print(f"scale_bench: {os.cpu_count()} cores, {memory_available() / _GB:.1f} GB available, load average "
          f"{os.getloadavg()[0]:.1f}; sizes {args.sizes}; the shards' malloc: {malloc}"
          + (f"; shards with {' '.join(args.ps_override)}" if args.ps_override else ""), flush=True)
    try:
        results = {"grow": [grow(args, dtype) for dtype in dtypes], "multi_shard": multi_shard(args)}
    finally:
        if tier_dir is not None:
            shutil.rmtree(tier_dir, ignore_errors=True)
    for run in results["grow"]:
        if run["stopped"]:
            print(f"[{run['dtype']}] {run['stopped']}")
    print_tables(results)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        print(json.dumps({**summary(results), "shards_malloc": malloc, "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
