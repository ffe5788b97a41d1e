"""A change to the disk tier against its baseline: the Zipf lookup rate of a disk table served by another commit's
code and by this checkout's, measured in turns (with ``--memory-table``, beside the all-in-memory table).

    .venv/bin/python -m benchmarks.disk.disk_ab_bench --baseline 6de8b14 --disk-dir /work/tmp-ab       # 100M rows, 40M in memory
    .venv/bin/python -m benchmarks.disk.disk_ab_bench --baseline HEAD --rows 2e4 --memory-rows 1e4 --warmup 25 --repeats 50 \\
        --request-ids 4096 --disk-dir /tmp/ab --memory-table
    .venv/bin/python -m benchmarks.disk.disk_ab_bench --baseline HEAD --baseline-eviction lru --eviction lfu --disk-dir /work/tmp-ab

A shard a table: the baseline's disk table (``git archive`` of ``--baseline`` into a folder under ``--disk-dir``,
its native kernels built there), this checkout's disk table, and with ``--memory-table`` an all-in-memory table (this
checkout's). At 100M rows the three take ~15 GB of resident memory and their disk tables' files ~9 GB of page
cache: more than the development VM's 24 GB, so the memory table is left out by default. Each shard runs the package
of its own folder (``PYTHONPATH``, and ``PYTHONSAFEPATH`` so that the folder the benchmark runs in does not come first). The tables
are grown alike to ``--rows`` by training lookups, then the Zipf(1.1) stream of ``scale_bench.py`` (its seed) runs in
turns of :data:`scale_bench.PAIRED_BLOCK` requests, the other shards stopped meanwhile (``malloc_bench.measure``): every
shard sees the machine of the same minutes, whose speed moved the memory table's rate between 4.2M and 8.3M rows/s
from run to run on the development VM (benchmarks/results/2026-11-27-disk-tier.md, experiments 18 to 24). Prints each shard's rate and
CPU, this checkout's rate over the baseline's (the whole, and turn by turn), and each table's over the memory
table's where it ran; with ``--json``, one JSON object on the last line. ``--baseline-eviction`` gives the baseline's
table another eviction policy than ``--eviction`` (with ``--baseline HEAD``: one policy against another, same code).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from benchmarks.ps import scale_bench
from benchmarks.ps.malloc_bench import describe, grow_and_measure, turns
from benchmarks.ps.scale_bench import Shards

_CHECKOUT = Path(__file__).resolve().parents[2]
_BASELINE, _CHANGED, _MEMORY = "baseline", "this checkout", "memory"


def baseline_tree(commit: str, folder: Path) -> Path:
    """The package of ``commit`` (of this checkout's repository) unpacked into ``folder``, its native kernels built
    there (a few seconds; each library's name carries the digest of its sources, so the shard loads its own)."""
    found = subprocess.run(["git", "-C", str(_CHECKOUT), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode:
        raise SystemExit(f"disk_ab_bench: --baseline {commit!r} is not a commit of the repository at {_CHECKOUT}")
    folder.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(_CHECKOUT), "archive", found.stdout.strip(), "lightning_persia", "setup.py"],
                               stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(folder)], stdin=archive.stdout, check=True)
    archive.stdout.close()
    if archive.wait():
        raise SystemExit(f"disk_ab_bench: git archive of {commit!r} failed")
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=folder, check=True,
                   stdout=subprocess.DEVNULL)
    return folder


def start(tree: Path, memory_rows: int, disk_dir: Optional[Path], eviction: str) -> Shards:
    """One shard running the package under ``tree``, its table a disk table of ``memory_rows`` in memory under
    ``disk_dir`` (None: all in memory)."""
    overrides = []
    if disk_dir is not None:
        disk_dir.mkdir(parents=True)
        overrides.append(f"disk_dir={disk_dir}")
    return scale_bench.start(1, "fp16", overrides, memory_rows=memory_rows if disk_dir is not None else 0, eviction=eviction,
                             env={"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"})


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the commit whose disk tier this checkout's is measured against")
    parser.add_argument("--disk-dir", required=True, help="a folder for the baseline's package and both disk tiers (emptied after)")
    parser.add_argument("--rows", type=float, default=1e8, help="rows of each table (default 1e8)")
    parser.add_argument("--memory-rows", type=float, default=4e7, help="the disk tables' memory budget (default 4e7)")
    parser.add_argument("--eviction", choices=("lru", "lfu"), default="lru", help="which rows the disk tables demote")
    parser.add_argument("--baseline-eviction", choices=("lru", "lfu"),
                        help="which rows the baseline's disk table demotes, where not as --eviction (a policy against another)")
    parser.add_argument("--warmup", type=int, default=8000, help="Zipf requests before the timed ones (default 8000)")
    parser.add_argument("--repeats", type=int, default=400, help="timed Zipf requests (default 400)")
    parser.add_argument("--request-ids", type=int, default=131072, help="Zipf draws a request (default 131072)")
    parser.add_argument("--memory-table", action="store_true",
                        help="also the all-in-memory table, in the same turns (~6.3 GB more resident memory at 100M rows)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args(argv)
    rows, memory_rows = int(args.rows), int(args.memory_rows)
    evictions = {_BASELINE: args.baseline_eviction or args.eviction, _CHANGED: args.eviction}
    if not 0 < memory_rows < rows or args.repeats < 1 or args.warmup < 0 or args.request_ids < 1:
        parser.error("needs 0 < --memory-rows < --rows, --repeats and --request-ids positive, --warmup not negative")
    if memory_rows < args.request_ids:
        parser.error(f"--memory-rows ({memory_rows}) must hold a request (--request-ids {args.request_ids})")
    print(f"disk_ab_bench: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; {rows:,} rows a table "
          f"({memory_rows:,} of a disk table's in memory); {args.baseline} ({evictions[_BASELINE]}) against this checkout "
          f"({evictions[_CHANGED]})", flush=True)
    Path(args.disk_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="disk-ab-", dir=args.disk_dir))
    shards: dict[str, Shards] = {}
    try:
        trees = {_BASELINE: baseline_tree(args.baseline, work / "baseline"), _CHANGED: _CHECKOUT}
        for name, tree in trees.items():
            shards[name] = start(tree, memory_rows, work / f"tier-{len(shards)}", evictions[name])
        if args.memory_table:
            shards[_MEMORY] = start(_CHECKOUT, memory_rows, None, args.eviction)
        out = grow_and_measure(shards, rows, args.request_ids, args.warmup, args.repeats)
    finally:
        for one in shards.values():
            one.close()
        shutil.rmtree(work, ignore_errors=True)
    for name, figures in out.items():
        line = describe(name, figures)
        if _MEMORY in out:
            figures["over_memory"] = figures["zipf_rows_per_s"] / out[_MEMORY]["zipf_rows_per_s"]
            line += f"; {figures['over_memory']:.3f}x the memory table's rate"
        print(line)
    print(f"this checkout over the baseline: {out[_CHANGED]['over_first']:.3f}x {turns(out[_CHANGED])}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        print(json.dumps({"rows": rows, "memory_rows": memory_rows, "baseline": args.baseline, "eviction": args.eviction,
                          "baseline_eviction": evictions[_BASELINE], "shards": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
