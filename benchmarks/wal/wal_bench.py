"""Shards with a write-ahead log killed at random moments of a training run: does any update get lost or applied twice?

Two runs of a small DLRM (``wal/train.py``: synthetic Criteo, 2 shards started here with ``durability: log``,
checkpoints every ``--checkpoint-every`` steps): one uninterrupted, one whose shards are SIGKILLed ``--kills`` times
at random moments. The shards' launcher restarts a killed shard, which replays its log past its last checkpoint;
the trainer waits for it and goes on. Kinds of kills (drawn per kill): at a random moment of training; just after
a step's backward, while its update is on its way (shards pause ``fault_ack_delay_s`` between logging an update and
answering it, so such kills land between a log write and its acknowledgement: the restarted shard then answers the
retried update as a duplicate, which counts it); inside a checkpoint save (after the ``save`` phase mark); and
inside the replay the previous kill caused (once the restarted shard says it replays). After a shard is back,
the next kill waits for a step of training. With ``--staleness 0`` the dense weights and every table row must equal the uninterrupted
run's bit for bit; with ``--staleness > 0`` the test AUCs are compared. A τ > 0 run is not deterministic (how many
earlier updates each lookup misses depends on timing), so ``--repeat N`` runs N pairs (uninterrupted, with kills)
in turn and compares the means of the AUCs; each run also reports the lag of its lookups (``wal/lag.py``): how
many earlier steps' updates were unacknowledged when each lookup went out and when it was answered.

    .venv/bin/python -m benchmarks.wal.wal_bench                                   # 20 kills, τ = 0
    .venv/bin/python -m benchmarks.wal.wal_bench --staleness 4 --repeat 3 --json   # τ = 4: mean AUCs of 3 pairs of runs
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from benchmarks.wal.compare import auc_figures, differences
from benchmarks.wal.lag import HISTOGRAMS, mean_lag
from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.config import DURABILITY
from lightning_persia.remote_ps.launcher import LocalShards

ROOT = Path(__file__).resolve().parents[2]
TRAIN = "benchmarks.wal.train"  # run as a module from ROOT
FAULT_KNOBS = ["fault_save_delay_s=0.02", "fault_ack_delay_s=0.02", "fault_replay_delay_s=0.005"]
AUC_TOLERANCE = 0.001  # issue 29: with τ > 0, runs with kills end within this of uninterrupted ones


@dataclass
class Run:
    """One training run: its output lines (timestamped), its result, and what the kills did to it."""

    out: Path
    lines: list = field(default_factory=list)
    status: Optional[int] = None
    seconds: float = 0.0
    kills: list = field(default_factory=list)  # (kind it aimed at, shard, where it landed)
    replays: list = field(default_factory=list)  # seconds of each completed replay
    duplicates: dict = field(default_factory=dict)  # incarnation -> retried updates it answered as duplicates

    def step(self) -> int:
        for _, line in reversed(self.lines):
            if line.startswith("PHASE "):
                return int(line.rsplit(" ", 1)[1])
        return 0

    def phase(self) -> str:
        for _, line in reversed(self.lines):
            if line.startswith("PHASE "):
                return line.split(" ", 1)[1].rsplit(" ", 1)[0]
        return "start-up"

    def result(self) -> dict:
        path = self.out / "result.json"
        return json.loads(path.read_text()) if path.exists() else {}


def start_shards(workdir: Path, args: argparse.Namespace) -> LocalShards:
    return LocalShards(args.shards, restart=True, max_restarts=args.kills + 2, overrides=[
        "seed=0", f"durability={args.durability}", f"wal_dir={workdir / 'wal'}", *FAULT_KNOBS])


def train(out: Path, shards: LocalShards, args: argparse.Namespace, run: Run) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", TRAIN, "--ps-addresses", ",".join(shards.addresses), "--out", str(out),
               "--steps", str(args.steps), "--staleness", str(args.staleness), "--checkpoint-every", str(args.checkpoint_every)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, cwd=ROOT)

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            run.lines.append((time.monotonic(), line.rstrip("\n")))

    threading.Thread(target=read, daemon=True).start()
    return process


def _replay_state(shards: LocalShards, shard: int) -> str:
    """``replaying`` or ``replayed``: the last replay line the shard printed (its output across restarts)."""
    for line in reversed(shards.output(shard).splitlines()):
        if "replaying its write-ahead log" in line:
            return "replaying"
        if " replayed " in line:
            return "replayed"
    return ""


def _wait(condition, timeout_s: float, process: subprocess.Popen) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        if condition():
            return True
        time.sleep(0.005)
    return False


def _kill(shards: LocalShards, shard: int) -> bool:
    try:
        os.kill(shards.processes[shard].pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def _read_replays(client: PSClient, run: Run, seen: set) -> None:
    """Each incarnation's replay once (its seconds), and the duplicates it answered so far. Waits until every shard
    answers (a killed one is back)."""
    for stats in client.stats():
        server = stats["server"]
        replay = server["wal"].get("replay", {})
        if replay.get("replayed") and stats["incarnation"] not in seen:
            seen.add(stats["incarnation"])
            run.replays.append(replay["seconds"])
        if replay.get("replayed"):
            run.duplicates[stats["incarnation"]] = server.get("update_duplicates", 0)


def inject(process: subprocess.Popen, shards: LocalShards, run: Run, args: argparse.Namespace, seed: int) -> None:
    """The kills of one run (see the module docstring), spread over its steps, drawn from ``seed``."""
    rng = random.Random(seed)
    client = PSClient(shards.addresses, timeout_s=10, max_retries=100, retry_for_s=120)
    seen: set = set()
    killed = [0] * args.shards
    try:
        steps = sorted(rng.sample(range(3, args.steps - 10), args.kills))
        resume_step = 0
        kind = rng.choices(["train", "ack", "save"], [0.4, 0.3, 0.3])[0]
        while len(run.kills) < args.kills and process.poll() is None:
            number, at_step = len(run.kills), steps[len(run.kills)]
            shard = killed.index(min(killed)) if kind != "replay" else run.kills[-1][1]
            if kind == "replay":
                landed = _wait(lambda: _replay_state(shards, shard) == "replaying", 60, process)
                if not landed or not _kill(shards, shard):  # it was back before the kill: a kill of another kind instead
                    kind = rng.choices(["train", "ack", "save"], [0.4, 0.3, 0.3])[0]
                    continue
                where = "replay" if _replay_state(shards, shard) == "replaying" else "after its replay"
            else:
                if not _wait(lambda: run.step() >= max(at_step, resume_step + 1), 600, process):
                    break
                if kind != "train" and not _wait(lambda: run.phase() == ("save" if kind == "save" else "between steps"), 600, process):
                    break
                time.sleep(rng.uniform(0.0, 0.02 if kind == "ack" else 0.05))
                where = run.phase()
                if not _kill(shards, shard):
                    continue
            killed[shard] += 1
            run.kills.append((kind, shard, where))
            print(f"  kill {number + 1:>2}: shard {shard}, aimed at {kind:<6} landed in {where} (step {run.step()})", flush=True)
            previous, kind = kind, rng.choices(["train", "ack", "save", "replay"], [0.3, 0.25, 0.25, 0.2])[0]
            if kind == "replay" and previous != "replay":
                continue  # the next kill lands in this one's replay
            kind = "train" if kind == "replay" else kind
            _read_replays(client, run, seen)
            resume_step = run.step()
        process.wait(timeout=args.timeout)
        _read_replays(client, run, seen)
    finally:
        client.close()


def one_run(name: str, workdir: Path, args: argparse.Namespace, kills: bool, seed: int) -> Run:
    run = Run(workdir / name)
    shards = start_shards(workdir / name, args)
    started = time.monotonic()
    try:
        process = train(run.out, shards, args, run)
        if kills:
            inject(process, shards, run, args, seed)
        run.status = process.wait(timeout=args.timeout)
    finally:
        run.seconds = time.monotonic() - started
        shards.stop()
    return run


def _landed(kills: list) -> dict[str, int]:
    landed: dict[str, int] = {}
    for _, _, where in kills:
        key = re.sub(r"\d+", "", where).strip()
        landed[key] = landed.get(key, 0) + 1
    return landed


def _pair(number: int, workdir: Path, args: argparse.Namespace) -> dict:
    """One uninterrupted run and one with kills (drawn from ``args.seed + number``), and what they show."""
    print(f"uninterrupted run {number + 1} ...", flush=True)
    reference = one_run(f"reference{number}", workdir, args, kills=False, seed=args.seed + number)
    print(f"  {reference.seconds:.0f} s, {reference.result()}", flush=True)
    print(f"run {number + 1} with kills ...", flush=True)
    faulted = one_run(f"kills{number}", workdir, args, kills=True, seed=args.seed + number)
    result, expected = faulted.result(), reference.result()
    print(f"  {faulted.seconds:.0f} s, {result}", flush=True)
    finished = faulted.status == 0 and reference.status == 0 and result.get("global_step") == args.steps
    found = differences(faulted.out, reference.out) if finished else ["a run did not finish"]
    if not finished:
        for out, run in (("reference", reference), ("kills", faulted)):
            print(f"{out} run: status {run.status}; last lines:\n" + "\n".join(l for _, l in run.lines[-30:]), flush=True)
    return {"finished": finished, "found": found, "kills": faulted.kills, "replays": faulted.replays,
            "duplicates": sum(faulted.duplicates.values()), "result": result, "reference": expected,
            "seconds": faulted.seconds, "reference_seconds": reference.seconds}


def _summary(pairs: list[dict], args: argparse.Namespace, load: tuple[float, float]) -> dict:
    """The figures of every pair together: the kills' counts summed, the AUCs and lags as means over the runs."""
    finished = all(p["finished"] for p in pairs)
    kills = [k for p in pairs for k in p["kills"]]
    replays = [r for p in pairs for r in p["replays"]]
    summary = {
        "kills": len(kills), "rollbacks": sum(p["result"].get("rollbacks") or 0 for p in pairs) if finished else None,
        "replays": len(replays), "max_replay_s": round(max(replays), 3) if replays else 0.0,
        "weights_equal": (not any(p["found"] for p in pairs)) if args.staleness == 0 else None,
        "between_write_and_ack": sum(p["duplicates"] for p in pairs), "landed": _landed(kills), "staleness": args.staleness,
        "runs": len(pairs), "seconds": round(sum(p["seconds"] for p in pairs), 1),
        "reference_seconds": round(sum(p["reference_seconds"] for p in pairs), 1),
        "load_average": list(load), "durability": args.durability,
    }
    summary["auc_diff"] = None
    if finished:
        summary.update(auc_figures([p["result"]["test_auc"] for p in pairs], [p["reference"]["test_auc"] for p in pairs]))
        summary["lag"] = {side: {key: mean_lag([p[which]["lag"] for p in pairs], key) for key in HISTOGRAMS}
                          for side, which in (("kills", "result"), ("reference", "reference"))}
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="kills of each run with kills")
    parser.add_argument("--repeat", type=int, default=1, help="pairs of runs (uninterrupted, with kills), in turn")
    parser.add_argument("--steps", type=int, default=400, help="training steps of each run")
    parser.add_argument("--checkpoint-every", type=int, default=25, help="steps between checkpoints (each truncates the logs)")
    parser.add_argument("--staleness", type=int, default=0, help="τ of both runs (0: the weights are compared bit for bit)")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--durability", default="log", choices=DURABILITY[1:])
    parser.add_argument("--seed", type=int, default=0, help="seed of the kills' draws (pair i draws from seed + i)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    parser.add_argument("--keep", type=Path, help="keep the runs' folders (logs, checkpoints, write-ahead logs) here")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args(argv)
    if args.kills > args.steps - 13:
        parser.error("--kills must leave room in --steps (at most steps - 13)")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    load_before = os.getloadavg()[0]
    print(f"wal_bench: {args.steps} steps, τ={args.staleness}, {args.shards} shards with durability {args.durability}, "
          f"checkpoint every {args.checkpoint_every} steps, {args.kills} kills, {args.repeat} pair(s) of runs; "
          f"{os.cpu_count()} cores, load {load_before:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="wal_bench-") as tmp:
        workdir = args.keep or Path(tmp)
        pairs = [_pair(number, workdir, args) for number in range(args.repeat)]
    summary = _summary(pairs, args, (load_before, os.getloadavg()[0]))
    print()
    print(f"kills {summary['kills']} over {args.repeat} run(s) (landed: {', '.join(f'{k} {v}' for k, v in sorted(summary['landed'].items()))}); "
          f"retried updates the restarted shards answered as duplicates (kills between a log write and its ack): "
          f"{summary['between_write_and_ack']}")
    print(f"rollbacks {summary['rollbacks']}; replays {summary['replays']}, longest {summary['max_replay_s']} s")
    found = [f for p in pairs for f in p["found"]]
    if args.staleness == 0:
        print("weights: " + ("dense and every table row equal to the uninterrupted run's, bit for bit" if not found
                             else "DIFFER: " + "; ".join(found[:10])))
    if summary["auc_diff"] is not None:
        print(f"test AUC {summary['test_auc']:.5f} with kills (runs {', '.join(f'{a:.5f}' for a in summary['test_aucs'])}) vs "
              f"{summary['reference_test_auc']:.5f} uninterrupted (runs {', '.join(f'{a:.5f}' for a in summary['reference_test_aucs'])}): "
              f"gap {summary['auc_gap']:+.5f}" + (f" (standard error {summary['auc_gap_se']:.5f})" if summary["auc_gap_se"] is not None else ""))
        for side in ("kills", "reference"):
            lag = summary["lag"][side]
            print(f"lag of the lookups ({side}): {lag['at_issue']:.3f} steps when they went out, {lag['at_answer']:.3f} when answered (mean)")
    print(f"wall: {summary['seconds']:.0f} s with kills, {summary['reference_seconds']:.0f} s without; "
          f"load average {summary['load_average'][0]:.2f} before, {summary['load_average'][1]:.2f} after")
    if args.json:
        print(json.dumps(summary))
    passed = summary["auc_diff"] is not None and summary["rollbacks"] == 0 and (
        not found if args.staleness == 0 else summary["auc_diff"] <= AUC_TOLERANCE)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
