"""Training throughput and accuracy: local TorchRec embeddings vs PersiaStrategy, synchronous and hybrid.

The same DLRM (26 sparse features, 13 dense, dim 16), the same pre-generated synthetic Criteo batches (Zipf
ids) in the same order, the same number of steps, run one after another in this invocation:

  local      the fastest local option found on CPU: TorchRec ``FusedEmbeddingBagCollection`` (FBGEMM's CPU
             table-batched kernel, EXACT_ROWWISE_ADAGRAD fused into the backward), 1 rank, no PS
  sync       PersiaStrategy(staleness=0): each lookup sees the previous step's update
  hybrid-τ   PersiaStrategy(staleness=τ) for every τ of --staleness (default 4 and 8)

PersiaStrategy runs use --shards (2) shard processes and --ranks (1 and 2) trainer ranks, and keep the
tables of at most --data-parallel-max-rows (30,000: 21 of the 26) on the trainers; --batch-size is
the *global* batch (2 ranks train on halves of the very same batches). Embedding rows start from the same
values everywhere (the PS's deterministic initialiser) and train with row-wise Adagrad; the dense net
starts from the same seed and trains with Adam.

Reported per run: samples/s (median over windows of --window steps after --warmup steps), the test AUC
after the run (--test-batches held-out batches), and the ratios hybrid/local and hybrid/sync.

    .venv/bin/python -m benchmarks.trainer.train_bench                    # the full table, 2 rounds (about 12 min on a 2-core machine)
    .venv/bin/python -m benchmarks.trainer.train_bench --quick            # a first look: see --quick below
    .venv/bin/python -m benchmarks.trainer.train_bench --profile          # + where a step's time goes
    .venv/bin/python -m benchmarks.trainer.train_bench --netem 1,10gbit   # shards behind an emulated network (root)
    .venv/bin/python -m benchmarks.trainer.train_bench --json             # + one JSON object on the last line

--netem DELAY_MS,RATE puts the shards in a network namespace and the trainers in another, joined by a
veth pair shaped with ``tc netem delay DELAY_MS rate RATE`` in each direction (on kernels without netem: a
``tbf`` qdisc for the rate and a forwarder that delays every chunk, see common/netem.py); the shards
bind the namespace's address with a random token. The namespaces are removed at the end, on error and on
Ctrl-C. Results, commands and what bounds them: benchmarks/results/2026-11-25-train-bench.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from lightning_persia.remote_ps.config import DURABILITY

_ROOT = Path(__file__).resolve().parents[2]

RUN_ONE = "--_run-one"


# ---- the configurations -----------------------------------------------------------------------------


def make_configs(args: argparse.Namespace, meta: Dict[str, Any]) -> List[Dict[str, Any]]:
    common = dict(
        batch_size=args.batch_size, steps=args.steps, warmup=args.warmup, window=args.window,
        test_batches=args.test_batches, data_path=meta["path"], cardinalities=meta["cardinalities"],
        dim=args.dim, seed=args.seed, ps_seed=args.seed, emb_lr=args.emb_lr, emb_eps=1e-8, dense_lr=args.dense_lr,
        wire_dtype=args.wire_dtype, shards=args.shards, profile=args.profile or bool(args.trace), trace=args.trace, data_parallel_max_rows=args.data_parallel_max_rows,
        merge_rank_gradients=not args.per_rank_updates, storage_dtype=args.storage_dtype,
        accelerator=args.accelerator, data=args.data, loader_workers=args.loader_workers,
        embedding_workers=args.embedding_workers,
    )
    if args.threads:
        common["torch_threads"] = args.threads

    configs = []
    if not args.no_local:
        configs.append(dict(common, name="local", mode="local", world=1, staleness=None))
    for world in args.ranks:
        for staleness in [0, *args.staleness]:
            name = ("sync" if staleness == 0 else f"hybrid-{staleness}") + (f" x{world}" if world > 1 else "")
            configs.append(dict(common, name=name, mode="persia", world=world, staleness=staleness))
    if args.scale_at:  # each 1-rank run again, its embedded shards moved live at those steps
        plan = dict(args.scale_at)
        configs += [dict(c, name=f"{c['name']} scaled", scale_at=plan) for c in list(configs) if c["mode"] == "persia" and c["world"] == 1]
    for level in args.durability or ():  # the headline hybrid run once per level of the shards' write-ahead log
        name = f"hybrid-{args.staleness[0]} {level}" + (f" x{min(args.ranks)}" if min(args.ranks) > 1 else "")
        configs.append(dict(common, name=name, mode="persia", world=min(args.ranks), staleness=args.staleness[0], durability=level))
    return configs


def trainer_threads(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


# ---- running one configuration in a subprocess -----------------------------------------------------


class Runner:
    """Starts each configuration as ``train_bench.py --_run-one CONFIG`` (its own process group) and reaps it."""

    def __init__(self, workdir: Path, timeout_s: float, net=None, log=print) -> None:
        self.workdir, self.timeout_s, self.net, self.log = workdir, timeout_s, net, log
        self.process: Optional[subprocess.Popen] = None
        self.rtt_ms: Optional[float] = None

    def run(self, config: Dict[str, Any]) -> Dict[str, Any]:
        config = dict(config)
        out = self.workdir / f"{len(list(self.workdir.iterdir()))}-result.json"
        config["out"] = str(out)
        config.setdefault("torch_threads", trainer_threads(config["world"]))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["OMP_NUM_THREADS"] = str(config["torch_threads"])
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        shards = None
        if self.net is not None and config["mode"] == "persia":
            token = secrets.token_hex(16)
            shards = self.net.shards(config["shards"], token, overrides=[f"seed={config['ps_seed']}"])
            config["ps_addresses"], config["ps_token"] = shards.addresses, token
            config["shard_pids"] = [process.pid for process in shards.processes]
            if self.rtt_ms is None:
                self.rtt_ms = self.net.rpc_round_trip_ms(shards.addresses, token)
                self.log(f"    PS round trip from the trainers' namespace (Stats RPC to every shard): {self.rtt_ms:.2f} ms")
        command = [sys.executable, "-m", "benchmarks.trainer.train_bench", RUN_ONE, json.dumps(config)]
        if self.net is not None:
            command = self.net.in_trainer_ns(command)
        start = time.perf_counter()
        log_path = self.workdir / f"{out.stem}.log"
        try:
            with open(log_path, "w") as log_file:
                self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=_ROOT)
                try:
                    code = self.process.wait(self.timeout_s)
                except subprocess.TimeoutExpired:
                    self.kill()
                    raise RuntimeError(f"{config['name']}: no result within --timeout {self.timeout_s:.0f} s; log: {log_path}")
        finally:
            self.kill()
            if shards is not None:
                shards.stop()
        if code != 0 or not out.exists():
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"{config['name']} failed (exit status {code}); last lines of its log:\n{tail}")
        result = json.loads(out.read_text())
        result.update(wall_s=time.perf_counter() - start, world=config["world"], staleness=config["staleness"], mode=config["mode"])
        return result

    def kill(self) -> None:
        """Ends the configuration's process group (trainer ranks and the embedded shards they started)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None and not _group_alive(process.pid):
            return
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(process.pid):
                try:
                    process.wait(0.1)
                except subprocess.TimeoutExpired:
                    pass
            if not _group_alive(process.pid):
                return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


