"""How many calls a request takes from the servicer down to each of the store's native kernels.

Every C function the store's binding modules declare is wrapped on the loaded library; each call records its Python
stack. The calls are counted from where the work enters the store: an RPC method of ``PSServicer`` (``Lookup``,
``Update``, ...), or a pass of a shard's background thread (the demoter's, the expirer's). ``Lookup`` ->
``ShardStore.lookup_many`` -> ``Table.lookup_together`` -> ``Table._probe`` -> ``jobs.find_many`` ->
``lp_find_many`` is 5 calls. A path "enters a file twice" where its frames leave a file and
come back to it later.

The workload runs in process, on one shard after the other (:data:`SCENARIOS`): a memory table at capacity
(eviction), a disk table under a memory limit with a demoter, as a shard process runs it (queued promotions,
demotions, mapping, compaction off the request path), and a disk table whose requests make their own room (no
demoter: demotions and promotions in the request). Each sees training and evaluation lookups of one and of two
tables, and updates, many times its memory budget of distinct ids.

    PYTHONPATH=$PWD .venv/bin/python -m tools.kernel_depths            # a table, a kernel a row
    PYTHONPATH=$PWD .venv/bin/python -m tools.kernel_depths --paths    # and the deepest path of each
    PYTHONPATH=$PWD .venv/bin/python -m tools.kernel_depths --json

Exit status 1 where a kernel is reached more than ``--limit`` calls deep (none by default).
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Callable, Optional

import torch

from lightning_persia.ops import wire
from lightning_persia.remote_ps.config import PSConfig
from lightning_persia.remote_ps.protocol import persia_pb2 as pb
from lightning_persia.remote_ps.servicer import PSServicer
from lightning_persia.remote_ps.store import ShardStore, native
from lightning_persia.remote_ps.store.background import stop_all
from lightning_persia.remote_ps.store.disk.mapped_budget import resident_bytes
from lightning_persia.remote_ps.store.native import disk_map, id_index, jobs, records, rows
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig

_BINDINGS = (disk_map, id_index, jobs, records, rows)
_SERVICER = "servicer.py"
_PASSES = {("demoter.py", "run_once"): "Demoter.run_once", ("expiry.py", "run_once"): "Expirer.run_once"}
_PACKAGE = "lightning_persia"


@dataclass
class KernelCalls:
    """The calls of one kernel from one entry: their depths, and the deepest one's path (``file:function`` each)."""

    depths: list[int] = field(default_factory=list)
    deepest: list[str] = field(default_factory=list)
    twice: set[str] = field(default_factory=set)

    def add(self, path: list[str]) -> None:
        self.depths.append(len(path))
        if len(path) > len(self.deepest):
            self.deepest = path
        self.twice |= entered_twice(path)


def entered_twice(path: list[str]) -> set[str]:
    """The files that ``path`` (``file:function`` from the entry down) leaves and comes back to."""
    runs = [file for file, _ in (step.split(":", 1) for step in path)]
    left, seen, previous = set(), set(), None
    for file in runs:
        if file != previous:
            if file in seen:
                left.add(file)
            seen.add(file)
        previous = file
    return left


