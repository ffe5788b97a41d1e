"""Which on-disk structure holds a table's rows past its memory budget: the disk tier's own segments, LMDB or RocksDB.

Each candidate stores ``--rows`` records of a dim-16 fp16 table with row-wise Adagrad (an 8-byte id, 40 bytes of
weights, state and access) as the disk tier receives them: batches of 65,536 demoted rows, ids in no order. Then
it reads batches of 65,536 distinct ids drawn from Zipf(1.1) and uniformly over the stored ones. Printed per
candidate: rows/s written and read (and the worst read batch), bytes on the disk, and the process's memory
(anonymous, and file pages mapped: LMDB reads through a memory map) per stored row.

- ``segments``: :class:`lightning_persia.remote_ps.store.disk.tier.DiskTier` (immutable segments, an 8-byte-an-id map).
- ``lmdb``: the ``lmdb`` binding, one B+tree, 8-byte big-endian keys, ``putmulti`` per batch, ``getmulti`` per read.
- ``rocksdb``: ``rocksdict`` (RocksDB), a write batch per batch, ``get`` of a list of keys (a multi-get) per read.

    .venv/bin/python -m benchmarks.disk.disk_store_bench --rows 1e8 --dir /work/tmp-disk-bench --json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from lightning_persia.remote_ps.store.chunked_rows import FieldSpec
from lightning_persia.remote_ps.store.disk.tier import DiskTier

_ROOT = Path(__file__).resolve().parents[2]

BATCH = 65536
PAYLOAD = 40
_SPECS = {"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float16, 16), "state": FieldSpec(torch.float32, 1),
          "access": FieldSpec(torch.int32)}


def stored_id(index: torch.Tensor) -> torch.Tensor:
    return index * 0x9E3779B1 + 7


def zipf_indices(n: int, count: int, generator: torch.Generator, exponent: float = 1.1) -> torch.Tensor:
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    a = 1.0 - exponent
    return ((((n ** a - 1.0) * u + 1.0) ** (1.0 / a)).long() - 1).clamp(0, n - 1)


def memory() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def folder_bytes(path: str) -> int:
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files)


class Segments:
    def __init__(self, path: str) -> None:
        self.tier = DiskTier(path, _SPECS)

    def write(self, ids: torch.Tensor, payload: torch.Tensor) -> None:
        n = ids.numel()
        self.tier.write({"ids": ids, "weights": payload[:, :32].contiguous().view(torch.float16),
                         "state": payload[:, 32:36].contiguous().view(torch.float32),
                         "access": payload[:, 36:40].contiguous().view(torch.int32).reshape(n)})

    def read(self, ids: torch.Tensor) -> int:
        slots, _ = self.tier.find(ids)
        return int((slots >= 0).sum())

    def close(self) -> None:
        self.tier.close()


class Lmdb:
    def __init__(self, path: str) -> None:
        import lmdb

        self.env = lmdb.open(path, map_size=1 << 40, writemap=False, sync=False, metasync=False, readahead=False,
                             max_dbs=0, lock=True)

    def write(self, ids: torch.Tensor, payload: torch.Tensor) -> None:
        keys = ids.numpy().astype(">i8").tobytes()
        values = payload.numpy().tobytes()
        items = [(keys[i * 8 : i * 8 + 8], values[i * PAYLOAD : (i + 1) * PAYLOAD]) for i in range(ids.numel())]
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(items)

    def read(self, ids: torch.Tensor) -> int:
        keys = ids.numpy().astype(">i8").tobytes()
        with self.env.begin() as txn:
            found = txn.cursor().getmulti([keys[i * 8 : i * 8 + 8] for i in range(ids.numel())])
        return len(found)

    def close(self) -> None:
        self.env.close()


class Rocks:
    def __init__(self, path: str) -> None:
        from rocksdict import Options, Rdict, WriteBatch

        options = Options(raw_mode=True)
        options.set_write_buffer_size(64 << 20)
        self._batch = WriteBatch
        self.db = Rdict(path, options)

    def write(self, ids: torch.Tensor, payload: torch.Tensor) -> None:
        keys = ids.numpy().astype(">i8").tobytes()
        values = payload.numpy().tobytes()
        batch = self._batch(raw_mode=True)
        for i in range(ids.numel()):
            batch.put(keys[i * 8 : i * 8 + 8], values[i * PAYLOAD : (i + 1) * PAYLOAD])
        self.db.write(batch)

    def read(self, ids: torch.Tensor) -> int:
        keys = ids.numpy().astype(">i8").tobytes()
        found = self.db.get([keys[i * 8 : i * 8 + 8] for i in range(ids.numel())])
        return sum(v is not None for v in found)

    def close(self) -> None:
        self.db.close()


CANDIDATES = {"segments": Segments, "lmdb": Lmdb, "rocksdb": Rocks}


def run(name: str, rows: int, directory: str, reads: int, write_limit_s: float) -> dict:
    path = os.path.join(directory, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    before = memory()
    store = CANDIDATES[name](path)
    generator = torch.Generator().manual_seed(1)
    order = torch.randperm(rows, generator=generator)  # demotions come in no order of id
    started = time.perf_counter()
    written = 0
    for start in range(0, rows, BATCH):
        index = order[start : start + BATCH]
        payload = torch.randint(0, 256, (index.numel(), PAYLOAD), dtype=torch.uint8, generator=generator)
        store.write(stored_id(index), payload)
        written += index.numel()
        if time.perf_counter() - started > write_limit_s:  # the reads then draw from the rows written
            break
    write_s = time.perf_counter() - started
    stored = order[:written].sort().values  # the indices stored; reads draw ranks over them
    del order
    out = {"candidate": name, "rows": written, "rows_asked": rows, "write_s": write_s, "write_rows_per_s": written / write_s,
           "disk_bytes": folder_bytes(path)}
    rows = written
    for stream in ("zipf", "uniform"):
        times, hits, total = [], 0, 0
        for _ in range(reads):
            drawn = zipf_indices(rows, BATCH, generator) if stream == "zipf" else torch.randint(0, rows, (BATCH,), generator=generator)
            ids = stored_id(stored[torch.unique(drawn)])
            ids = ids[torch.randperm(ids.numel(), generator=generator)]
            started = time.perf_counter()
            hits += store.read(ids)
            times.append(time.perf_counter() - started)
            total += ids.numel()
        if hits != total:
            raise RuntimeError(f"{name}: {total - hits} of {total} stored ids not found")
        out[f"{stream}_read_rows_per_s"] = total / sum(times)
        out[f"{stream}_worst_read_s"] = max(times)
    after = memory()
    out["anon_bytes_per_row"] = (after["RssAnon"] - before["RssAnon"]) / rows
    out["file_mapped_bytes_per_row"] = (after["RssFile"] - before["RssFile"]) / rows
    out["disk_bytes_per_row"] = out["disk_bytes"] / rows
    store.close()
    shutil.rmtree(path, ignore_errors=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=float, default=1e8)
    parser.add_argument("--dir", required=True, help="a folder on the disk to measure (emptied of each candidate's files after it)")
    parser.add_argument("--candidates", default="segments,lmdb,rocksdb")
    parser.add_argument("--reads", type=int, default=20, help="read batches of each stream")
    parser.add_argument("--write-limit-s", type=float, default=3600.0,
                        help="stop writing a candidate after this long (its figures are then those of the rows it wrote)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"disk_store_bench: {int(args.rows):,} rows; load average {os.getloadavg()[0]:.1f}", flush=True)
    names = args.candidates.split(",")
    if len(names) > 1:  # each candidate in a process of its own: its memory figures are its own
        results = []
        for name in names:
            command = [sys.executable, "-m", "benchmarks.disk.disk_store_bench", "--rows", str(args.rows), "--dir", args.dir, "--reads", str(args.reads),
                       "--candidates", name, "--write-limit-s", str(args.write_limit_s), "--json"]
            lines = subprocess.run(command, check=True, capture_output=True, text=True, cwd=_ROOT).stdout.strip().splitlines()
            results += json.loads(lines[-1])["results"]
    else:
        results = [run(names[0], int(args.rows), args.dir, args.reads, args.write_limit_s)]
    for result in results:
        name = result["candidate"]
        print(f"{name:>9}: {result['rows']:,} rows (of {result['rows_asked']:,} asked) in {result['write_s']:.0f} s: write {result['write_rows_per_s'] / 1e6:.2f} M rows/s  zipf read {result['zipf_read_rows_per_s'] / 1e6:.2f} M rows/s "
              f"(worst batch {result['zipf_worst_read_s']:.3f} s)  uniform read {result['uniform_read_rows_per_s'] / 1e6:.2f} M rows/s "
              f"(worst {result['uniform_worst_read_s']:.3f} s)  disk {result['disk_bytes_per_row']:.1f} B/row  memory "
              f"{result['anon_bytes_per_row']:.1f} B/row anonymous + {result['file_mapped_bytes_per_row']:.1f} B/row file pages", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
