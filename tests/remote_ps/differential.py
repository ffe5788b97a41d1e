"""A differential test of shards under kills: a random stream of operations against real shard processes with a
write-ahead log, and the same stream, as far as it was acknowledged, against a plain in-memory model.

The stream (one seed makes it): training lookups of a table's ids, each often followed by the update of its
rows; updates of ids looked up long ago (their rows demoted since); evaluation lookups of seen and unseen ids;
tables created; saves; loads of an earlier save; re-shards to another shard count through a save. Meanwhile a
killer sends SIGKILL to a random shard at random moments: inside lookups and updates, between a log write and its
answer (the shards wait ``fault_ack_delay_s`` there), inside saves, and inside the replay of a shard just restarted
(its replay slowed by ``fault_replay_delay_s``). The supervisor restarts it; the client retries.

The model is a :class:`ShardStore` in this process with the same tables held in memory without limits and no log,
told only what the shards acknowledged. Every answer is compared with the model's bit for bit, and every row of
every table at intervals and at the end. A disk table's memory budget is a fraction of the ids a shard holds, so
that nearly every request promotes and demotes. Any difference, a rollback (a restarted shard that did not trust
its log) or an error ends the run with the seed that reproduces the stream.

    .venv/bin/python -m tests.remote_ps.differential --minutes 60        # the long form: seeds 1, 2, ... one after another
    .venv/bin/python -m tests.remote_ps.differential --minutes 20 --first-seed 101   # other seeds
    .venv/bin/python -m tests.remote_ps.differential --seed 17 --ops 400  # one seed again
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from lightning_persia.remote_ps.client import PSClient, RetryPolicy
from lightning_persia.remote_ps.client.errors import ShardRestartedError
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.table_config import SGD, Adagrad, TableConfig

SEED = 11  # the shards' and the model's: first rows come from (seed, table, id)
IDS = 1500  # ids a table draws from
REQUEST = 96  # ids a request names at most (a shard's share stays within a disk table's budget)
BUDGET = 128  # rows a disk table keeps in memory a shard


@dataclass
class Scenario:
    """One run: the stream's ``seed``, the tables' ``storage``, the log's ``durability``, how many ``ops``, and
    the mean seconds between kills (``kill_every_s``; 0: none)."""

    seed: int
    storage: str = "disk"
    durability: str = "log"
    ops: int = 200
    kill_every_s: float = 4.0
    shards: int = 2

    @property
    def command(self) -> str:
        return (f"python -m tests.remote_ps.differential --seed {self.seed} --storage {self.storage} --durability "
                f"{self.durability} --ops {self.ops} --kill-every-s {self.kill_every_s}")


@dataclass
class Report:
    """What a run did and compared."""

    ops: int = 0
    kills: int = 0
    restarts: int = 0
    answers_compared: int = 0
    rows_compared: int = 0
    saves: int = 0
    loads: int = 0
    reshards: int = 0
    rollbacks: int = 0
    differences: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"ops {self.ops}, kills {self.kills}, restarts {self.restarts}, saves {self.saves}, loads {self.loads}, "
                f"re-shards {self.reshards}, answers compared {self.answers_compared}, rows compared {self.rows_compared}, "
                f"rollbacks {self.rollbacks}, rows differing {len(self.differences)}")


class Difference(AssertionError):
    """The shards and the model disagree; the message names the seed."""


class _Cluster:
    """The shards of one shard count, their client, and a killer that SIGKILLs one of them at random moments."""

    def __init__(self, root: Path, generation: int, scenario: Scenario, num_shards: int, restore_from: Optional[str],
                 report: Report, rng: random.Random) -> None:
        overrides = [f"seed={SEED}", f"durability={scenario.durability}", f"wal_dir={root / f'wal-{generation}'}",
                     f"disk_dir={root / 'disk'}", "fault_ack_delay_s=0.003", "fault_replay_delay_s=0.002"]
        self.shards = LocalShards(num_shards, overrides=overrides, restart=True, max_restarts=10_000,
                                  restore_from=restore_from, poll_s=0.05)
        self.client = PSClient(self.shards.addresses,
                               retry=RetryPolicy(timeout_s=20, retry_for_s=300, backoff_s=0.05, max_backoff_s=0.5))
        self.client.wait_healthy(120)
        self._report, self._rng = report, random.Random(rng.random())
        self._mean_s = scenario.kill_every_s
        self._stop = threading.Event()
        self._killer = threading.Thread(target=self._kill_at_random, name="differential-killer", daemon=True)
        if self._mean_s > 0:
            self._killer.start()

    def _kill_at_random(self) -> None:
        """Kills a shard after a random wait, sometimes kills it again while it restarts (it imports, then replays
        its log), and waits for it to serve again before the next wait."""
        while not self._stop.wait(self._rng.expovariate(1.0 / self._mean_s)):
            index = self._rng.randrange(self.shards.num_shards)
            restarts = self._restarts()
            self._kill(index)
            if self._rng.random() < 0.3 and not self._stop.wait(self._rng.uniform(1.0, 8.0)) and self._restarts() == restarts:
                self._kill(index)
            while not self._stop.is_set() and self._restarts() == restarts:
                time.sleep(0.05)

    def kill_one(self) -> None:
        """SIGKILLs a random shard now (the launcher restarts it; the next calls wait for it)."""
        self._kill(self._rng.randrange(self.shards.num_shards))

    def _restarts(self) -> int:
        return sum(e.kind == "restarted" for e in self.shards.events)

    def _kill(self, index: int) -> None:
        process = self.shards.processes[index]
        if process.poll() is None:
            try:
                os.kill(process.pid, signal.SIGKILL)
                self._report.kills += 1
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self._stop.set()
        if self._killer.is_alive():
            self._killer.join()
        self._report.restarts += sum(e.kind == "restarted" for e in self.shards.events)
        gave_up = [e for e in self.shards.events if e.kind == "gave_up"]
        self.client.close()
        self.shards.stop()
        if gave_up:
            raise RuntimeError(f"a shard did not come back: {gave_up[0].detail}")


class Differential:
    """Runs one :class:`Scenario` under ``root`` (its shards' logs, disk tiers and checkpoints)."""

    def __init__(self, root: Path, scenario: Scenario) -> None:
        self.root, self.scenario = root, scenario
        self.report = Report()
        self._rng = random.Random(scenario.seed)
        self._torch = torch.Generator().manual_seed(scenario.seed)
        self._model = ShardStore(0, 1, seed=SEED, demotion_interval_s=None, expiry_interval_s=3600.0)
        self._tables: dict[str, TableConfig] = {}
        self._looked_up: dict[str, list[torch.Tensor]] = {}
        self._saves: list[tuple[str, str, list[str]]] = []  # (shards' checkpoint, model's, tables then)
        self._trace: list[str] = []
        self._generation = 0
        self._save_attempts = 0
        self._tables_made = 0
        self._cluster: Optional[_Cluster] = None

    def run(self) -> Report:
        self._cluster = _Cluster(self.root, 0, self.scenario, self.scenario.shards, None, self.report, self._rng)
        try:
            for _ in range(2):
                self._create_table()
            for number in range(self.scenario.ops):
                if number == self.scenario.ops // 2 and not self.report.kills and self.scenario.kill_every_s > 0:
                    self._cluster.kill_one()  # a stream faster than the killer's waits still sees a kill
                self._step()
                self.report.ops += 1
                if number % 25 == 24:
                    self._compare_everything()
            self._compare_everything()
        except Exception as err:
            err.add_note(self._what_the_shards_said())
            raise
        finally:
            self._cluster.close()
        return self.report

    def _what_the_shards_said(self) -> str:
        """The warnings and errors in the shards' output, and the last operations: what a failing seed needs."""
        lines = [f"last operations: {', '.join(self._trace[-12:])}"]
        for index in range(self._cluster.shards.num_shards):
            lines += [f"shard {index}: {line}" for line in self._cluster.shards.output(index).splitlines()
                      if " WARNING " in line or " ERROR " in line or "not used" in line]
        return "\n".join(lines)

    # ---- the stream ----------------------------------------------------------------------------------

    def _step(self) -> None:
        draw = self._rng.random()
        name = self._rng.choice(sorted(self._tables))
        if draw < 0.40:
            ids = self._lookup(name, train=True)
            if self._rng.random() < 0.85:
                self._update(name, ids)
        elif draw < 0.55:
            stale = self._looked_up[name][: max(1, len(self._looked_up[name]) // 2)]
            if stale:
                self._update(name, self._rng.choice(stale))  # rows demoted since, their recency stale
        elif draw < 0.75:
            self._lookup(name, train=False)
        elif draw < 0.80:
            self._create_table()
        elif draw < 0.90:
            self._save()
        elif draw < 0.97:
            self._load()
        else:
            self._reshard()

    def _ids(self) -> torch.Tensor:
        hot = torch.randint(0, IDS // 10, (REQUEST // 2,), generator=self._torch)  # a hot tenth, and the rest
        cold = torch.randint(0, IDS, (self._rng.randint(1, REQUEST // 2),), generator=self._torch)
        return torch.unique(torch.cat([hot, cold]))[: REQUEST]

    def _lookup(self, name: str, train: bool) -> torch.Tensor:
        self._trace.append(f"{'train' if train else 'eval'} {name}")
        ids = self._ids()
        got = self._call(lambda c: c.lookup({name: ids}, train=train, wire_dtype="fp32")[name])
        expected = self._model.lookup(name, ids, train=train)
        self._same(f"{'training' if train else 'evaluation'} lookup of {name!r}", ids, got, expected)
        self.report.answers_compared += ids.numel()
        if train:
            self._looked_up[name].append(ids)
        return ids

    def _update(self, name: str, ids: torch.Tensor) -> None:
        self._trace.append(f"update {name}")
        grads = torch.randn(ids.numel(), self._tables[name].dim, generator=self._torch)
        self._call(lambda c: c.update({name: (ids, grads)}, wire_dtype="fp32"))
        self._model.update(name, ids, grads)

    def _create_table(self) -> None:
        number = self._tables_made  # never a name in use: a load keeps the tables of its checkpoint, not the last ones
        self._tables_made += 1
        optimizer = self._rng.choice([SGD(lr=0.5), Adagrad(lr=0.3, rowwise=True), Adagrad(lr=0.2)])
        disk = self.scenario.storage == "disk"
        config = TableConfig(f"t{number}", self._rng.choice([4, 8]), optimizer=optimizer, storage="disk" if disk else "memory",
                             capacity=BUDGET if disk else 1 << 20)
        self._trace.append(f"create {config.name} (dim {config.dim})")
        self._call(lambda c: c.configure([config]), admin=True)
        self._model.configure(TableConfig(config.name, config.dim, optimizer=optimizer, capacity=1 << 20))
        self._tables[config.name] = config
        self._looked_up[config.name] = []

    def _new_folder(self, kind: str) -> Path:
        """A folder of its own for each save: one that failed on a shard may be whole on another."""
        self._save_attempts += 1
        return self.root / f"{kind}-{self._save_attempts}"

    def _save_whole(self, kind: str) -> Path:
        """A save retried into a new folder until one completes."""
        for _ in range(20):
            folder = self._new_folder(kind)
            try:
                self._call(lambda c: c.save(folder))
                return folder
            except Difference:
                raise
            except Exception:  # noqa: BLE001 - a kill during the save
                time.sleep(0.2)
        raise RuntimeError("20 saves in a row failed")

    def _save(self) -> None:
        shards = self._new_folder("save")
        model = self.root / f"model-{shards.name}"
        try:
            self._call(lambda c: c.save(shards))
        except Difference:
            raise
        except Exception:  # noqa: BLE001 - a kill during the save: no checkpoint, the log still holds everything
            return
        self._trace.append(f"saved {shards.name}")
        self._model.save(str(model))
        self._saves.append((str(shards), str(model), sorted(self._tables)))
        self._cluster.shards.restore_from = str(shards)
        self.report.saves += 1

    def _load(self) -> None:
        if not self._saves:
            return
        shards, model, tables = self._rng.choice(self._saves)
        self._trace.append(f"load {Path(shards).name}")
        self._call(lambda c: c.load(shards), admin=True)
        self._model.load(model)
        self._tables = {name: config for name, config in self._tables.items() if name in tables}
        self._looked_up = {name: [] for name in self._tables}
        self.report.loads += 1

    def _reshard(self) -> None:
        count = self._rng.choice([n for n in (1, 2, 3) if n != self._cluster.shards.num_shards])
        folder = self._save_whole("reshard")
        self._trace.append(f"reshard to {count} through {folder.name}")
        self._cluster.close()
        self._generation += 1
        self._cluster = _Cluster(self.root, self._generation, self.scenario, count, str(folder), self.report, self._rng)
        self._call(lambda c: c.load(folder), admin=True)  # a restart restores from it too, the first start does not
        self.report.reshards += 1

    # ---- calls and comparisons ---------------------------------------------------------------------

    def _call(self, call, admin: bool = False):
        """``call(client)``; an ``admin`` one (configure, save, load: the client does not retry them) retried while
        kills make it fail. A rollback is a finding, not a retry."""
        for attempt in range(20):
            try:
                return call(self._cluster.client)
            except ShardRestartedError as err:
                self.report.rollbacks += 1
                raise Difference(f"seed {self.scenario.seed}: a restarted shard refused the client (a rollback): {err}") from None
            except Exception:  # noqa: BLE001 - save/load/configure are not retried by the client
                if not admin or attempt == 19:
                    raise
                time.sleep(0.2)
        raise AssertionError("unreachable")

    def _same(self, what: str, ids: torch.Tensor, got: torch.Tensor, expected: torch.Tensor) -> None:
        if torch.equal(got, expected):
            return
        rows = torch.nonzero((got != expected).any(dim=1)).squeeze(1)
        for row in rows[:5].tolist():
            self.report.differences.append(f"{what}: id {int(ids[row])}: shards {got[row].tolist()} model {expected[row].tolist()}")
        raise Difference(f"seed {self.scenario.seed} ({self.scenario.command}): {rows.numel()} of {ids.numel()} rows "
                         f"differ in the {what} at op {self.report.ops}; first: {self.report.differences[0]}")

    def _compare_everything(self) -> None:
        everything = torch.arange(IDS)
        for name in sorted(self._tables):
            got = self._call(lambda c: c.lookup({name: everything}, train=False, wire_dtype="fp32")[name])
            self._same(f"comparison of every row of {name!r}", everything, got, self._model.lookup(name, everything, train=False))
            self.report.rows_compared += IDS


def run_scenario(scenario: Scenario, root: Optional[Path] = None) -> Report:
    """Runs ``scenario`` in ``root`` (a temporary folder by default, deleted after a run that passed)."""
    own = root is None
    root = Path(tempfile.mkdtemp(prefix=f"persia-differential-{scenario.seed}-")) if own else root
    report = Differential(root, scenario).run()
    if own:
        shutil.rmtree(root, ignore_errors=True)
    return report


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="one seed (default: seeds 1, 2, ... until --minutes)")
    parser.add_argument("--minutes", type=float, default=0.0, help="run seeds one after another this long")
    parser.add_argument("--first-seed", type=int, default=1, help="the first of the seeds run one after another")
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--storage", choices=["disk", "memory"], default=None, help="default: alternate")
    parser.add_argument("--durability", choices=["log", "fsync"], default=None, help="default: alternate")
    parser.add_argument("--kill-every-s", type=float, default=3.0)
    args = parser.parse_args()
    deadline = time.monotonic() + 60 * args.minutes
    seed = args.seed if args.seed is not None else args.first_seed
    totals = Report()
    runs = 0
    while True:
        combo = [("disk", "log"), ("memory", "fsync"), ("disk", "fsync"), ("memory", "log")][seed % 4]
        scenario = Scenario(seed, storage=args.storage or combo[0], durability=args.durability or combo[1], ops=args.ops,
                            kill_every_s=args.kill_every_s)
        started = time.monotonic()
        try:
            report = run_scenario(scenario)
        except Exception as err:  # noqa: BLE001 - print the seed that reproduces it
            notes = "\n".join(getattr(err, "__notes__", []))
            print(f"FAILED seed {seed}: {type(err).__name__}: {err}\n{notes}\n  rerun: {scenario.command}", flush=True)
            return 1
        runs += 1
        for name in ("ops", "kills", "restarts", "answers_compared", "rows_compared", "saves", "loads", "reshards", "rollbacks"):
            setattr(totals, name, getattr(totals, name) + getattr(report, name))
        print(f"seed {seed} ({scenario.storage}, {scenario.durability}) passed in {time.monotonic() - started:.0f} s: "
              f"{report.line()}", flush=True)
        if args.seed is not None or time.monotonic() >= deadline:
            break
        seed += 1
    print(f"all {runs} seeds passed: {totals.line()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
