"""Fault scenarios of whole training runs, each a subprocess of ``tests/strategy/run_faults.py`` (ToyRecommender
under PersiaStrategy, embedded shards, ModelCheckpoint every 4 steps). Prints what was tried and what survived.

    .venv/bin/python benchmarks/fault_scenarios.py            # all scenarios (about 3 minutes on 2 cores)
    .venv/bin/python benchmarks/fault_scenarios.py --only shard_killed_ddp rank_killed_ddp

Scenarios:
  shard_killed_ddp      2 ranks x 2 shards; shard 1 SIGKILLed after step 10: the launcher restarts it from the
                        last checkpoint, both ranks roll back at the same step and finish; dense weights agree.
  shard_killed_twice    1 rank x 2 shards; shard 0 killed after step 6, shard 1 after step 15: two rollbacks.
  rank_killed_ddp       2 ranks; rank 1 SIGKILLed after step 10: the job fails, every process is gone within the
                        bound; a second run resumes from the last checkpoint and finishes.
  rank0_killed_in_save  2 ranks; rank 0 SIGKILLed while the shards write its 3rd checkpoint: the previous pair
                        (.ckpt + PS folder) is intact, the half-written one never replaces it; resume works.
  no_checkpoint         1 rank; shard killed before any checkpoint: a clear PersiaRecoveryError, shards stopped.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS))
    args = parser.parse_args()
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
