"""HTTP serving benchmark: latency (p50/p99) and requests/s of `lightning-persia serve` at 1 and 16 clients.

Serves a DLRM bundle (26 sparse features, dim 16, 13 dense) with ``lightning-persia serve`` (LitServe, its
own read-only shards on this machine) and drives ``POST /predict`` from client threads, each with a
keep-alive HTTP connection (``http.client``), one request (one row) at a time, for ``--seconds`` after a
warm-up. Two server settings are measured in the same run: LitServe's dynamic batching
(``--max-batch-size 32 --batch-timeout 0.002``) and no batching (``--max-batch-size 1``), the baseline of
the ratio. The rows come from the synthetic Criteo validation stream (ids the model was trained on). A last
row gives the model's own cost: ``Predictor.predict`` on one-row batches in this process, without HTTP.

    .venv/bin/python -m benchmarks.serving.serve_bench                    # trains and exports a bundle first (~1.5 min)
    .venv/bin/python -m benchmarks.serving.serve_bench --bundle runs/dlrm/bundle --seconds 5 --json

Everything (server, inference worker, shards, clients) shares this machine's cores: the figures are those
of one small box serving itself, not of a serving fleet.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"batched": ["--max-batch-size", "32", "--batch-timeout", "0.002"], "unbatched": ["--max-batch-size", "1"]}


def subprocess_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def load_average() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def make_bundle(folder: Path, steps: int) -> Path:
    """Trains DLRM (examples/dlrm, ``steps`` steps) and exports it, as examples/README.md does."""
    checkpoints = folder / "checkpoints"
    subprocess.run(
        [sys.executable, "-m", "lightning_persia.cli", "fit", "--config", "examples/dlrm/config.yaml", "--config",
         "examples/dlrm/serving.yaml", f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}",
         f"--trainer.default_root_dir={folder}", f"--trainer.callbacks.dirpath={checkpoints}"],
        cwd=ROOT, env=subprocess_env(), check=True, capture_output=True,
    )
    bundle = folder / "bundle"
    subprocess.run([sys.executable, "-m", "lightning_persia.cli", "export", "--ckpt", str(checkpoints / "dlrm.ckpt"), "--out", str(bundle)],
                   cwd=ROOT, env=subprocess_env(), check=True, capture_output=True)
    return bundle


def request_rows(count: int) -> tuple[list, list[bytes]]:
    """``count`` validation rows as CriteoBatch-of-one and as request bodies."""
    from lightning_persia.data import SyntheticCriteoDataModule, make_batch

    data = SyntheticCriteoDataModule(num_train_batches=1, num_val_batches=1, batch_size=count, seed=0)
    data.setup("validate")
    batch = next(iter(data.val_dataloader()))
    features, ids = batch.sparse_features.keys(), batch.sparse_ids()
    rows = [make_batch(ids[i : i + 1], batch.dense_features[i : i + 1], batch.labels[i : i + 1], features) for i in range(count)]
    bodies = [json.dumps({"sparse": {f: [int(ids[i, j])] for j, f in enumerate(features)},
                          "dense": batch.dense_features[i].tolist()}).encode() for i in range(count)]
    return rows, bodies


class Server:
    """``lightning-persia serve BUNDLE`` in its own process group."""

    def __init__(self, bundle: Path, extra: list[str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lightning_persia.cli", "serve", str(bundle), "--port", str(self.port), *extra],
            cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"lightning-persia serve {' '.join(extra)} did not start")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def drive(port: int, bodies: list[bytes], clients: int, seconds: float, warmup_s: float) -> dict:
    """``clients`` threads posting one body at a time; latencies of the requests begun after the warm-up."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    start_barrier = threading.Barrier(clients + 1)
    begin: list[float] = []

    def client(index: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        headers = {"Content-Type": "application/json"}
        position = index * 997
        start_barrier.wait()
        measure_from, stop_at = begin[0] + warmup_s, begin[0] + warmup_s + seconds
        while True:
            sent = time.perf_counter()
            if sent >= stop_at:
                break
            try:
                connection.request("POST", "/predict", body=bodies[position % len(bodies)], headers=headers)
                response = connection.getresponse()
                response.read()
                ok = response.status == 200
            except OSError:
                ok = False
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            if sent >= measure_from:
                latencies[index].append(time.perf_counter() - sent)
                errors[index] += not ok
            position += 1
        connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    begin.append(time.perf_counter())
    start_barrier.wait()
    for thread in threads:
        thread.join()
    return summary([x for per_client in latencies for x in per_client], seconds, sum(errors))


def summary(latencies: list[float], seconds: float, errors: int) -> dict:
    ordered = torch.tensor(sorted(latencies), dtype=torch.float64)
    pick = lambda q: float(ordered[min(len(ordered) - 1, int(q * len(ordered)))]) * 1e3  # noqa: E731
    return {"requests": len(latencies), "per_s": len(latencies) / seconds, "p50_ms": pick(0.50), "p99_ms": pick(0.99), "errors": errors}


def in_process(bundle: Path, rows: list, seconds: float) -> dict:
    """``Predictor.predict`` on one-row batches, one after the other (the model and its lookups, no HTTP)."""
    from lightning_persia.serving import Predictor

    torch.set_num_threads(1)  # as the server's inference worker (lightning-persia serve --torch-threads 1)
    with Predictor.from_bundle(bundle) as predictor:
        for row in rows[:50]:
            predictor.predict(row)
        latencies, position, stop_at = [], 0, time.perf_counter() + seconds
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            predictor.predict(rows[position % len(rows)])
            latencies.append(time.perf_counter() - started)
            position += 1
    return summary(latencies, seconds, 0)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, help="a DLRM bundle (default: train 100 steps and export one under runs/serve_bench)")
    parser.add_argument("--train-steps", type=int, default=100)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured time per setting and client count")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rows", type=int, default=4096, help="distinct request rows, cycled")
    parser.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = parser.parse_args(argv)
    print(f"# {load_average()} before", flush=True)
    bundle = args.bundle or make_bundle(ROOT / "runs" / "serve_bench", args.train_steps)
    rows, bodies = request_rows(args.rows)
    results: dict[str, dict] = {}
    for name, extra in SETTINGS.items():
        server = Server(bundle, extra)
        try:
            for clients in args.clients:
                results[f"{name}/{clients}"] = drive(server.port, bodies, clients, args.seconds, args.warmup)
                print(f"# {name}, {clients} clients: {results[f'{name}/{clients}']}", flush=True)
        finally:
            server.stop()
    results["predictor/1"] = in_process(bundle, rows, args.seconds)

    print(f"\nbundle {bundle}; {args.seconds:.0f} s per row after {args.warmup:.0f} s of warm-up; {load_average()} after\n")
    print("| server | clients | requests/s | vs unbatched | p50 ms | p99 ms | errors |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in SETTINGS:
        for clients in args.clients:
            r, base = results[f"{name}/{clients}"], results[f"unbatched/{clients}"]
            print(f"| {name} | {clients} | {r['per_s']:,.0f} | {r['per_s'] / base['per_s']:.2f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']} |")
    r = results["predictor/1"]
    print(f"| Predictor.predict in-process, no HTTP | 1 | {r['per_s']:,.0f} | | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | |")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