class Recorder:
    """Wraps every kernel of the store's library; :attr:`calls` maps ``(scenario, entry, kernel)`` to
    :class:`KernelCalls`, ``scenario`` being what :attr:`scenario` says while the call runs."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str, str], KernelCalls] = collections.defaultdict(KernelCalls)
        self.scenario = ""
        self.unattributed: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._recording = threading.local()
        library = native.LIBRARY.require()
        for module in _BINDINGS:
            for name in module.SIGNATURES:
                setattr(library, name, self._wrapped(name, getattr(library, name)))

    def wait_for_pass(self, scenario: str, entry: Optional[str], timeout_s: float = 5.0) -> None:
        """Lets the background passes go over what the requests left: half a second, and until a pass of ``entry``
        called a kernel in ``scenario``, for at most ``timeout_s`` (a loaded machine may not schedule the pass's thread
        for a while; a short run may leave it nothing to do)."""
        time.sleep(0.5)
        deadline = time.monotonic() + timeout_s
        while entry is not None and time.monotonic() < deadline:
            with self._lock:
                if any(key[:2] == (scenario, entry) for key in self.calls):
                    return
            time.sleep(0.05)

    def _wrapped(self, name: str, kernel: Callable) -> Callable:
        @functools.wraps(kernel)
        def call(*args):
            # A finalizer that frees a native object can run inside _record (the garbage collector picks the
            # moment): that call is the collector's, not a path's, and recording it would take the lock twice.
            if not getattr(self._recording, "on", False):
                self._recording.on = True
                try:
                    self._record(name, sys._getframe(1))
                finally:
                    self._recording.on = False
            return kernel(*args)
        return call

    def _record(self, kernel: str, frame: Optional[FrameType]) -> None:
        frames = []
        while frame is not None:
            frames.append((Path(frame.f_code.co_filename), frame.f_code.co_name))
            frame = frame.f_back
        entry, path = attribute(frames)
        with self._lock:
            if entry is None:
                self.unattributed[kernel] += 1
                return
            self.calls[self.scenario, entry, kernel].add(path)


def attribute(frames: list[tuple[Path, str]]) -> tuple[Optional[str], list[str]]:
    """``(entry, path)`` of a kernel call whose stack is ``frames`` (``(file, function)``, innermost first): the path
    from the entry down, ``file:function`` each; ``(None, [])`` where no entry is on the stack, or where the call is a
    finalizer's (``__del__``: the garbage collector runs it wherever an allocation triggers it, inside any path, and it
    frees an object of another request or another test)."""
    path, entry, entry_depth = [], None, 0
    for file, function in frames:
        if _PACKAGE not in file.parts:  # the caller's frames above the package (this tool, threading)
            continue
        if function == "__del__":
            return None, []
        path.append(f"{'/'.join(file.parts[file.parts.index(_PACKAGE) + 1:])}:{function}")
        if file.name == _SERVICER and function != "wrapper":
            entry, entry_depth = f"PSServicer.{function}", len(path)  # the outermost servicer frame wins: keep walking
        elif (file.name, function) in _PASSES:
            entry, entry_depth = _PASSES[file.name, function], len(path)
            break
    return (entry, list(reversed(path[:entry_depth]))) if entry is not None else (None, [])


class _Context:
    """What the servicer asks of a gRPC context, in process."""

    def invocation_metadata(self):
        return ()

    def set_trailing_metadata(self, metadata) -> None:
        pass

    def abort(self, code, details: str):
        raise RuntimeError(f"{code}: {details}")


def _packed(tables: list[str], ids: list[torch.Tensor]) -> pb.PackedIds:
    return pb.PackedIds(tables=tables, counts=[i.numel() for i in ids], ids=wire.encode_ids(torch.cat(ids)))


class Shard:
    """One in-process shard with its servicer, and the requests the workload sends it."""

    def __init__(self, store: ShardStore, tables: list[TableConfig]) -> None:
        self.store = store
        self.dims = {config.name: config.dim for config in tables}
        for config in tables:
            store.configure(config)
        self.servicer = PSServicer(store, PSConfig())
        self._seq = 0

    def lookup(self, requests: dict[str, torch.Tensor], train: bool) -> None:
        self.servicer.Lookup(pb.LookupRequest(packed=_packed(list(requests), list(requests.values())), train=train,
                                              dtype=pb.FP32), _Context())

    def update(self, requests: dict[str, torch.Tensor]) -> None:
        self._seq += 1
        grads = torch.cat([torch.full((ids.numel(), self.dims[name]), 0.01) for name, ids in requests.items()])
        self.servicer.Update(pb.UpdateRequest(client_id="depths", seq=self._seq, packed_dtype=pb.FP32,
                                              packed=_packed(list(requests), list(requests.values())),
                                              packed_grads=wire.encode_rows(grads, "fp32")), _Context())


def _tables(storage: str, capacity: int, ttl: bool, admit_after: int = 1) -> list[TableConfig]:
    """Tables ``a`` and ``b``; ``b`` admits an id at its ``admit_after``-th sighting (admission in tensor ops)."""
    return [TableConfig("a", dim=8, capacity=capacity, storage=storage, optimizer=Adagrad(), ttl_steps=50 if ttl else None),
            TableConfig("b", dim=8, capacity=capacity, storage=storage, optimizer=Adagrad(), admit_after=admit_after)]


def drive(shard: Shard, rounds: int, batch: int, distinct: int, generator: torch.Generator) -> None:
    """Training lookups and updates of one and of two tables, and evaluation lookups, over ``distinct`` ids (skewed:
    a hot few and a long tail), then a second pass over the first ids (rows brought back from disk)."""
    for step in range(rounds):
        hot = torch.randint(0, batch, (batch // 2,), generator=generator)
        tail = torch.randint(0, distinct, (batch // 2,), generator=generator)
        ids = torch.unique(torch.cat([hot, tail]))
        fresh = torch.arange(step * batch, (step + 1) * batch) % distinct
        shard.lookup({"a": ids}, train=True)
        shard.lookup({"a": fresh, "b": ids}, train=True)
        shard.update({"a": ids})
        shard.update({"a": fresh, "b": ids})
        shard.lookup({"a": ids[: batch // 4]}, train=False)
        shard.lookup({"a": ids[: batch // 4], "b": fresh[: batch // 4]}, train=False)
    shard.update({"a": torch.arange(batch)})  # rows demoted long ago: an update brings them back first


SCENARIOS = ("memory", "disk", "disk, no demoter")
"""A memory table at capacity (its expirer running); a disk table as a shard process serves it (a demoter under a
memory limit: promotions queued, room kept ahead); a disk table whose requests make their own room and promote what
they read (``ShardStore(demotion_interval_s=None)``, as in-process users may run it)."""


def measure(rounds: int, batch: int, capacity: int, folder: str) -> Recorder:
    recorder = Recorder()
    generator = torch.Generator().manual_seed(0)
    for number, scenario in enumerate(SCENARIOS):
        recorder.scenario = scenario
        if scenario == "memory":
            store = ShardStore(0, 1, seed=number, expiry_interval_s=0.05)
        elif scenario == "disk":
            store = ShardStore(0, 1, seed=number, disk_dir=f"{folder}/{number}", demotion_interval_s=0.005,
                               memory_limit_bytes=int(resident_bytes() * 1.5), expiry_interval_s=0.05)
        else:
            store = ShardStore(0, 1, seed=number, disk_dir=f"{folder}/{number}", demotion_interval_s=None)
        shard = Shard(store, _tables("memory" if scenario == "memory" else "disk", capacity, ttl=scenario != "disk, no demoter",
                                     admit_after=2 if scenario == "memory" else 1))
        drive(shard, rounds, batch, 8 * capacity, generator)
        recorder.wait_for_pass(scenario, "Demoter.run_once" if scenario == "disk" else None)
        store.clear()
        stop_all()  # this scenario's passes end before the next one's begin
    return recorder


def report(recorder: Recorder) -> list[dict]:
    """A row a scenario, kernel and entry: its calls, the deepest and the median depth, the files its paths enter
    twice, and its deepest path."""
    rows_out = []
    order = {scenario: number for number, scenario in enumerate(SCENARIOS)}
    for (scenario, entry, kernel), calls in sorted(recorder.calls.items(),
                                                   key=lambda item: (order[item[0][0]], item[0][2], item[0][1])):
        rows_out.append(dict(scenario=scenario, kernel=kernel, entry=entry, calls=len(calls.depths), deepest=max(calls.depths),
                             typical=int(statistics.median(calls.depths)), entered_twice=sorted(calls.twice),
                             path=calls.deepest))
    return rows_out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="rounds of requests a shard (default: 40)")
    parser.add_argument("--batch", type=int, default=8192, help="ids a request (default: 8192)")
    parser.add_argument("--capacity", type=int, default=1 << 17,
                        help="memory budget of each table in rows (default: 131072: past a sample of access values, so "
                             "that eviction sweeps rather than sorts)")
    parser.add_argument("--limit", type=int, default=None, help="exit 1 where a kernel is reached deeper than this")
    parser.add_argument("--paths", action="store_true", help="print the deepest path of each kernel")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if not native.available():
        print("the store's native kernels are not built: nothing to measure", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kernel-depths-") as folder:
        recorder = measure(args.rounds, args.batch, args.capacity, folder)
    found = report(recorder)
    if args.json:
        print(json.dumps(dict(kernels=found, unattributed=dict(recorder.unattributed)), indent=1))
    else:
        print(f"{'scenario':<17} {'kernel':<18} {'entry':<18} {'calls':>6} {'deepest':>7} {'typical':>7}  files entered twice")
        for row in found:
            print(f"{row['scenario']:<17} {row['kernel']:<18} {row['entry'].removeprefix('PSServicer.'):<18} {row['calls']:>6} "
                  f"{row['deepest']:>7} {row['typical']:>7}  {', '.join(row['entered_twice']) or '-'}")
            if args.paths:
                print("    " + " -> ".join(row["path"]))
        for scenario in SCENARIOS:
            deepest = {}
            for row in found:
                if row["scenario"] == scenario:
                    deepest[row["kernel"]] = max(deepest.get(row["kernel"], 0), row["deepest"])
            print(f"deepest a kernel, {scenario}: " + ", ".join(f"{k} {d}" for k, d in sorted(deepest.items(), key=lambda kv: kv[1])))
        if recorder.unattributed:
            print("not from the servicer or a pass (setup): " + ", ".join(f"{k} x{n}" for k, n in sorted(recorder.unattributed.items())))
    over = [row for row in found if args.limit is not None and row["deepest"] > args.limit]
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
