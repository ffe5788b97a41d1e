"""Shards added and drained while a client trains on large tables: the pause a step sees, the throughput during a
move, the rows moved against the ideal, and no update lost or applied twice.

A client trains one table (SGD, lr 1, every gradient -1, rows starting at 0) on real shard processes: each step
looks a batch of ids up and updates them, so a row's value is the number of updates it got. The table is first
filled to ``--rows`` rows. Then the cluster moves 2 -> 3 shards while the client trains, and 3 -> 2 (``rescale``),
and every row is compared with the updates counted on the client.

A move's samples/s are rated against the steady rate on either side of it: ``--steady-steps`` steps with nothing
moving are timed before the grow, between the moves and after the drain, each window's time over its steps (as a
move's own rate is counted), and a move's steady rate is the mean of its two windows' (a 2 -> 3 move ends at three
shards, whose steady rate differs). Its ratios to either window alone are reported too.

    python -m benchmarks.cluster.elastic_bench --json                 # 20M rows
    python -m benchmarks.cluster.elastic_bench --rows 2000000 --json  # a first look
    python -m benchmarks.cluster.elastic_bench --kill-soak 10 --rows 100000 --batch 2048 --json
    python -m benchmarks.cluster.elastic_bench --storage disk --rows 2000000 --json   # most rows on disk
    python -m benchmarks.cluster.elastic_bench --idle --copy-share 1 --json            # the moves' own CPU

``--storage disk`` makes the table a disk table whose shards keep ``--memory-rows`` rows each in memory (an eighth
of the rows by default), the others on disk (a temporary folder), and fills it ``--memory-rows`` ids a request.

``--idle`` moves the filled table 2 -> 3 -> 2 with no client training: each process's CPU seconds are then the
move's alone (on a machine that training keeps busy, the trainer loses about a second for each of them).

``--kill-soak N`` runs N moves with a process killed at a random point of each instead (``elastic_soak.py``): its
line carries ``kills``, ``lost_updates``, ``rollbacks`` and ``weights_equal``; the timed moves' line carries none
of them (no kill, and ``lost_updates``: rows that differ from the updates sent).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time

import torch

from benchmarks.cluster import elastic_soak
from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.client.scaling import ScaleSettings, rescale_apart
from lightning_persia.remote_ps.config import PSConfig
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.table_config import SGD, Constant, TableConfig

TABLE = "items"


class Trainer:
    """Steps of lookup + update of a random batch, timed; counts each id's updates."""

    def __init__(self, client: PSClient, rows: int, batch: int, dim: int) -> None:
        self.client, self.rows, self.batch, self.dim = client, rows, batch, dim
        self.updates = torch.zeros(rows, dtype=torch.int32)
        self.steps: list[tuple[float, float]] = []  # (end time, seconds)
        self._generator = torch.Generator().manual_seed(0)

    def step(self) -> None:
        began = time.monotonic()
        ids = torch.randint(0, self.rows, (self.batch,), generator=self._generator).unique()
        self.client.lookup({TABLE: ids}, train=True)
        self.client.update({TABLE: (ids, -torch.ones(ids.numel(), self.dim))}, wire_dtype="fp32")
        self.updates[ids] += 1
        end = time.monotonic()
        self.steps.append((end, end - began))

    def run_while(self, busy: threading.Thread) -> tuple[float, float]:
        """Steps until ``busy`` ends (at least one); returns the window's (start, end)."""
        began = time.monotonic()
        busy.start()
        self.step()
        while busy.is_alive():
            self.step()
        return began, time.monotonic()


def _fill(client: PSClient, rows: int, chunk: int) -> float:
    began = time.monotonic()
    for start in range(0, rows, chunk):
        client.lookup({TABLE: torch.arange(start, min(rows, start + chunk))}, train=True)
    return time.monotonic() - began


def _window(trainer: Trainer, start: float, end: float) -> list[float]:
    return [seconds for finished, seconds in trainer.steps if start <= finished <= end]


