"""Versioned deltas: size and publish time per 1M changed rows, the time to apply them, freshness, latency during swaps.

**Part 1, deltas** (``--rows``, default 1M, fp32 and fp16 storage): two training shards (``lightning-persia ps serve``
processes), one table of dim 16 with row-wise Adagrad (DLRM's tables), ``2 x rows`` ids inserted, then ``rows`` of
them updated. Timed: ``PSClient.save_delta`` of what changed (the shards' part of ``PublishDeltas``: a consistent
point, then the rows streamed to ``.npy`` files and hashed), and its bytes; the first, whole delta of the same
table for comparison; then two read-only shards, restored from a checkpoint of the state the delta starts from,
*stage* it (read and check its files, while they serve) and *commit* it (the moment lookups wait).

**Part 2, serving while training**: the DLRM bundle of ``serve_bench.py`` (trained ``--train-steps`` steps) served by
``lightning-persia serve BUNDLE --deltas DIR`` (two read-only shards), ``--clients`` HTTP clients posting one row at a
time without pause, while ``lightning-persia fit`` (examples/dlrm/online.yaml) goes on training from the bundle's
checkpoint and publishes a version every ``--every`` steps. Freshness of version v: the end of the first answer
naming v (or later) minus the end of the training step v was taken at (``step_time`` in its manifest). Requests
begun in the ``--swap-window`` seconds before each version's first answer (its staging and commit) are compared
with the others.

    .venv/bin/python -m benchmarks.serving.delta_bench                          # both parts
    .venv/bin/python -m benchmarks.serving.delta_bench --part deltas --rows 1000000

Everything (trainer, its shards, the endpoint, its shards, the clients) shares this machine's cores.
"""
from __future__ import annotations

import argparse
import http.client
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from benchmarks.serving.serve_bench import ROOT, Server, load_average, make_bundle, request_rows, subprocess_env, summary


# ---- part 1: deltas ----------------------------------------------------------------------------------------


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _in_chunks(ids: torch.Tensor, size: int = 1 << 19):
    for start in range(0, ids.numel(), size):
        yield ids[start : start + size]


def measure_delta(rows: int, storage_dtype: str, scratch: Path) -> dict:
    from lightning_persia.remote_ps.client import PSClient
    from lightning_persia.remote_ps.launcher import LocalShards
    from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

    table = TableConfig("t", 16, optimizer=Adagrad(lr=0.1, rowwise=True), capacity=4 * rows, storage_dtype=storage_dtype)
    ids = torch.arange(2 * rows) * 7919 + 13  # spread over both shards by the id hash
    folder = scratch / storage_dtype
    out: dict = {"storage": storage_dtype, "rows": rows}
    with LocalShards(2) as training, PSClient(training.addresses, timeout_s=300) as client:
        client.wait_healthy(60)
        client.configure([table])
        for chunk in _in_chunks(ids):
            client.lookup({"t": chunk}, train=True)
        started = time.perf_counter()
        client.save_delta(folder / "v1", "v1")
        out["whole_s"], out["whole_rows"], out["whole_bytes"] = time.perf_counter() - started, 2 * rows, _bytes(folder / "v1")
        client.save(folder / "base")
        for chunk in _in_chunks(ids[:rows]):
            client.update({"t": (chunk, torch.randn(chunk.numel(), 16))}, wire_dtype="fp32")
        started = time.perf_counter()
        client.save_delta(folder / "v2", "v2", base_id="v1")
        out["delta_s"], out["delta_bytes"] = time.perf_counter() - started, _bytes(folder / "v2")
    with LocalShards(2, extra_args=["--read-only", "--restore-from", str(folder / "base")]) as serving, PSClient(serving.addresses, timeout_s=300) as client:
        client.wait_healthy(120)
        started = time.perf_counter()
        staged = client.stage_delta(folder / "v2", version=1, base_version=0)
        out["stage_s"] = time.perf_counter() - started
        started = time.perf_counter()
        client.commit_delta(1)
        out["commit_s"] = time.perf_counter() - started
        out["staged_rows"] = staged
    shutil.rmtree(folder, ignore_errors=True)
    return out


# ---- part 2: serving while training ----------------------------------------------------------------------


