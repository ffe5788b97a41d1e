"""Kills at random points of live moves (``elastic_bench.py --kill-soak N``): N moves, 2 -> 3 and 3 -> 2 shards in
turn, while a client trains; in each, one process dies by SIGKILL at a step of the move drawn at random (seeded).

- The shards log every update (``durability=log``) and their launcher restarts a killed one, which replays its log.
- The victims, each in turn (shuffled): the coordinator (``ps scale``'s process), a shard giving slots away (a
  *source*), a shard taking them (a *taker*), or a second trainer (a process of its own). The step, drawn: the one
  the coordinator is about to begin (``rescale``'s ``on_step``: begin, rows, changes, fence, last changes, adopt,
  finish). The shards settle a fenced move alone after the default ``handover_deadline_s`` (30 s), longer than a
  shard's restart: a killed taker is waited for.
- A move whose coordinator failed or died is run again once the shards answer, as an operator (or a Kubernetes Job's
  restart) runs ``ps scale`` again. That run first settles the move left under way: finished if it had gone through,
  given up otherwise (``remote_ps/move_settling.py``). ``attempts_rolled_back`` counts the killed attempts whose
  killed wave was given up: the run after them started from the map before that wave (the waves before it stay done,
  and the run moves the rest either way); ``rollbacks`` counts the moves that ended on the old map.
- The main client trains two tables: ``counts`` (SGD, lr 1, every gradient -1, rows from 0: a row's value is the
  updates it got) and ``weights`` (Adam), whose every acknowledged update is replayed on one store that never moved:
  an unscaled run of the same steps. ``lost_updates``: acknowledged updates missing from ``counts`` (and from the
  second trainer's table, whose rows may hold one more update, in flight when it was killed); ``weights_equal``:
  ``weights`` equals the unscaled run bit for bit at the end.
"""
from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from lightning_persia.remote_ps.client import PSClient, RetryPolicy
from lightning_persia.remote_ps.client.scaling import ScaleSettings, wait_drained
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.server import wal_directory
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.table_config import SGD, Adam, Constant, TableConfig

STEPS = ("begin", "rows", "changes", "fence", "last changes", "adopt", "finish")
VICTIMS = ("coordinator", "source", "taker", "trainer")
SIDE_IDS = 1000

# `ps scale`'s coordinator, stopping before each step until told "go" (so that a kill lands at that step); its
# retries outlast a shard's restart, as a `ps scale` run against a supervised cluster should
COORDINATOR = """
import json, sys
from dataclasses import asdict
from lightning_persia.remote_ps.client import PSClient, RetryPolicy
from lightning_persia.remote_ps.client.scaling import ScaleSettings, rescale

def step(name):
    print("STEP", name, flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(3)

with PSClient(sys.argv[1].split(","), retry=RetryPolicy(timeout_s=30, retry_for_s=60)) as admin:
    report = rescale(admin, sys.argv[2].split(","), ScaleSettings(wave_rows=int(sys.argv[3])), on_step=step)
print("REPORT", json.dumps(asdict(report)), flush=True)
"""

# the second trainer: every step updates the same ids of table "side" by -1 (SGD, lr 1); prints each acknowledgement
SIDE_TRAINER = """
import sys, torch
from lightning_persia.remote_ps.client import PSClient, RetryPolicy
with PSClient(sys.argv[1].split(","), retry=RetryPolicy(retry_for_s=120)) as client:
    ids = torch.arange(%d)
    for step in range(1, 1 << 30):
        client.update({"side": (ids, -torch.ones(ids.numel(), 4))}, wire_dtype="fp32")
        print(step, flush=True)
""" % SIDE_IDS


@dataclass
class Move:
    """One move of the soak: what was killed when, and how it ended."""

    to_shards: int
    victim: str
    step: str
    wave: int = 1  # the step of which wave the kill lands at
    killed: bool = False
    attempts: int = 1
    attempt_rolled_back: bool = False
    ended_on_new_map: bool = False
    seconds: float = 0.0


@dataclass
class SoakReport:
    moves: list[Move] = field(default_factory=list)
    kills: int = 0
    rollbacks: int = 0
    attempts_rolled_back: int = 0
    lost_updates: int = 0
    applied_twice: int = 0
    weights_equal: bool = False
    steps: int = 0
    seconds: float = 0.0