def _steady(trainer: Trainer, steps: int) -> tuple[float, list[float]]:
    """Seconds a step over ``steps`` steps with nothing moving, the window's time over its steps as the move's
    throughput is counted (a median would leave out the slow steps any window has); and each step's seconds."""
    for _ in range(5):  # the first steps after a move or the fill (a client hearing a new map, a shard warming up)
        trainer.step()
    began = time.monotonic()
    for _ in range(steps):
        trainer.step()
    return (time.monotonic() - began) / steps, [seconds for _, seconds in trainer.steps[-steps:]]


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has spent (Linux's ``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _move(trainer: Trainer, current: list[str], addresses: list[str], settings: ScaleSettings, shard_pids: list[int],
          serving_cpu_s: float) -> dict:
    """One move while the trainer steps; with the CPU seconds each shard (``shard_pids``, by index), the coordinator
    and this process (the trainer and its client) spent during it: on a machine others load too, CPU seconds say what
    a move costs where wall-clock ratios vary with the load. ``serving_cpu_s``: the shards' CPU seconds a step took
    before the moves; the shards' CPU beyond that many a step during the move is the move's (``move_shard_cpu_s``).
    The ratios and the time lost are :func:`_rated` once the steady steps after the move are known."""
    result: dict = {}

    def move() -> None:  # the coordinator in a process of its own, as `ps scale` runs it
        result["report"] = rescale_apart(current, addresses, settings)

    shards_before, own_before = [_cpu_seconds(pid) for pid in shard_pids], os.times()
    start, end = trainer.run_while(threading.Thread(target=move))
    shards_after, own_after = [_cpu_seconds(pid) for pid in shard_pids], os.times()
    during = _window(trainer, start, end)
    report = result["report"]
    # a grow's slots come from the shards there were, a drain's from those it stops
    giving = range(report.from_shards) if report.to_shards > report.from_shards else range(report.to_shards, report.from_shards)
    shard_cpu = [after - before for before, after in zip(shards_before, shards_after)]
    return {"from": report.from_shards, "to": report.to_shards, "seconds": report.seconds, "fenced_s": report.fenced_seconds,
            "rows_moved": report.rows_moved, "changed_rows": report.changed_rows, "rounds": report.rounds,
            "waves": report.waves, "paced_s": report.paced_seconds,
            "steps_during": len(during), "step_s_during": (end - start) / len(during), "max_step_s": max(during),
            "during": during,
            "move_rows_per_s": report.rows_moved / max(report.seconds, 1e-9),
            "shard_cpu_s": shard_cpu, "giving_cpu_s": sum(shard_cpu[shard] for shard in giving),
            "move_shard_cpu_s": sum(shard_cpu) - len(during) * serving_cpu_s,
            "coordinator_cpu_s": own_after.children_user + own_after.children_system - own_before.children_user - own_before.children_system,
            "trainer_cpu_s": own_after.user + own_after.system - own_before.user - own_before.system,
            "load_at_end": os.getloadavg()[0]}


