"""Fault scenarios of whole training runs, each a subprocess of ``tests/strategy/run_faults.py`` (ToyRecommender
under PersiaStrategy, embedded shards, ModelCheckpoint every 4 steps). Prints what was tried and what survived.

    .venv/bin/python -m tools.fault_scenarios            # all scenarios (about 3 minutes on 2 cores)
    .venv/bin/python -m tools.fault_scenarios --only shard_killed_ddp rank_killed_ddp

The shards run with ``durability: none`` here: these scenarios exercise the rollback that a shard without a
write-ahead log (or whose log is lost) costs. With the log, a killed shard costs no rollback: ``wal_bench.py``.

Scenarios:
  shard_killed_ddp      2 ranks x 2 shards; shard 1 SIGKILLed after step 10: the launcher restarts it from the
                        last checkpoint, both ranks roll back at the same step and finish; dense weights agree.
  shard_killed_twice    1 rank x 2 shards; shard 0 killed after step 6, shard 1 after step 15: two rollbacks.
  rank_killed_ddp       2 ranks; rank 1 SIGKILLed after step 10: the job fails, every process is gone within the
                        bound; a second run resumes from the last checkpoint and finishes.
  rank0_killed_in_save  2 ranks; rank 0 SIGKILLed while the shards write its 3rd checkpoint: the previous pair
                        (.ckpt + PS folder) is intact, the half-written one never replaces it; resume works.
  no_checkpoint         1 rank; shard killed before any checkpoint: a clear PersiaRecoveryError, shards stopped.

Randomised mode (``--random N``): N runs of the DLRM example through ``lightning-persia fit`` (small and fast:
examples/dlrm/config.yaml with the overrides of ``run_config``), alternately 1 and 2 ranks, 2 embedded shards,
ModelCheckpoint every 10 steps, validation twice per epoch. Each run resumes from the step-10 checkpoint of a
fault-free run like it, so that a fault before its own first checkpoint has a state to return to (Lightning runs
no sanity check on a resumed fit; ``fit_once`` without ``resume`` starts fresh, with one). Each run gets one fault
on a random shard at a random moment, uniform over the run (from its first phase mark to its expected end, taken
from one fault-free calibration run per rank count): a SIGKILL, or (``--stop-fraction`` of the runs) a
SIGSTOP held for 1.5-3x ``ps.timeout_s`` then SIGCONT (a hung host); in ``--again-fraction`` of the SIGKILL runs a
second shard is SIGKILLed 0-0.1 s into the rollback the first one causes. Per run it prints where the fault landed
(the phase, from ``lightning_persia.testing.phases.PhaseMarks``), the rollbacks, whether the run finished and
its final val_auc; every run must finish.

    .venv/bin/python -m tools.fault_scenarios --random 50 --seed 0
    .venv/bin/python -m tools.fault_scenarios --random 2 --window-s 20 --train-batches 24   # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "strategy" / "run_faults.py"


def live(pgid: int) -> list[str]:
    listing = subprocess.run(["ps", "-o", "stat=,cmd=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if line.strip() and not line.strip().startswith("Z")]


KILLED_AT: dict[Path, float] = {}


def run(out: Path, *args: str, timeout: float = 300) -> tuple[int, str, float]:
    """Runs run_faults.py in its own process group; returns (exit status, output, seconds until every process is
    gone). The time of its first ``KILL`` line is kept in ``KILLED_AT[out]``."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"log-{time.monotonic_ns()}.txt"
    started = time.monotonic()
    KILLED_AT.pop(out, None)
    with open(log, "w") as f:
        process = subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(out), *args], stdout=f, stderr=subprocess.STDOUT,
                                   start_new_session=True, cwd=ROOT)
    while time.monotonic() - started < timeout:
        if out not in KILLED_AT and "KILL " in log.read_text():
            KILLED_AT[out] = time.monotonic()
        if process.poll() is not None and not live(process.pid):
            return process.returncode, log.read_text(), time.monotonic() - started
        time.sleep(0.1)
    subprocess.run(["kill", "-9", f"-{process.pid}"])
    process.wait()
    return -999, log.read_text() + "\nTIMED OUT (a hang)", time.monotonic() - started