class MainTrainer(threading.Thread):
    """Steps of lookup + update of both tables while the moves run; every acknowledged update is replayed on ``model``."""

    def __init__(self, addresses: list[str], rows: int, batch: int, dim: int, model: ShardStore) -> None:
        super().__init__(daemon=True)
        self.client = PSClient(addresses, retry=RetryPolicy(timeout_s=30, retry_for_s=120))
        self.rows, self.batch, self.dim, self.model = rows, batch, dim, model
        self.counts = torch.zeros(rows, dtype=torch.int64)
        self.steps = 0
        self.error: Optional[BaseException] = None
        self.stopping = threading.Event()
        self._generator = torch.Generator().manual_seed(0)

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                ids = torch.randint(0, self.rows, (self.batch,), generator=self._generator).unique()
                grads = torch.randn(ids.numel(), self.dim, generator=self._generator)
                self.client.lookup({"counts": ids, "weights": ids}, train=True, wire_dtype="fp32")
                self.model.lookup("weights", ids, train=True)
                self.client.update({"counts": (ids, -torch.ones(ids.numel(), self.dim)), "weights": (ids, grads)},
                                   wire_dtype="fp32")
                self.model.update("weights", ids, grads)
                self.counts[ids] += 1
                self.steps += 1
        except BaseException as err:  # noqa: BLE001 - the soak reports it
            self.error = err


