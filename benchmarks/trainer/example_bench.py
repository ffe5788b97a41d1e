"""Samples/s of the DLRM example (examples/dlrm/config.yaml + demo.yaml) by how its data is made.

Each configuration trains the example as `make demo` does (PersiaStrategy, 2 embedded shards, batches of 4,096)
in a fresh process, and reports samples/s over the steps after --warmup; the configurations take turns for
--rounds rounds, so that a change of the machine's load falls on all of them alike. Configurations: the
synthetic stream's DataLoader workers per rank (--workers, default 0 and 2: 0 generates the batches in the
training process).

    .venv/bin/python -m benchmarks.trainer.example_bench                        # workers 0 vs 2, 2 rounds
    .venv/bin/python -m benchmarks.trainer.example_bench --workers 0,1,2 --steps 200 --accelerator gpu
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from lightning.pytorch import Callback

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class StepTimer(Callback):
    """Prints ``{"samples_per_s": ...}`` at the end of fit: rows trained per second after ``warmup`` steps."""

    def __init__(self, warmup: int = 20) -> None:
        self.warmup = warmup
        self._start = None
        self._rows = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self._start = time.perf_counter()
        elif self._start is not None:
            self._rows += batch.batch_size

    def on_fit_end(self, trainer, module) -> None:
        elapsed = time.perf_counter() - self._start
        print(json.dumps({"samples_per_s": self._rows / elapsed, "steps": trainer.global_step - self.warmup}), flush=True)


def _one(workers: int, steps: int, warmup: int, accelerator: str) -> float:
    command = [
        sys.executable, "-m", "lightning_persia.cli", "fit",
        "--config", "examples/dlrm/config.yaml", "--config", "examples/dlrm/demo.yaml",
        f"--trainer.max_steps={steps}", f"--trainer.accelerator={accelerator}", "--trainer.val_check_interval=null",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=benchmarks.example_bench.StepTimer", f"--trainer.callbacks.warmup={warmup}",
        f"--data.init_args.num_train_batches={steps}", f"--data.init_args.num_workers={workers}",
    ]
    done = subprocess.run(command, cwd=_ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": _ROOT})
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"samples_per_s"')]
    if done.returncode or not lines:
        raise SystemExit(f"workers={workers} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="0,2", help="DataLoader workers per configuration, comma-separated")
    parser.add_argument("--steps", type=int, default=120, help="training steps of a run (batches of 4,096)")
    parser.add_argument("--warmup", type=int, default=20, help="steps not timed at the start of a run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--accelerator", default="auto")
    args = parser.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    results = {w: [] for w in workers}
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    for round_ in range(args.rounds):
        for w in workers:
            results[w].append(_one(w, args.steps, args.warmup, args.accelerator))
            print(f"round {round_ + 1}, workers {w}: {results[w][-1]:,.0f} samples/s", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    base = statistics.median(results[workers[0]])
    print(f"\n| DataLoader workers | samples/s (median of {args.rounds}) | vs {workers[0]} workers |\n|---|---|---|")
    for w in workers:
        median = statistics.median(results[w])
        print(f"| {w} | {median:,.0f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