def gone_after_kill(out: Path) -> str:
    return f"{time.monotonic() - KILLED_AT[out]:.1f} s after the kill" if out in KILLED_AT else "(no kill seen)"


def rank(out: Path, r: int) -> dict:
    return torch.load(out / f"rank{r}.pt", weights_only=False)


def shard_killed_ddp(base: Path) -> tuple[str, str, bool]:
    status, text, seconds = run(base, "--devices", "2", "--shards", "2", "--steps", "20", "--kill-shards", "1@10")
    if status != 0:
        return "killed shard 1 after step 10 (2 ranks)", f"FAILED (status {status}): {text[-500:]}", False
    r0, r1 = rank(base, 0), rank(base, 1)
    same = all(torch.equal(v, r1["dense"][k]) for k, v in r0["dense"].items())
    events = ", ".join(f"shard {e['shard']} {e['kind']}" for e in r0["shard_events"])
    rollbacks = [(e["step"], Path(e["checkpoint"]).name, round(e["seconds"], 1)) for e in r0["rollbacks"]]
    ok = r0["global_step"] == 20 and len(r0["rollbacks"]) == 1 and [e["step"] for e in r1["rollbacks"]] == [e["step"] for e in r0["rollbacks"]] and same
    return ("killed shard 1 after step 10 (2 ranks x 2 shards)",
            f"finished step {r0['global_step']} in {seconds:.0f} s; launcher: {events}; rollbacks (step, to, s): {rollbacks} on both ranks; "
            f"dense weights identical across ranks: {same}", ok)


def shard_killed_twice(base: Path) -> tuple[str, str, bool]:
    status, text, seconds = run(base, "--devices", "1", "--shards", "2", "--steps", "24", "--kill-shards", "0@6,1@15")
    if status != 0:
        return "killed shard 0 after step 6 and shard 1 after step 15 (1 rank)", f"FAILED (status {status}): {text[-500:]}", False
    r0 = rank(base, 0)
    rollbacks = [(e["step"], Path(e["checkpoint"]).name) for e in r0["rollbacks"]]
    events = ", ".join(f"shard {e['shard']} {e['kind']}" for e in r0["shard_events"])
    return ("killed shard 0 after step 6 and shard 1 after step 15 (1 rank x 2 shards)",
            f"finished step {r0['global_step']} in {seconds:.0f} s; launcher: {events}; rollbacks (step, to): {rollbacks}",
            r0["global_step"] == 24 and len(rollbacks) == 2)


def rank_killed_ddp(base: Path) -> tuple[str, str, bool]:
    status, text, seconds = run(base, "--devices", "2", "--shards", "2", "--steps", "20", "--kill-rank", "1", "--kill-rank-at", "10")
    first = f"run 1: exit status {status}, every rank and shard gone {gone_after_kill(base)}"
    ckpts = sorted(p.name for p in (base / "ckpt").glob("*.ckpt"))
    status2, text2, seconds2 = run(base, "--devices", "2", "--shards", "2", "--steps", "20", "--resume", "latest")
    resumed = rank(base, 0) if status2 == 0 else None
    ok = status != 0 and status2 == 0 and resumed is not None and resumed["global_step"] == 20
    second = f"run 2 resumed from {ckpts} and finished step {resumed['global_step']} in {seconds2:.0f} s" if resumed else f"run 2 FAILED: {text2[-400:]}"
    return "rank 1 SIGKILLed after step 10 (2 ranks x 2 shards)", f"{first}; {second}", ok


