"""The trainer's embedding path alone: local TorchRec embeddings vs PersiaStrategy, samples/s and CPU per step.

On a GPU DLRM's dense step takes a few ms, so what bounds a rank is the trainer-side embedding path. On CPU
the MLPs hide it; this benchmark cuts the dense part to one ``Linear`` over the dense features and the pooled
embeddings (``trainer/models.py: BenchLinear``) and keeps the 26 Criteo-shaped tables of
``train_bench.py``, every one of them remote, on 2 embedded shards (the same 2 cores as the trainer):

  local      TorchRec ``FusedEmbeddingBagCollection`` (FBGEMM's table-batched CPU kernel, row-wise Adagrad fused
             into the backward), 1 rank, no PS
  sync       PersiaStrategy(staleness=0)
  hybrid-τ   PersiaStrategy(staleness=τ) (default τ=4)

for every --batch-sizes (global batch; default 4,096 and 16,384) and, for PersiaStrategy, every --ranks (default
1 and 2; the local baseline runs on 1 rank). Reported per run: samples/s (median over windows of --window
steps after --warmup steps, then over the rounds), the CPU ms per step of the trainer process (rank 0; read
from /proc/self/stat), of the other trainer-side processes ("other procs": the second rank, DataLoader workers)
and of the shard processes (/proc/<pid>/stat), each measured from the end of the warm-up to the end of training.
With --loader-workers N, every run's train DataLoader has N worker processes, where PersiaStrategy plans each
batch's lookup (and TorchRec's baseline builds its batches, as PersiaStrategy's does).

    .venv/bin/python -m benchmarks.trainer.pipeline_bench                 # the full table (about 8 min on a 2-core machine)
    .venv/bin/python -m benchmarks.trainer.pipeline_bench --quick         # batch 4096, 1 rank, 1 round (about 1.5 min)
    .venv/bin/python -m benchmarks.trainer.pipeline_bench --json          # + one JSON object on the last line
    .venv/bin/python -m benchmarks.trainer.pipeline_bench --quick --profile   # + where a step's time goes (profiler spans)

Targets (benchmarks/results/2026-11-25-pipeline-bench.md): at batch 4,096 and 1 rank, the trainer process spends no more CPU per step than local
TorchRec (moonshot: half), and PersiaStrategy trains at >= 0.8x local's samples/s (moonshot: 1.0x).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

from benchmarks.trainer.train_bench import Runner, add_device_arguments, print_profile, trainer_threads  # the same runner and profile table

CPU_FIGURES = ("trainer_cpu_ms", "other_trainer_cpu_ms", "shards_cpu_ms", "workers_cpu_ms")
HEADLINE_BATCH = 4096


def make_configs(args: argparse.Namespace, meta: Dict[str, Any]) -> List[Dict[str, Any]]:
    common = dict(
        model="linear", steps=args.steps, warmup=args.warmup, window=args.window, test_batches=0,
        data_path=meta["path"], cardinalities=meta["cardinalities"], dim=args.dim, seed=args.seed, ps_seed=args.seed,
        emb_lr=0.05, emb_eps=1e-8, dense_lr=1e-3, wire_dtype=args.wire_dtype, shards=args.shards,
        data_parallel_max_rows=0, profile=args.profile, loader_workers=args.loader_workers,
        accelerator=args.accelerator, data=args.data,
    )
    if args.threads:
        common["torch_threads"] = args.threads
    configs = []
    for batch in args.batch_sizes:
        configs.append(dict(common, batch_size=batch, name=f"local b{batch}", mode="local", world=1, staleness=None))
        for world in args.ranks:
            for staleness in (0, args.staleness):
                for workers in args.embedding_workers or [None]:
                    name = (("sync" if staleness == 0 else f"hybrid-{staleness}") + (f" x{world}" if world > 1 else "")
                            + (f" w{workers}" if args.embedding_workers and len(args.embedding_workers) > 1 else "") + f" b{batch}")
                    configs.append(dict(common, batch_size=batch, name=name, mode="persia", world=world, staleness=staleness,
                                        embedding_workers=workers))
    return configs


def merge_runs(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One configuration's rounds as one result: the median samples/s and the median of each CPU figure."""
    merged = dict(runs[0])
    rates = [r["samples_per_s"] for r in runs if r["samples_per_s"]]
    merged["samples_per_s"] = statistics.median(rates) if rates else None
    merged["samples_per_s_runs"] = [r["samples_per_s"] for r in runs]
    for key in CPU_FIGURES:
        values = [r[key] for r in runs if r.get(key) is not None]
        merged[key] = statistics.median(values) if values else None
    return merged


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def print_table(results: List[Dict[str, Any]]) -> None:
    header = (f"{'batch':>7}{'ranks':>6}  {'run':<12}{'samples/s':>11}{'vs local':>9}{'step ms':>9}"
              f"{'trainer CPU':>13}{'vs local':>9}{'other procs':>12}{'workers CPU':>12}{'shards CPU':>12}")
    print(header)
    print(f"{'':>7}{'':>6}  {'':<12}{'':>11}{'':>9}{'':>9}{'ms/step':>13}{'':>9}{'ms/step':>12}{'ms/step':>12}{'ms/step':>12}")
    print("-" * len(header))
    for r in results:
        local = next(x for x in results if x["mode"] == "local" and x["batch_size"] == r["batch_size"])
        step_ms = 1e3 * r["batch_size"] / r["samples_per_s"] if r["samples_per_s"] else None
        run = r["name"].rsplit(" b", 1)[0].replace(" x2", "")
        print(f"{r['batch_size']:>7,}{r['world']:>6}  {run:<12}{_fmt(r['samples_per_s'], ',.0f'):>11}"
              f"{_fmt(_ratio(r['samples_per_s'], local['samples_per_s']), '.2f'):>9}{_fmt(step_ms, '.1f'):>9}"
              f"{_fmt(r.get('trainer_cpu_ms'), '.1f'):>13}{_fmt(_ratio(r.get('trainer_cpu_ms'), local.get('trainer_cpu_ms')), '.2f'):>9}"
              f"{_fmt(r.get('other_trainer_cpu_ms'), '.1f'):>12}{_fmt(r.get('workers_cpu_ms'), '.1f'):>12}{_fmt(r.get('shards_cpu_ms'), '.1f'):>12}")