class Clients:
    """Client threads posting rows one after the other; every request's (start, end, status, version) kept."""

    def __init__(self, port: int, bodies: list[bytes], count: int) -> None:
        self.records: list[tuple[float, float, int, int]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(port, bodies, i), daemon=True) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def _run(self, port: int, bodies: list[bytes], index: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        position = index * 997
        while not self._stop.is_set():
            started = time.time()
            version = -1
            try:
                connection.request("POST", "/predict", body=bodies[position % len(bodies)], headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                data = response.read()
                status = response.status
                if status == 200:
                    version = json.loads(data)["version"]
            except OSError:
                status = 0
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            with self._lock:
                self.records.append((started, time.time(), status, version))
            position += 1
        connection.close()

    def newest_version(self) -> int:
        with self._lock:
            return max((r[3] for r in self.records), default=-1)

    def stop(self) -> list[tuple[float, float, int, int]]:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        return sorted(self.records)


def serve_while_training(bundle: Path, ckpt: Path, workdir: Path, args) -> dict:
    from lightning_persia.serving.delta import Delta, published_versions

    deltas = workdir / "deltas"
    shutil.rmtree(deltas, ignore_errors=True)
    _, bodies = request_rows(args.request_rows)
    server = Server(bundle, ["--deltas", str(deltas), "--watch-interval", str(args.watch_interval)])
    try:
        clients = Clients(server.port, bodies, args.clients)
        time.sleep(args.warmup)
        fit_started = time.time()
        start_step = torch.load(ckpt, weights_only=True, map_location="cpu")["global_step"]
        subprocess.run(
            [sys.executable, "-m", "lightning_persia.cli", "fit", "--config", "examples/dlrm/config.yaml", "--config",
             "examples/dlrm/serving.yaml", "--config", "examples/dlrm/online.yaml", f"--ckpt_path={ckpt}",
             f"--trainer.max_steps={start_step + args.steps}", f"--trainer.callbacks.dirpath={deltas}",
             f"--trainer.callbacks.every_n_train_steps={args.every}", f"--trainer.default_root_dir={workdir}"],
            cwd=ROOT, env=subprocess_env(), check=True, capture_output=True,
        )
        fit_s = time.time() - fit_started
        newest = max(published_versions(deltas))
        deadline = time.monotonic() + 120
        while clients.newest_version() < newest and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        records = clients.stop()
    finally:
        server.stop()
    manifests = {v: Delta.open(path) for v, path in published_versions(deltas).items()}
    versions = []
    for version, delta in manifests.items():
        first = next((end for _, end, status, v in records if status == 200 and v >= version), None)
        versions.append({"version": version, "step": delta.global_step, "rows": sum(t["rows"] for t in delta.manifest["tables"].values()),
                         "whole": all(t["whole"] for t in delta.manifest["tables"].values()), "bytes": sum(f["bytes"] for f in delta.manifest["files"].values()),
                         "publish_s": delta.manifest["seconds"], "freshness_s": None if first is None else first - delta.step_time,
                         "first_answer": first})
    firsts = [v["first_answer"] for v in versions if v["first_answer"] is not None]
    in_swap = lambda start: any(first - args.swap_window <= start <= first for first in firsts)  # noqa: E731
    measured = [r for r in records if r[0] >= fit_started]
    swaps = [r for r in measured if in_swap(r[0])]
    steady = [r for r in measured if not in_swap(r[0])]
    duration = max(r[1] for r in measured) - fit_started
    return {"fit_s": fit_s, "versions": versions,
            "during_swaps": summary([r[1] - r[0] for r in swaps], duration, sum(r[2] != 200 for r in swaps)),
            "otherwise": summary([r[1] - r[0] for r in steady], duration, sum(r[2] != 200 for r in steady)),
            "versions_answered": sorted({r[3] for r in records if r[2] == 200})}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["deltas", "serve", "both"], default="both")
    parser.add_argument("--rows", type=int, default=1_000_000, help="changed rows of part 1's delta")
    parser.add_argument("--bundle", type=Path, help="part 2: a bundle made by serve_bench.py (its checkpoint beside it, in ../checkpoints)")
    parser.add_argument("--train-steps", type=int, default=100, help="part 2: steps of the bundle's training when it is made here")
    parser.add_argument("--steps", type=int, default=60, help="part 2: steps trained while serving")
    parser.add_argument("--every", type=int, default=10, help="part 2: a version every this many steps")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--watch-interval", type=float, default=1.0)
    parser.add_argument("--swap-window", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--request-rows", type=int, default=1024)
    parser.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = parser.parse_args(argv)
    print(f"# {load_average()} before", flush=True)
    results: dict = {}
    if args.part in ("deltas", "both"):
        with tempfile.TemporaryDirectory(prefix="delta-bench-", dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as scratch:
            results["deltas"] = [measure_delta(args.rows, dtype, Path(scratch)) for dtype in ("fp32", "fp16")]
        print(f"\n# part 1: {args.rows:,} changed rows of a table of {2 * args.rows:,} (dim 16, row-wise Adagrad), 2 training shards, "
              f"2 inference shards; {load_average()}\n")
        print("| storage | delta MB | MB per 1M rows | save_delta s | s per 1M rows | whole table: MB, s | stage s | commit s |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in results["deltas"]:
            per = 1e6 / r["rows"]
            print(f"| {r['storage']} | {r['delta_bytes'] / 1e6:.1f} | {r['delta_bytes'] / 1e6 * per:.1f} | {r['delta_s']:.2f} | "
                  f"{r['delta_s'] * per:.2f} | {r['whole_bytes'] / 1e6:.1f}, {r['whole_s']:.2f} | {r['stage_s']:.2f} | {r['commit_s']:.2f} |")
    if args.part in ("serve", "both"):
        workdir = ROOT / "runs" / "delta_bench"
        bundle = args.bundle or make_bundle(workdir, args.train_steps)
        ckpt = bundle.parent / "checkpoints" / "dlrm.ckpt"
        results["serve"] = r = serve_while_training(bundle, ckpt, workdir, args)
        print(f"\n# part 2: {args.clients} clients, {args.steps} steps trained in {r['fit_s']:.0f} s while serving, a version every "
              f"{args.every} steps, polled every {args.watch_interval} s; {load_average()} after\n")
        print("| version | step | rows | whole | MB | publish s | freshness s |")
        print("| ---: | ---: | ---: | --- | ---: | ---: | ---: |")
        for v in r["versions"]:
            fresh = f"{v['freshness_s']:.2f}" if v["freshness_s"] is not None else "not answered"
            print(f"| {v['version']} | {v['step']} | {v['rows']:,} | {'yes' if v['whole'] else 'no'} | {v['bytes'] / 1e6:.1f} | {v['publish_s']:.2f} | {fresh} |")
        print("\n| requests | count | p50 ms | p99 ms | errors |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name in ("during_swaps", "otherwise"):
            s = r[name]
            print(f"| {name.replace('_', ' ')} | {s['requests']} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['errors']} |")
        print(f"\nversions answered: {r['versions_answered']}")
    if args.json:
        print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