def rank0_killed_in_save(base: Path) -> tuple[str, str, bool]:
    status, text, seconds = run(base, "--devices", "2", "--shards", "1", "--steps", "20", "--kill-in-save", "3", "--save-delay", "0.3")
    gone = gone_after_kill(base)
    ckpts = sorted(p.name for p in (base / "ckpt").glob("*.ckpt"))
    ps = sorted(str(p.relative_to(base / "ckpt")) for p in (base / "ckpt").glob("*.ps/*"))
    status2, text2, seconds2 = run(base, "--devices", "1", "--shards", "1", "--steps", "20", "--resume", "latest")
    resumed = rank(base, 0) if status2 == 0 else None
    ok = status == -9 and ckpts == ["epoch=0-step=8.ckpt"] and resumed is not None and resumed["global_step"] == 20
    return ("rank 0 SIGKILLed while the shards write checkpoint 3 (step 12)",
            f"run 1: status {status}, every rank and shard gone {gone}; .ckpt files left: {ckpts}; PS folders: {ps}; "
            f"resume: {'finished step ' + str(resumed['global_step']) if resumed else 'FAILED ' + text2[-300:]}", ok)


def no_checkpoint(base: Path) -> tuple[str, str, bool]:
    status, text, seconds = run(base, "--devices", "1", "--shards", "1", "--steps", "20", "--checkpoint-every", "1000",
                                "--kill-shards", "0@3")
    line = next((l for l in text.splitlines() if "PersiaRecoveryError:" in l), "")
    return ("shard killed after step 3, no checkpoint yet", f"status {status} after {seconds:.0f} s: {line[:300]}",
            status != 0 and "no checkpoint of this run exists" in text)


SCENARIOS = {f.__name__: f for f in (shard_killed_ddp, shard_killed_twice, rank_killed_ddp, rank0_killed_in_save, no_checkpoint)}


# ---- randomised mode: the DLRM example through `lightning-persia fit`, one fault at a random moment ----------

PS_TIMEOUT_S = 2.0
NUM_SHARDS = 2