def headline(results: List[Dict[str, Any]], staleness: int) -> Dict[str, Any]:
    """The figures at batch 4,096 (or the smallest batch run) and 1 rank."""
    batch = HEADLINE_BATCH if any(r["batch_size"] == HEADLINE_BATCH for r in results) else min(r["batch_size"] for r in results)

    def pick(mode: str, tau: Optional[int]) -> Dict[str, Any]:  # with several --embedding-workers, the first
        return next((r for r in results if r["batch_size"] == batch and r["world"] == 1 and r["mode"] == mode and r["staleness"] == tau), {})

    out: Dict[str, Any] = {"headline_batch_size": batch, "hybrid_staleness": staleness}
    for label, run in (("local", pick("local", None)), ("sync", pick("persia", 0)), ("hybrid", pick("persia", staleness))):
        out[f"{label}_samples_per_s"] = run.get("samples_per_s")
        out[f"{label}_cpu_ms"] = run.get("trainer_cpu_ms")
        out[f"{label}_shards_cpu_ms"] = run.get("shards_cpu_ms")
        out[f"{label}_workers_cpu_ms"] = run.get("workers_cpu_ms")
        for part in ("cpu_main", "cpu_pool", "cpu_other_threads"):  # with --profile: the trainer's threads (trainbench/probe.py)
            out[f"{label}_{part}_ms"] = (run.get("profile") or {}).get(part)
    for label in ("sync", "hybrid"):
        out[f"{label}_vs_local"] = _ratio(out[f"{label}_samples_per_s"], out["local_samples_per_s"])
        out[f"{label}_cpu_vs_local"] = _ratio(out[f"{label}_cpu_ms"], out["local_cpu_ms"])
    return out