# ---- the report ------------------------------------------------------------------------------------


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def merge_repeats(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One configuration's repeats as one result: median samples/s and median AUC; the profile of the median run."""
    timed = sorted((r for r in runs if r["samples_per_s"]), key=lambda r: r["samples_per_s"])  # a run too short to time has none
    merged = dict(timed[len(timed) // 2] if timed else runs[0])
    merged["samples_per_s"] = statistics.median(r["samples_per_s"] for r in timed) if timed else None
    merged["auc"] = statistics.median(r["auc"] for r in runs)
    merged["samples_per_s_runs"] = [r["samples_per_s"] for r in runs]
    merged["auc_runs"] = [r["auc"] for r in runs]
    return merged


def print_table(results: List[Dict[str, Any]], headline: Dict[str, Any]) -> None:
    local = next((r for r in results if r["mode"] == "local"), None)
    header = (f"{'run':<14}{'ranks':>6}{'τ':>4}{'samples/s':>12}{'min..max':>16}{'vs local':>10}{'vs sync':>9}{'test AUC':>10}"
              f"{'Δ AUC sync':>12}{'wall s':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        sync = next((s for s in results if s["mode"] == "persia" and s["staleness"] == 0 and s["world"] == r["world"]), None)
        vs_local = r["samples_per_s"] / local["samples_per_s"] if local and r["samples_per_s"] and local["samples_per_s"] else None
        vs_sync = r["samples_per_s"] / sync["samples_per_s"] if sync and r["samples_per_s"] and sync["samples_per_s"] else None
        d_auc = r["auc"] - sync["auc"] if sync else None
        tau = "-" if r["staleness"] is None else str(r["staleness"])
        values = [v for v in r.get("samples_per_s_runs", [r["samples_per_s"]]) if v]
        spread = f"{min(values) / 1e3:.1f}k..{max(values) / 1e3:.1f}k" if len(values) > 1 else "-"
        print(f"{r['name']:<14}{r['world']:>6}{tau:>4}{_fmt(r['samples_per_s'], ',.0f'):>12}{spread:>16}{_fmt(vs_local, '.2f'):>10}"
              f"{_fmt(vs_sync, '.2f'):>9}{_fmt(r['auc'], '.4f'):>10}{_fmt(d_auc, '+.4f'):>12}{r['wall_s']:>8.0f}")
    durable = [r for r in results if r.get("durability")]
    if durable:
        print_durability(durable)
    h = headline
    print()
    print(f"hybrid (τ={h['hybrid_staleness']}, {h['hybrid_ranks']} rank(s)) / local: {_fmt(h.get('hybrid_vs_local'), '.2f')}   "
          f"hybrid / sync: {_fmt(h.get('hybrid_vs_sync'), '.2f')}   "
          f"|AUC hybrid - sync|: {_fmt(h.get('auc_hybrid_minus_sync') and abs(h['auc_hybrid_minus_sync']), '.4f')}   "
          f"AUC hybrid - local: {_fmt(h.get('auc_hybrid_minus_local'), '+.4f')}")


def print_durability(rows: List[Dict[str, Any]]) -> None:
    """The cost of the shards' write-ahead log: each level's samples/s against ``none``, and what the log wrote."""
    none = next((r for r in rows if r["durability"] == "none"), None)
    print(f"\n{'run':<16}{'durability':>11}{'samples/s':>12}{'vs none':>9}{'log KB/step':>13}{'disk MB/s':>11}{'commits/step':>14}")
    for r in rows:
        vs = r["samples_per_s"] / none["samples_per_s"] if none and r["samples_per_s"] and none["samples_per_s"] else None
        wal = r.get("wal") or {}
        per_step = wal.get("bytes_written", 0) / r["steps"] / 1e3 if r.get("steps") else None
        rate = wal.get("bytes_written", 0) / r["fit_s"] / 1e6 if r.get("fit_s") else None
        commits = wal.get("commits", 0) / r["steps"] if r.get("steps") else None
        print(f"{r['name']:<16}{r['durability']:>11}{_fmt(r['samples_per_s'], ',.0f'):>12}{_fmt(vs, '.2f'):>9}"
              f"{_fmt(per_step if wal else None, ',.1f'):>13}{_fmt(rate if wal else None, '.2f'):>11}{_fmt(commits if wal else None, '.1f'):>14}")
    print("log KB/step, disk MB/s, commits/step: what the shards' write-ahead logs wrote during fit (all shards), per training\n"
          "step and per second of fit; a commit is one write (and one fdatasync with fsync) carrying every record queued")


def print_profile(results: List[Dict[str, Any]]) -> None:
    from benchmarks.trainer.probe import BACKGROUND_PARTS, TRAINER_PARTS

    rows = [r for r in results if r.get("profile")]
    if not rows:
        return
    print("\nwhere a step's time goes (ms per step on rank 0, mean over the timed steps; see benchmarks/trainer/probe.py)")
    header = f"{'run':<14}" + "".join(f"{p:>10}" for p in (*TRAINER_PARTS, "step")) + f"{'|':>3}" + "".join(f"{p:>9}" for p in BACKGROUND_PARTS) + f"{'lag':>6}{'wire MB':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        p = r["profile"]
        line = f"{r['name']:<14}" + "".join(f"{p[k]:>10.1f}" for k in (*TRAINER_PARTS, "step")) + f"{'|':>3}"
        line += "".join(f"{_fmt(p.get(k), '.1f'):>9}" for k in BACKGROUND_PARTS)
        line += f"{_fmt(p.get('staleness_mean'), '.1f'):>6}{_fmt(p.get('wire_mb_per_step'), '.2f'):>9}"
        print(line)
    print("wait, pooled, push, plan, encode, merge: the embedding path's profiler spans (lightning_persia.embedding.phases); plan,\n"
          "encode and merge run on their own threads, overlapping the trainer's parts; lookup, update: latencies (moving averages);\n"
          "lag: earlier steps' updates a step's lookup missed (mean)")
    from benchmarks.trainer.probe import CPU_PARTS

    print("\nCPU time per step (ms of CPU; the machine has " f"{os.cpu_count()} cores, so at most {os.cpu_count()} x the step time)")
    header = f"{'run':<14}" + "".join(f"{p[4:]:>10}" for p in CPU_PARTS) + f"{'total':>10}{'step':>10}{'busy':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        p = r["profile"]
        if "cpu_total" not in p:
            continue
        busy = p["cpu_total"] / (p["step"] * (os.cpu_count() or 1))
        print(f"{r['name']:<14}" + "".join(f"{p[k]:>10.1f}" for k in CPU_PARTS) + f"{p['cpu_total']:>10.1f}{p['step']:>10.1f}{busy:>8.0%}")


def headline(results: List[Dict[str, Any]], args: argparse.Namespace) -> Dict[str, Any]:
    ranks = min(args.ranks)
    tau = args.staleness[0] if args.staleness else None

    def pick(mode: str, staleness=None) -> Optional[Dict[str, Any]]:
        for r in results:
            if r["mode"] == mode and (mode == "local" or (r["world"] == ranks and r["staleness"] == staleness)):
                return r
        return None

    local, sync, hybrid = pick("local"), pick("persia", 0), pick("persia", tau)
    out: Dict[str, Any] = {
        "local_samples_per_s": local and local["samples_per_s"],
        "sync_samples_per_s": sync and sync["samples_per_s"],
        "hybrid_samples_per_s": hybrid and hybrid["samples_per_s"],
        "auc_local": local and local["auc"],
        "auc_sync": sync and sync["auc"],
        "auc_hybrid": hybrid and hybrid["auc"],
        "hybrid_staleness": tau,
        "hybrid_ranks": ranks,
    }
    if hybrid and local and local["samples_per_s"]:
        out["hybrid_vs_local"] = hybrid["samples_per_s"] / local["samples_per_s"]
        out["auc_hybrid_minus_local"] = hybrid["auc"] - local["auc"]
    if hybrid and sync and sync["samples_per_s"]:
        out["hybrid_vs_sync"] = hybrid["samples_per_s"] / sync["samples_per_s"]
        out["auc_hybrid_minus_sync"] = hybrid["auc"] - sync["auc"]
    return out


# ---- main ------------------------------------------------------------------------------------------


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--accelerator and --data, the same for every benchmark that trains (train_bench.py, pipeline_bench.py)."""
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"],
                        help="where the trainer runs, and the local baseline's tables with it (gpu: the first CUDA device)")
    parser.add_argument("--data", default="memory", choices=["memory", "loader"],
                        help="memory (default): every run's batches built before its fit (pinned on a GPU) and read from a list, "
                             "the same for the local baseline and PersiaStrategy; loader: built from the cache as the "
                             "DataLoader asks (in --loader-workers processes)")


def _step_and_shards(text: str) -> tuple[int, int]:
    step, _, shards = text.partition(":")
    if not (step.isdigit() and shards.isdigit() and int(shards) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: expected STEP:SHARDS, e.g. 100:3")
    return int(step), int(shards)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="local, sync and hybrid τ=4 on 1 rank, 40 steps, 1 round (about 1.5 min); --ranks, --staleness "
                             "and the other options still apply")
    parser.add_argument("--batch-size", type=int, default=4096, help="global batch (split across ranks)")
    parser.add_argument("--steps", type=int, default=None, help="training steps of every run (default 300; --quick 40)")
    parser.add_argument("--warmup", type=int, default=None, help="steps not timed (default 20; --quick 10)")
    parser.add_argument("--window", type=int, default=None, help="steps per timed window (default 20; --quick 5)")
    parser.add_argument("--test-batches", type=int, default=None, help="held-out batches for the AUC (default 16; --quick 8)")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="trainer ranks of the PersiaStrategy runs (default 1 2)")
    parser.add_argument("--staleness", type=int, nargs="+", default=None, help="hybrid staleness values (default 4 8); the first is the headline")
    parser.add_argument("--shards", type=int, default=2, help="PS shards")
    parser.add_argument("--data-parallel-max-rows", type=int, default=30000, metavar="N",
                        help="PersiaStrategy(data_parallel_max_rows=N): tables of at most N rows (21 of the 26 here) stay on "
                             "the trainers (default 30000; 0: every table on the shards)")
    parser.add_argument("--per-rank-updates", action="store_true",
                        help="PersiaStrategy(merge_rank_gradients=False): each rank's embedding gradient is its own update, as in "
                             "PERSIA (default: the ranks' gradients of a step are merged into one)")
    parser.add_argument("--wire-dtype", default="fp16", choices=["fp16", "fp32"])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--emb-lr", type=float, default=0.05, help="row-wise Adagrad learning rate of the embeddings")
    parser.add_argument("--dense-lr", type=float, default=1e-3, help="Adam learning rate of the dense network")
    parser.add_argument("--cardinality-scale", type=float, default=0.1, help="table sizes: Criteo Kaggle's times this")
    parser.add_argument("--zipf-alpha", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-local", action="store_true", help="skip the local baseline")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per trainer rank (default: cores / ranks)")
    parser.add_argument("--netem", metavar="DELAY_MS,RATE", help="shards behind an emulated network, e.g. 1,10gbit (root, iproute2)")
    parser.add_argument("--profile", action="store_true", help="instrument the runs and print where a step's time goes")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="with --profile (implied): append to FILE, for each run, the calls of the profiled steps that may "
                             "wait for the device, with the spans around them, and the busiest ops (trainer/probe.py: write_trace)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--durability", nargs="+", choices=DURABILITY,
                        help="also run the headline hybrid configuration with the embedded shards at each of these "
                             "write-ahead log levels (PSConfig.durability), e.g. none log fsync")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the generated data is cached")
    parser.add_argument("--repeat", type=int, default=None, help="rounds of every run; medians are reported (default 2; --quick 1)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one configuration may take")
    add_device_arguments(parser)
    parser.add_argument("--loader-workers", type=int, default=0, metavar="N", help="worker processes of every run's train DataLoader")
    parser.add_argument("--embedding-workers", type=int, default=None, metavar="N",
                        help="PersiaStrategy(embedding_workers=EmbeddingWorkerSettings(count=N)) (0: the per-id work on the "
                             "trainer's threads; default: the strategy's)")
    parser.add_argument("--scale-at", nargs="+", type=_step_and_shards, default=None, metavar="STEP:SHARDS",
                        help="also run every 1-rank PersiaStrategy configuration with its embedded shards moved live to "
                             "SHARDS after STEP (scale_shards(..., wait=False)), e.g. 100:3 200:2: the AUC and samples/s "
                             "of a run that scales beside one that does not")
    parser.add_argument("--storage-dtype", default="fp32", choices=["fp32", "fp16"], help="how the shards store the rows")
    parser.add_argument("--grow", action="store_true",
                        help="instead of the table: train while the tables grow (Criteo-Terabyte cardinalities) to --grow-rows")
    parser.add_argument("--grow-rows", type=float, default=1e8, help="--grow: stop once the shards hold this many rows")
    parser.add_argument("--grow-batch-size", type=int, default=16384, help="--grow: batch size")
    parser.add_argument("--grow-zipf", type=float, default=0.8, help="--grow: power-law exponent of the ids")
    parser.add_argument("--grow-max-steps", type=int, default=20000, help="--grow: give up after this many steps")
    parser.add_argument("--grow-storage", default="memory", choices=["memory", "disk"],
                        help="--grow: where the rows past --grow-memory-rows a table a shard go (disk: the shards' disk tier)")
    parser.add_argument("--grow-memory-rows", type=float, default=2e6, help="--grow --grow-storage disk: rows a table keeps in memory a shard")
    parser.add_argument("--grow-disk-dir", default=None, help="--grow --grow-storage disk: where the disk tiers go (a fresh folder, deleted after)")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = dict(steps=(40, 300), warmup=(10, 20), window=(5, 20), test_batches=(8, 16), ranks=([1], [1, 2]), staleness=([4], [4, 8]), repeat=(1, 2))
    for key, (q, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, q if quick else full)
    if args.warmup < 1 or args.steps < args.warmup + args.window:
        parser.error(f"--steps ({args.steps}) must cover --warmup ({args.warmup}, >= 1) plus one --window ({args.window})")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if any(args.batch_size % w for w in args.ranks):
        parser.error(f"--batch-size {args.batch_size} must be divisible by every --ranks value")
    if any(s < 1 for s in args.staleness):
        parser.error("--staleness values are the hybrid ones (>= 1); staleness 0 (sync) always runs")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.grow:
        from benchmarks.trainer.grow import run_grow

        return run_grow(args)
    from benchmarks.trainer import data

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    load_before = os.getloadavg()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, load average {load_before[0]:.2f} at start")
    meta = data.prepare(
        args.cache_dir or data.default_cache_dir(), seed=args.seed, batch_size=args.batch_size,
        train_batches=args.steps, test_batches=args.test_batches,
        cardinality_scale=args.cardinality_scale, zipf_alpha=args.zipf_alpha,
    )
    print(f"data: {args.steps} x {args.batch_size} training rows, {args.test_batches} x {args.batch_size} test rows, "
          f"{sum(meta['cardinalities']):,} ids in 26 tables (Zipf {args.zipf_alpha}), dim {args.dim}; "
          f"ground-truth AUC ceiling on the test rows {meta['ground_truth_auc']:.4f}")
    configs = make_configs(args, meta)
    net = None
    results: List[Dict[str, Any]] = []
    runner = None
    try:
        if args.netem:
            from benchmarks.common.netem import EmulatedNetwork, parse_netem

            delay_ms, rate = parse_netem(args.netem)
            net = EmulatedNetwork(delay_ms, rate)
            print(net.describe())
        with tempfile.TemporaryDirectory(prefix="train_bench-") as workdir:
            runner = Runner(Path(workdir), args.timeout, net)
            runs: Dict[str, List[Dict[str, Any]]] = {c["name"]: [] for c in configs}
            for round_index in range(args.repeat):  # rounds, not repeats in a row: a busy spell hits every run alike
                for config in configs:
                    threads = config.get("torch_threads") or trainer_threads(config["world"])
                    where = "" if config["mode"] == "local" else f", {config['shards']} shards{' across the emulated network' if net and config['mode'] == 'persia' else ''}"
                    label = f" [{round_index + 1}/{args.repeat}]" if args.repeat > 1 else ""
                    print(f"running {config['name']:<12} ({config['world']} rank(s) x {threads} torch thread(s){where}){label} ...", flush=True)
                    r = runner.run(config)
                    runs[config["name"]].append(r)
                    print(f"    {_fmt(r['samples_per_s'], ',.0f')} samples/s, test AUC {r['auc']:.4f}, {r['wall_s']:.0f} s", flush=True)
            results = [merge_repeats(runs[c["name"]]) for c in configs]
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        if runner is not None:
            runner.kill()
        if net is not None:
            net.close()

    load_after = os.getloadavg()
    print()
    print(f"train_bench: DLRM dim {args.dim}, global batch {args.batch_size}, {args.steps} steps "
          f"(samples/s: median of windows of {args.window} steps after {args.warmup}), test AUC on "
          f"{args.test_batches * args.batch_size:,} rows (ceiling {meta['ground_truth_auc']:.4f}), {args.shards} shards, "
          f"{args.wire_dtype} on the wire{', per-rank updates' if args.per_rank_updates else ''}"
          f"{'; ' + net.describe() if net else ', loopback'}")
    print(f"device: {results[0].get('device') if results else '-'} ({args.accelerator}); batches from {args.data}"
          f"{f', {args.loader_workers} DataLoader worker(s)' if args.loader_workers else ''}")
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after (other work on the machine lowers every figure)")
    head = headline(results, args)
    print_table(results, head)
    if args.profile:
        print_profile(results)
    if args.json:
        summary = dict(head)
        summary.update(
            runs=results, netem=args.netem, batch_size=args.batch_size, steps=args.steps, dim=args.dim, shards=args.shards,
            wire_dtype=args.wire_dtype, ground_truth_auc=meta["ground_truth_auc"], cpu_count=os.cpu_count(),
            load_average=[load_before[0], load_after[0]], accelerator=args.accelerator, data=args.data,
            loader_workers=args.loader_workers, device=results[0].get("device") if results else None,
        )
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == RUN_ONE:
        from benchmarks.trainer.run_one import run

        run(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