def run_config(out: Path, ranks: int, train_batches: int, durability: str = "none") -> str:
    """Overrides of examples/dlrm/config.yaml: a small, fast run with checkpoints, validations and a sanity check,
    its shards with ``durability`` (none: a killed shard costs a rollback, the path these scenarios test)."""
    every = max(1, 10 // ranks)
    ps_config = out / "ps.yaml"
    ps_config.write_text(f"durability: {durability}\n")
    return f"""
trainer:
  devices: {ranks}
  max_epochs: 1
  val_check_interval: 0.5
  num_sanity_val_steps: 2
  enable_checkpointing: true
  log_every_n_steps: 5
  enable_progress_bar: false
  default_root_dir: {out}
  strategy:
    init_args:
      staleness: 2
      ps: {{num_local_shards: {NUM_SHARDS}, timeout_s: {PS_TIMEOUT_S}, config: {ps_config}}}
      recovery: {{wait_for_shards_s: 60, client_max_backoff_s: 0.5}}
  callbacks:
    - class_path: examples.common.PrintAUC
    - class_path: lightning_persia.testing.phases.PhaseMarks
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {out / "ckpt"}, every_n_train_steps: {every}, save_top_k: 1, monitor: step, mode: max}}
model:
  init_args:
    bottom_mlp: [64, 16]
    top_mlp: [64, 32]
data:
  init_args:
    num_train_batches: {train_batches}
    num_val_batches: 8
    batch_size: 1024
"""


@dataclass
class Fault:
    kind: str  # "kill" or "stop"
    shard: int
    at_s: float  # after the run's first phase mark
    stop_s: float = 0.0
    again_in_rollback: Optional[int] = None  # this shard is SIGKILLed too, once the rollback the first fault causes begins
    again_after_s: float = 0.0  # that long after the rollback's first line
    after_mark: Optional[str] = None  # at_s counts from this phase mark (e.g. "backward 14") instead of the first one


@dataclass
class Outcome:
    status: int
    seconds: float
    phase: str = "(no fault)"
    landed_s: Optional[float] = None
    second_phase: Optional[str] = None
    rollbacks: list = field(default_factory=list)
    auc: Optional[float] = None
    fit_s: Optional[float] = None  # from the first phase mark to the end of fit
    log: str = ""


def _phase_at(lines: list[tuple[float, str]], when: float) -> str:
    phase, before_rollback = "start-up", None
    for stamp, line in lines:
        if stamp > when:
            break
        if line.startswith("PHASE "):
            phase = line.split(" ", 1)[1].rsplit(" ", 1)[0]
            before_rollback = None
        elif "rolling back to" in line and before_rollback is None:
            before_rollback, phase = phase, f"rollback (in {phase})"
        elif "rolled back to" in line and before_rollback is not None:
            phase, before_rollback = before_rollback, None
    return phase


def _shard_pid(group: int, shard: int) -> Optional[int]:
    for _ in range(20):  # a shard being restarted is back within a few tenths of a second
        listing = subprocess.run(["ps", "-ww", "-o", "pid=,stat=,args=", "-g", str(group)], capture_output=True, text=True).stdout
        for line in listing.splitlines():
            pid, stat, args = line.split(None, 2)
            if "ps serve" in args and f"--shard-index {shard} " in args + " " and not stat.startswith("Z"):
                return int(pid)
        time.sleep(0.05)
    return None


def _signal_shard(group: int, shard: int, pid: Optional[int], signum: int) -> Optional[int]:
    """Sends ``signum`` to ``shard`` (``pid``, found beforehand, or its restarted successor); returns the pid."""
    for candidate in (pid, None):
        candidate = candidate or _shard_pid(group, shard)
        if candidate is None:
            return None
        try:
            os.kill(candidate, signum)
            return candidate
        except ProcessLookupError:
            continue
    return None


def _kill_in_rollback(process: subprocess.Popen, lines: list[tuple[float, str]], shard: int, after_s: float) -> str:
    """SIGKILLs ``shard`` ``after_s`` after the run logs that it rolls back; returns the phase it landed in."""
    known = _shard_pid(process.pid, shard)
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:
        began = next((stamp for stamp, line in list(lines) if "rolling back to" in line), None)
        if began is not None:
            time.sleep(max(0.0, began + after_s - time.monotonic()))
            landed = time.monotonic()
            if _signal_shard(process.pid, shard, known, signal.SIGKILL) is None:
                return "(no live shard)"
            time.sleep(0.05)
            return _phase_at(lines, landed)
        time.sleep(0.02)
    return "(no rollback began)"


def fit_once(out: Path, ranks: int, train_batches: int, fault: Optional[Fault], resume: Optional[Path] = None,
             extra: tuple[str, ...] = (), timeout: float = 600, durability: str = "none") -> Outcome:
    """One ``lightning-persia fit`` of the small DLRM run (from the checkpoint ``resume``, copied into ``out``
    first), with ``fault`` injected; every line of its output timestamped."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "run.yaml"
    config.write_text(run_config(out, ranks, train_batches, durability))
    command = [sys.executable, "-m", "lightning_persia.cli", "fit", "--config", str(ROOT / "examples/dlrm/config.yaml"),
               "--config", str(config), *extra]
    if resume is not None:
        start = out / "start" / resume.name
        shutil.copytree(resume.parent, start.parent)
        command += ["--ckpt_path", str(start)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, cwd=ROOT, env=env,
                               start_new_session=True)
    lines: list[tuple[float, str]] = []
    first_mark = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if line.startswith("PHASE "):
                first_mark.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    outcome = Outcome(status=-999, seconds=0.0)
    if fault is not None and first_mark.wait(timeout):
        known = _shard_pid(process.pid, fault.shard)  # looked up now: a signal then lands on its mark, not 50 ms after
        mark = f"PHASE {fault.after_mark}" if fault.after_mark else "PHASE "
        t0 = None
        while t0 is None and process.poll() is None:
            t0 = next((stamp for stamp, line in list(lines) if line.startswith(mark)), None)
            time.sleep(0.005)
        t0 = t0 if t0 is not None else time.monotonic()
        time.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
        landed = time.monotonic()
        pid = _signal_shard(process.pid, fault.shard, known, signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP) \
            if process.poll() is None else None
        if pid is not None:
            if fault.kind == "stop":
                time.sleep(fault.stop_s)
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.05)  # the reader has the lines written before the signal
            outcome.landed_s, outcome.phase = landed - t0, _phase_at(lines, landed)
            if fault.again_in_rollback is not None:
                outcome.second_phase = _kill_in_rollback(process, lines, fault.again_in_rollback, fault.again_after_s)
        else:
            outcome.phase = "(the run had ended)"
    try:
        outcome.status = process.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        lines.append((time.monotonic(), "TIMED OUT (a hang)"))
    reader.join(10)
    while live(process.pid) and time.monotonic() - started < timeout + 30:
        time.sleep(0.1)
    outcome.seconds = time.monotonic() - started
    text = [line for _, line in lines]
    outcome.log = "\n".join(text)
    (out / "log.txt").write_text("".join(f"{stamp - started:8.3f} {line}\n" for stamp, line in lines))
    for stamp, line in lines:
        if line.startswith("ROLLBACKS "):
            outcome.rollbacks = json.loads(line.split(" ", 1)[1])
        found = re.search(r"end of fit: val_auc ([0-9.]+)", line)
        if found:
            outcome.auc = float(found.group(1))
        if line.startswith("PHASE after fit"):
            outcome.fit_s = stamp - next(s for s, l in lines if l.startswith("PHASE "))
    return outcome


def random_faults(base: Path, runs: int, seed: int, stop_fraction: float, again_fraction: float, train_batches: int,
                  window_s: Optional[float]) -> bool:
    rng = random.Random(seed)
    windows: dict[int, float] = {}
    starts: dict[int, Path] = {}
    for ranks in (1, 2):
        # Every run resumes from the checkpoint of step 10 of a run like it: a shard failing before a run's
        # first checkpoint (its sanity check, its first steps) then has a state to roll back to, as in any
        # resumed or long run. (Without one the run stops with PersiaRecoveryError: the `no_checkpoint` scenario.)
        first = fit_once(base / f"first-{ranks}", ranks, train_batches, None, extra=("--trainer.max_steps=10",))
        found = sorted((base / f"first-{ranks}" / "ckpt").glob("*.ckpt"))
        if first.status != 0 or not found:
            print(f"the run making the first checkpoint ({ranks} ranks) FAILED (status {first.status}):\n{first.log[-3000:]}", flush=True)
            return False
        starts[ranks] = found[-1]
        if window_s is not None:
            windows[ranks] = window_s
            continue
        calibration = fit_once(base / f"calibrate-{ranks}", ranks, train_batches, None, resume=starts[ranks])
        if calibration.status != 0 or calibration.fit_s is None:
            print(f"calibration run ({ranks} ranks) FAILED (status {calibration.status}):\n{calibration.log[-3000:]}", flush=True)
            return False
        windows[ranks] = calibration.fit_s
        print(f"calibration, {ranks} rank(s), no fault: fit {calibration.fit_s:.1f} s after its first phase mark, "
              f"{calibration.seconds:.1f} s in all, val_auc {calibration.auc}", flush=True)
    print(f"\n{'run':>3} {'ranks':>5} {'fault':<13} {'at s':>5}  {'landed in':<44} {'rollbacks (step@where)':<34} {'result':<8} {'val_auc':>7} {'wall s':>6}", flush=True)
    results = []
    for index in range(runs):
        ranks = 1 + index % 2
        stop = rng.random() < stop_fraction
        fault = Fault("stop" if stop else "kill", rng.randrange(NUM_SHARDS), rng.uniform(0.0, windows[ranks]),
                      stop_s=round(rng.uniform(1.5, 3.0) * PS_TIMEOUT_S, 1) if stop else 0.0)
        if not stop and rng.random() < again_fraction:
            fault.again_in_rollback, fault.again_after_s = rng.randrange(NUM_SHARDS), rng.uniform(0.0, 0.1)
        outcome = fit_once(base / f"run-{index}", ranks, train_batches, fault, resume=starts[ranks])
        finished = outcome.status == 0 and outcome.auc is not None
        results.append((ranks, fault, outcome, finished))
        what = f"SIGSTOP {fault.stop_s:g}s" if stop else "SIGKILL"
        if outcome.second_phase is not None:
            outcome.phase += f" + s{fault.again_in_rollback} in {outcome.second_phase}"
        rollbacks = ", ".join(f"{r['step']}@{r['where']}" for r in outcome.rollbacks) or "none"
        landed = f"{outcome.landed_s:5.1f}" if outcome.landed_s is not None else "    -"
        print(f"{index:>3} {ranks:>5} {what + ' s' + str(fault.shard):<13} {landed}  {outcome.phase:<44} {rollbacks:<34} "
              f"{'finished' if finished else 'FAILED':<8} {outcome.auc if outcome.auc is not None else float('nan'):>7.4f} {outcome.seconds:>6.0f}", flush=True)
        if not finished:
            print(outcome.log[-4000:], flush=True)
    phases: dict[str, int] = {}
    for _, _, outcome, _ in results:
        for key in [outcome.phase.split(" + ")[0]] + ([outcome.second_phase] if outcome.second_phase else []):
            key = key.split(" (in ")[0]
            phases[key] = phases.get(key, 0) + 1
    aucs = [o.auc for _, _, o, ok in results if ok and o.auc is not None]
    print(f"\n{sum(ok for *_, ok in results)} of {len(results)} runs finished; faults (first and second) landed in: "
          + ", ".join(f"{k} {v}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]))
          + f"; rollbacks: {sum(len(o.rollbacks) for _, _, o, _ in results)}"
          + (f"; val_auc {min(aucs):.4f}-{max(aucs):.4f}" if aucs else ""), flush=True)
    return all(ok for *_, ok in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS))
    parser.add_argument("--random", type=int, metavar="N", help="N runs of the DLRM example, each with one random fault")
    parser.add_argument("--seed", type=int, default=0, help="--random: seed of the faults' draws")
    parser.add_argument("--stop-fraction", type=float, default=0.25, help="--random: share of SIGSTOP/SIGCONT faults")
    parser.add_argument("--again-fraction", type=float, default=0.2,
                        help="--random: share of SIGKILL runs where a second shard is killed during the rollback")
    parser.add_argument("--train-batches", type=int, default=60, help="--random: training batches of a run (all ranks)")
    parser.add_argument("--window-s", type=float, help="--random: draw the fault times in [0, this] instead of calibrating")
    parser.add_argument("--keep", help="--random: keep every run's folder (logs, checkpoints) under this folder")
    args = parser.parse_args()
    if args.random is not None:
        if args.keep:
            ok = random_faults(Path(args.keep), args.random, args.seed, args.stop_fraction, args.again_fraction, args.train_batches,
                               args.window_s)
        else:
            with tempfile.TemporaryDirectory(prefix="persia-random-faults-") as tmp:
                ok = random_faults(Path(tmp), args.random, args.seed, args.stop_fraction, args.again_fraction, args.train_batches,
                                   args.window_s)
        return 0 if ok else 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="persia-faults-") as tmp:
        for name in args.only or SCENARIOS:
            started = time.monotonic()
            tried, survived, ok = SCENARIOS[name](Path(tmp) / name)
            rows.append((name, tried, survived, ok, time.monotonic() - started))
            print(f"[{'ok' if ok else 'FAIL'}] {name} ({rows[-1][4]:.0f} s)\n    tried:    {tried}\n    survived: {survived}", flush=True)
    print()
    print(f"{'scenario':<22} {'result':<6} seconds")
    for name, _, _, ok, seconds in rows:
        print(f"{name:<22} {'ok' if ok else 'FAIL':<6} {seconds:.0f}")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