def print_targets(head: Dict[str, Any]) -> None:
    print(f"\nat batch {head['headline_batch_size']:,}, 1 rank:")
    for label in ("sync", "hybrid"):
        name = "sync" if label == "sync" else f"hybrid τ={head['hybrid_staleness']}"
        print(f"  {name:<13} samples/s {_fmt(head[f'{label}_vs_local'], '.2f')} x local (target >= 0.8, moonshot 1.0);  "
              f"trainer CPU {_fmt(head[f'{label}_cpu_vs_local'], '.2f')} x local (target <= 1.0, moonshot 0.5)")


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 4096, 1 rank, 40 steps, 1 round (about 1.5 minutes)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="global batches (default 4096 16384; --quick 4096)")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="PersiaStrategy trainer ranks (default 1 2; --quick 1)")
    parser.add_argument("--staleness", type=int, default=4, help="staleness of the hybrid run (>= 1)")
    parser.add_argument("--steps", type=int, default=None, help="training steps of every run (default 100; --quick 40)")
    parser.add_argument("--warmup", type=int, default=None, help="steps not timed (default 20; --quick 10)")
    parser.add_argument("--window", type=int, default=None, help="steps per timed window (default 10; --quick 5)")
    parser.add_argument("--repeat", type=int, default=None, help="rounds of every run; medians are reported (default 2; --quick 1)")
    parser.add_argument("--shards", type=int, default=2, help="embedded PS shards")
    parser.add_argument("--wire-dtype", default="fp16", choices=["fp16", "fp32"])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--cardinality-scale", type=float, default=0.1, help="table sizes: Criteo Kaggle's times this")
    parser.add_argument("--zipf-alpha", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per trainer rank (default: cores / ranks)")
    parser.add_argument("--loader-workers", type=int, default=0, metavar="N",
                        help="worker processes of every run's train DataLoader (PersiaStrategy then plans each batch's lookup "
                             "in them; default 0: in the trainer process)")
    parser.add_argument("--embedding-workers", type=int, nargs="+", default=None, metavar="N",
                        help="PersiaStrategy(embedding_workers=EmbeddingWorkerSettings(count=N)) for the PersiaStrategy runs, "
                             "each value a run of its own (0: the per-id work on the trainer's threads; default: the strategy's)")
    add_device_arguments(parser)
    parser.add_argument("--profile", action="store_true",
                        help="profile the runs (torch.profiler spans of the embedding path, CPU per thread) and print where a step's time goes")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the generated data is cached")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one configuration may take")
    args = parser.parse_args(argv)
    defaults = dict(batch_sizes=([HEADLINE_BATCH], [HEADLINE_BATCH, 16384]), ranks=([1], [1, 2]), steps=(40, 100),
                    warmup=(10, 20), window=(5, 10), repeat=(1, 2))
    for key, (quick, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.warmup < 1 or args.steps < args.warmup + args.window:
        parser.error(f"--steps ({args.steps}) must cover --warmup ({args.warmup}, >= 1) plus one --window ({args.window})")
    if args.repeat < 1 or args.staleness < 1:
        parser.error("--repeat and --staleness must be >= 1")
    if any(b % w for b in args.batch_sizes for w in args.ranks):
        parser.error(f"every --batch-sizes value {args.batch_sizes} must be divisible by every --ranks value {args.ranks}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    from benchmarks.trainer import data

    load_before = os.getloadavg()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, load average {load_before[0]:.2f} at start")
    meta = data.prepare(
        args.cache_dir or data.default_cache_dir(), seed=args.seed, batch_size=max(args.batch_sizes), train_batches=args.steps + 16,
        test_batches=1, cardinality_scale=args.cardinality_scale, zipf_alpha=args.zipf_alpha,
    )
    print(f"data: {sum(meta['cardinalities']):,} ids in 26 tables (Zipf {args.zipf_alpha}), dim {args.dim}, every table remote "
          f"on {args.shards} embedded shards; one Linear as the dense part")
    configs = make_configs(args, meta)
    runs: Dict[str, List[Dict[str, Any]]] = {c["name"]: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="pipeline_bench-") as workdir:
        runner = Runner(Path(workdir), args.timeout)
        try:
            for round_index in range(args.repeat):  # rounds, not repeats in a row: a busy spell hits every run alike
                for config in configs:
                    threads = config.get("torch_threads") or trainer_threads(config["world"])
                    label = f" [{round_index + 1}/{args.repeat}]" if args.repeat > 1 else ""
                    print(f"running {config['name']:<18} ({config['world']} rank(s) x {threads} torch thread(s)){label} ...", flush=True)
                    r = runner.run(config)
                    r["batch_size"] = config["batch_size"]
                    runs[config["name"]].append(r)
                    print(f"    {_fmt(r['samples_per_s'], ',.0f')} samples/s, trainer CPU {_fmt(r.get('trainer_cpu_ms'), '.1f')} ms/step, "
                          f"shards CPU {_fmt(r.get('shards_cpu_ms'), '.1f')} ms/step", flush=True)
        except KeyboardInterrupt:
            print("interrupted; cleaning up", file=sys.stderr)
            return 130
        finally:
            runner.kill()
    results = [merge_runs(runs[c["name"]]) for c in configs]
    load_after = os.getloadavg()
    print(f"\npipeline_bench: {args.steps} steps per run (samples/s: median of windows of {args.window} steps after {args.warmup}; "
          f"CPU per step over the same steps), {args.repeat} round(s), {args.wire_dtype} on the wire, "
          f"{args.loader_workers} DataLoader worker(s), batches from {args.data}")
    print(f"device: {results[0].get('device')} ({args.accelerator})")
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after (other work on the machine lowers every figure)\n")
    print_table(results)
    head = headline(results, args.staleness)
    print_targets(head)
    if args.profile:
        print_profile(results)
    if args.json:
        summary = dict(head, runs=results, steps=args.steps, dim=args.dim, shards=args.shards, wire_dtype=args.wire_dtype,
                       loader_workers=args.loader_workers,
                       cpu_count=os.cpu_count(), load_average=[load_before[0], load_after[0]],
                       accelerator=args.accelerator, data=args.data, device=results[0].get("device"))
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