def _rated(move: dict, before_s: float, after_s: float, median_s: float) -> dict:
    """``move`` with its throughput against the steady steps on either side of it (``before_s``, ``after_s``: seconds
    a step), and its steps against the run's median step (``median_s``)."""
    during = move.pop("during")
    steady_s = 2 / (1 / before_s + 1 / after_s)  # the mean of the two windows' samples/s, as seconds a step
    return {**move, "steady_before_s": before_s, "steady_after_s": after_s,
            "throughput_ratio_during": steady_s / move["step_s_during"],
            "throughput_ratio_vs_before": before_s / move["step_s_during"],
            "throughput_ratio_vs_after": after_s / move["step_s_during"],
            "max_extra_step_s": move["max_step_s"] - median_s,
            # the trainer's time lost to the move, and the part of it in steps over 3x the steady one (each such
            # step waited on a fenced wave, or was sent again to a new owner)
            "lost_s": len(during) * (move["step_s_during"] - steady_s),
            "stalled_s": sum(seconds - steady_s for seconds in during if seconds > 3 * steady_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000_000, help="rows of the table before the moves")
    parser.add_argument("--batch", type=int, default=65_536, help="ids a step looks up and updates")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steady-steps", type=int, default=100,
                        help="steps timed with nothing moving, before, between and after the moves: a move's steady "
                             "rate is the mean of the windows on either side of it (25-step windows of one run "
                             "ranged from 34 to 44 ms a step)")
    parser.add_argument("--kill-soak", type=int, default=0, metavar="MOVES",
                        help="instead: MOVES moves (2 -> 3 and 3 -> 2 in turn), a process killed at a random point of each")
    parser.add_argument("--seed", type=int, default=0, help="--kill-soak: which kills, where")
    parser.add_argument("--storage", choices=("memory", "disk"), default="memory", help="the table's storage")
    parser.add_argument("--memory-rows", type=int, default=0,
                        help="--storage disk: rows a shard keeps in memory (its capacity; default: an eighth of --rows)")
    parser.add_argument("--wave-rows", type=int, help=f"rows a wave of a move carries (default {ScaleSettings.wave_rows:,}; "
                        "with --kill-soak, each kill lands in the first, second or third wave)")
    parser.add_argument("--copy-share", type=float, default=ScaleSettings.copy_share,
                        help="share of the coordinator's time spent copying while unfenced")
    parser.add_argument("--move-nice", type=int, default=PSConfig.move_nice,
                        help="the shards' nice value for a move's pages (PSConfig.move_nice; 0: the requests' priority)")
    parser.add_argument("--idle", action="store_true", help="move with no client training: the CPU seconds of each "
                        "shard and of the coordinator are then the move's alone")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args()
    if args.kill_soak:
        _kill_soak(args)
        return

    config = TableConfig(TABLE, args.dim, optimizer=SGD(lr=1.0), init=Constant(0.0))
    overrides, fill_chunk = ["seed=0", "durability=none", f"move_nice={args.move_nice}"], 1 << 20
    folder = tempfile.TemporaryDirectory(prefix="elastic-bench-tiers-")
    if args.storage == "disk":
        memory_rows = args.memory_rows or max(args.rows // 8, 2 * args.batch)
        if args.batch > memory_rows:
            parser.error(f"--batch {args.batch} is more than a disk table's --memory-rows {memory_rows}: a shard refuses it")
        config = TableConfig(TABLE, args.dim, optimizer=SGD(lr=1.0), init=Constant(0.0), capacity=memory_rows, storage="disk")
        overrides.append(f"disk_dir={folder.name}")
        fill_chunk = memory_rows  # a request of a disk table fits in a shard's memory budget
    with folder, LocalShards(2, overrides=overrides) as shards:
        client = PSClient(shards.addresses)
        client.wait_healthy(120)
        client.configure([config])
        fill_s = _fill(client, args.rows, fill_chunk)
        settings = ScaleSettings(wave_rows=args.wave_rows or ScaleSettings.wave_rows, copy_share=args.copy_share)
        if args.idle:
            _idle_moves(shards, settings, args)
            client.close()
            return
        trainer = Trainer(client, args.rows, args.batch, args.dim)
        serving_before = [_cpu_seconds(process.pid) for process in shards.processes]
        windows = [_steady(trainer, args.steady_steps)]
        serving_cpu_s = sum(_cpu_seconds(process.pid) - before for process, before
                            in zip(shards.processes, serving_before)) / (args.steady_steps + 5)
        grow = _move(trainer, shards.addresses[:2], shards.grow(3), settings,
                     [process.pid for process in shards.processes], serving_cpu_s)
        windows.append(_steady(trainer, args.steady_steps))
        shrink = _move(trainer, shards.addresses, shards.addresses[:2], settings,
                       [process.pid for process in shards.processes], serving_cpu_s)
        shards.shrink(2)
        windows.append(_steady(trainer, args.steady_steps))
        steady = [seconds for seconds, _ in windows]
        median_s = statistics.median(seconds for _, steps in windows for seconds in steps)  # the run's median step
        grow, shrink = _rated(grow, steady[0], steady[1], median_s), _rated(shrink, steady[1], steady[2], median_s)
        lost = 0
        for start in range(0, args.rows, 1 << 20):
            ids = torch.arange(start, min(args.rows, start + (1 << 20)))
            rows = client.lookup({TABLE: ids}, train=False, wire_dtype="fp32")[TABLE]
            lost += int((rows[:, 0] != trainer.updates[ids].float()).sum())
        client.close()
    ideal = args.rows / 3
    summary = {
        "rows": args.rows, "batch": args.batch, "dim": args.dim, "storage": args.storage,
        "memory_rows": config.capacity if args.storage == "disk" else None, "wave_rows": settings.wave_rows,
        "copy_share": args.copy_share, "move_nice": args.move_nice, "fill_s": fill_s, "steady_step_s": steady,
        "median_step_s": median_s, "serving_cpu_s_per_step": serving_cpu_s,
        "grow": grow, "shrink": shrink,
        "max_extra_step_s": max(grow["max_extra_step_s"], shrink["max_extra_step_s"]),
        "throughput_ratio_during": min(grow["throughput_ratio_during"], shrink["throughput_ratio_during"]),
        "rows_moved_ratio": max(grow["rows_moved"], shrink["rows_moved"]) / ideal,
        "seconds_per_100M_rows": 1e8 / min(grow["move_rows_per_s"], shrink["move_rows_per_s"]),
        "lost_updates": lost,
        "load": os.getloadavg()[0],
    }
    for name in ("grow", "shrink"):
        move = summary[name]
        print(f"{move['from']} -> {move['to']} shards: {move['rows_moved']:,} rows in {move['seconds']:.1f} s "
              f"({move['move_rows_per_s']:,.0f} rows/s), {move['waves']} waves, {move['rounds']} rounds, "
              f"{move['changed_rows']:,} changed rows, paced {move['paced_s']:.1f} s, longest fenced {move['fenced_s'] * 1e3:.0f} ms; "
              f"steps during: {move['steps_during']}, longest {move['max_step_s']:.2f} s (median {median_s:.3f} s), "
              f"{move['step_s_during'] * 1e3:.1f} ms a step against {move['steady_before_s'] * 1e3:.1f} before and "
              f"{move['steady_after_s'] * 1e3:.1f} after: throughput {move['throughput_ratio_during']:.2f}x "
              f"({move['throughput_ratio_vs_before']:.2f}x / {move['throughput_ratio_vs_after']:.2f}x), "
              f"lost {move['lost_s']:.1f} s of which "
              f"{move['stalled_s']:.1f} s in steps over 3x steady; CPU: the move's in the shards {move['move_shard_cpu_s']:.1f} s, "
              f"giving shards {move['giving_cpu_s']:.1f} s "
              f"(every shard {', '.join(f'{s:.1f}' for s in move['shard_cpu_s'])}), coordinator "
              f"{move['coordinator_cpu_s']:.1f} s, trainer {move['trainer_cpu_s']:.1f} s")
    print(f"rows moved / ideal: {summary['rows_moved_ratio']:.3f}; 100M rows would take "
          f"{summary['seconds_per_100M_rows']:.0f} s; rows differing from the updates sent: {lost}")
    if args.json:
        print(json.dumps(summary))


def _idle_moves(shards: LocalShards, settings: ScaleSettings, args: argparse.Namespace) -> None:
    """2 -> 3 -> 2 with nothing training: each shard's CPU seconds, and the coordinator's, per move."""
    moves = {}
    for name in ("grow", "shrink"):
        current = shards.addresses[:2] if name == "grow" else list(shards.addresses)
        addresses = shards.grow(3) if name == "grow" else shards.addresses[:2]
        pids = [process.pid for process in shards.processes]
        before, own = [_cpu_seconds(pid) for pid in pids], os.times()
        report = rescale_apart(current, addresses, settings)
        after = os.times()
        moves[name] = {"seconds": report.seconds, "rows_moved": report.rows_moved, "fenced_s": report.fenced_seconds,
                       "shard_cpu_s": [_cpu_seconds(pid) - cpu for pid, cpu in zip(pids, before)],
                       "coordinator_cpu_s": after.children_user + after.children_system - own.children_user - own.children_system}
    shards.shrink(2)
    for name, move in moves.items():
        print(f"{name}: {move['rows_moved']:,} rows in {move['seconds']:.1f} s; CPU: shards "
              f"{', '.join(f'{s:.2f}' for s in move['shard_cpu_s'])} s, coordinator {move['coordinator_cpu_s']:.2f} s "
              f"(in all {sum(move['shard_cpu_s']) + move['coordinator_cpu_s']:.2f} s)")
    if args.json:
        print(json.dumps({"rows": args.rows, "dim": args.dim, "copy_share": settings.copy_share, "idle": True, **moves,
                          "load": os.getloadavg()[0]}))


def _kill_soak(args: argparse.Namespace) -> None:
    report = elastic_soak.soak(args.kill_soak, rows=args.rows, batch=args.batch, dim=args.dim, seed=args.seed,
                               wave_rows=args.wave_rows)
    summary = {"rows": args.rows, "batch": args.batch, "dim": args.dim, "seed": args.seed, "wave_rows": args.wave_rows,
               **elastic_soak.summary(report),
               "load": os.getloadavg()[0]}
    print(f"{summary['moves']} moves, {summary['kills']} kills ({summary['steps']} training steps, {summary['soak_s']:.0f} s): "
          f"{summary['rollbacks']} moves ended on the old map, {summary['attempts_rolled_back']} killed attempts given up "
          f"and run again; {summary['lost_updates']} acknowledged updates lost, {summary['applied_twice']} applied twice; "
          f"weights equal to the unscaled run: {summary['weights_equal']}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