class SideTrainer:
    """The second trainer's process (one per move), its acknowledgements, and its incarnations: each may end with one
    update applied but not acknowledged (killed, or stopped after its move)."""

    def __init__(self) -> None:
        self.acknowledged = 0  # over every incarnation
        self.incarnations = 0
        self._process: Optional[subprocess.Popen] = None

    def start(self, addresses: list[str]) -> None:
        self._process = subprocess.Popen([sys.executable, "-c", SIDE_TRAINER, ",".join(addresses)], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        self.incarnations += 1
        process = self._process
        self._reader = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._reader.start()

    def _read(self, process: subprocess.Popen) -> None:
        last = 0
        for line in process.stdout:
            self.acknowledged += int(line) - last
            last = int(line)

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
        self.stop()

    def stop(self) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                self._process.terminate()
            self._process.wait(30)
            self._reader.join(30)
            self._process = None


def _coordinate(current: list[str], addresses: list[str], kill_at: Optional[str], kill, wave_rows: int,
                wave: int = 1) -> tuple[bool, Optional[dict]]:
    """Runs a coordinator moving in waves of ``wave_rows`` rows; at step ``kill_at`` of its ``wave``-th wave calls
    ``kill(process)`` (which may kill the coordinator). Returns whether it was killed there, and its report (None
    when it failed or died)."""
    process = subprocess.Popen([sys.executable, "-c", COORDINATOR, ",".join(current), ",".join(addresses), str(wave_rows)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed, report, seen = False, None, 0
    for line in process.stdout:
        if line.startswith("STEP "):
            seen += line.split(" ", 1)[1].strip() == kill_at
            if seen == wave and not killed:
                killed = True
                kill(process)
            if process.poll() is None:
                try:
                    process.stdin.write("go\n")
                    process.stdin.flush()
                except BrokenPipeError:
                    pass
        elif line.startswith("REPORT "):
            report = json.loads(line.split(" ", 1)[1])
    process.wait(60)
    return killed, report if process.returncode == 0 else None


def killed_wave_given_up(rerun: dict, version: int, wave: int) -> bool:
    """Whether the ``wave``-th wave of a move from map ``version``, whose coordinator run was killed, was given up: the
    run after it (``rerun``, a ``ScaleReport`` as a dict) began from the map before that wave, not from the wave's own.
    Its waves are the next versions of the map it began from; it moves the remaining waves either way."""
    return rerun["map_version"] - rerun["waves"] < version + wave


def soak(moves: int, *, rows: int, batch: int, dim: int, seed: int, wave_rows: Optional[int] = None) -> SoakReport:
    """``wave_rows``: moves in waves of so many rows, each kill at a step of the first, second or third wave (drawn);
    None: the default waves (one at the soak's sizes), each kill in the first."""
    draw = random.Random(seed)
    victims = [VICTIMS[i % len(VICTIMS)] for i in range(moves)]  # each victim in turn, shuffled
    draw.shuffle(victims)
    report = SoakReport()
    version = 0  # the cluster's map version between moves (each wave adopts the next)
    wal = tempfile.mkdtemp(prefix="elastic-soak-wal-")
    began = time.monotonic()
    tables = [TableConfig("counts", dim, optimizer=SGD(lr=1.0), init=Constant(0.0)),
              TableConfig("weights", dim, optimizer=Adam(lr=0.01)),
              TableConfig("side", 4, optimizer=SGD(lr=1.0), init=Constant(0.0))]
    model = ShardStore(0, 1, seed=0)
    model.configure(tables[1])
    try:
        with LocalShards(2, overrides=["seed=0", "durability=log", f"wal_dir={wal}"],
                         restart=True, max_restarts=moves + 5) as shards:
            with PSClient(shards.addresses) as client:
                client.wait_healthy(120)
                client.configure(tables)
                client.lookup({"side": torch.arange(SIDE_IDS)}, train=True)  # an update writes only rows looked up
                for start in range(0, rows, 1 << 16):
                    ids = torch.arange(start, min(rows, start + (1 << 16)))
                    client.lookup({"counts": ids, "weights": ids}, train=True)
                    model.lookup("weights", ids, train=True)
            trainer = MainTrainer(shards.addresses, rows, batch, dim, model)
            trainer.start()
            side = SideTrainer()
            for number in range(moves):
                to_shards = 3 if shards.num_shards == 2 else 2
                move = Move(to_shards, victims[number], draw.choice(STEPS))
                if wave_rows is not None:
                    move.wave = draw.randint(1, 3)
                started = time.monotonic()
                current = list(shards.addresses)
                if to_shards == 3:
                    shutil.rmtree(wal_directory(wal, 2, 3), ignore_errors=True)  # a drained shard's log is of its old role
                    addresses = shards.grow(3)
                    sources, takers = [0, 1], [2]
                else:
                    addresses = current[:2]
                    sources, takers = [2], [0, 1]
                side.start(current)

                def kill(coordinator: subprocess.Popen) -> None:
                    if move.victim == "coordinator":
                        coordinator.send_signal(signal.SIGKILL)
                    elif move.victim == "trainer":
                        side.kill()
                    else:
                        shard = draw.choice(sources if move.victim == "source" else takers)
                        shards.processes[shard].send_signal(signal.SIGKILL)

                waves = ScaleSettings.wave_rows if wave_rows is None else wave_rows
                move.killed, done = _coordinate(current, addresses, move.step, kill, waves, move.wave)
                report.kills += move.killed
                while done is None:  # failed or killed: `ps scale` again (its calls wait for a restarted shard)
                    _, done = _coordinate(current, addresses, None, kill, waves)
                    move.attempts += 1
                    if move.attempts == 2 and done is not None:
                        move.attempt_rolled_back = killed_wave_given_up(done, version, move.wave)
                    if move.attempts > 4:
                        break
                side.stop()
                if done is not None:
                    version = done["map_version"]
                with PSClient(addresses) as admin:
                    # a shard killed after its part of the move (a taker at FINISH) may still be restarting once the
                    # coordinator is done
                    admin.wait_healthy(120)
                    versions = {admin.shard_map_of(s)[0].num_shards for s in range(to_shards)}
                    move.ended_on_new_map = done is not None and versions == {to_shards}
                    if to_shards == 2:
                        admin.reach(current)
                        wait_drained(admin, [2], quiet_s=1.0)
                if to_shards == 2:
                    shards.shrink(2)
                report.attempts_rolled_back += move.attempt_rolled_back
                report.rollbacks += not move.ended_on_new_map
                move.seconds = time.monotonic() - started
                report.moves.append(move)
                print(f"move {number + 1}: -> {to_shards} shards, {move.victim} killed at {move.step!r}: "
                      f"{'went through' if move.ended_on_new_map else 'ROLLED BACK'} after {move.attempts} run(s)"
                      f"{' (the killed one given up)' if move.attempt_rolled_back else ''}, {move.seconds:.1f} s", flush=True)
                if trainer.error is not None:
                    raise RuntimeError(f"the trainer failed: {trainer.error!r}")
            trainer.stopping.set()
            trainer.join(120)
            if trainer.error is not None:
                raise RuntimeError(f"the trainer failed: {trainer.error!r}")
            report.steps = trainer.steps
            with PSClient(shards.addresses) as client:
                for start in range(0, rows, 1 << 16):
                    ids = torch.arange(start, min(rows, start + (1 << 16)))
                    found = client.lookup({"counts": ids, "weights": ids}, train=False, wire_dtype="fp32")
                    held = found["counts"][:, 0].round().long()
                    report.lost_updates += int((trainer.counts[ids] - held).clamp(min=0).sum())
                    report.applied_twice += int((held - trainer.counts[ids]).clamp(min=0).sum())
                    equal = torch.equal(found["weights"], model.lookup("weights", ids, train=False))
                    report.weights_equal = equal if start == 0 else report.weights_equal and equal
                sides = client.lookup({"side": torch.arange(SIDE_IDS)}, train=False, wire_dtype="fp32")["side"][:, 0].round().long()
                report.lost_updates += int((side.acknowledged - sides).clamp(min=0).sum())
                report.applied_twice += int((sides - side.acknowledged - side.incarnations).clamp(min=0).sum())
    finally:
        shutil.rmtree(wal, ignore_errors=True)
    report.seconds = time.monotonic() - began
    return report


def summary(report: SoakReport) -> dict:
    """The soak's figures for the bench's JSON line."""
    return {"kills": report.kills, "lost_updates": report.lost_updates, "rollbacks": report.rollbacks,
            "attempts_rolled_back": report.attempts_rolled_back, "applied_twice": report.applied_twice,
            "weights_equal": report.weights_equal, "moves": len(report.moves), "steps": report.steps,
            "soak_s": report.seconds, "kill_points": [asdict(move) for move in report.moves]}
