"""Where a training step's time goes: timestamps on the trainer thread and around the embedding worker.

Only installed with ``--profile`` (the timed figures of a normal run come from uninstrumented code). All
figures are per step, on global rank 0, over the timed steps (after warm-up):

trainer thread (they add up to the step time)
  data       end of the previous step -> start of this one (next batch from the loader / prefetch queue)
  forward    the forward and loss, *without* the two parts below
  wait       blocked on this batch's lookup (rows not there yet): the PS on the critical path. PersiaStrategy
             waits at the start of the batch (its recovery check waits for the prefetched lookup to answer)
             and in the forward if a lookup is still missing
  transfer   flattening the fetched rows into the batch-local leaf and moving it to the device
  backward   ``loss.backward()``
  push       pulling the embedding gradients, bucketing/encoding them and handing the Update RPCs over
  optimizer  dense optimizer step, Lightning bookkeeping

CPU time (ms of CPU per step, between the end of the warm-up and the end of training; 2 cores give at most
2 x the step time)
  cpu_main      the trainer thread (Python, Lightning, and its share of every torch op)
  cpu_pool      torch's other intra-op (OpenMP) threads
  cpu_prefetch  the prefetch thread (dedup, bucketing and encoding of lookups)
  cpu_client    the PS client's event-loop thread (gRPC calls, decoding rows)
  cpu_other     every other thread of the trainer process (gRPC core, Lightning)
  cpu_ranks     the other trainer ranks (rank 0 launched them) and DataLoader workers, whole processes
  cpu_shards    the shard processes (and, with --netem without kernel netem, the delaying forwarder)

in the background (overlapping the above)
  plan       dedup of a batch's ids on the prefetch thread
  gate       the prefetch thread waiting for the staleness window (an update acknowledgement)
  lookup     Lookup RPCs: issue -> rows decoded (client encode, network, shard, decode)
  update     Update RPCs: submit -> acknowledged by every shard
  lag        updates of earlier steps the step's lookup missed (mean; at most the staleness bound)
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from collections import defaultdict
from typing import Any, Dict, List

import lightning as L

_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")
SHARD_PIDS: List[int] = []  # shard processes that are not children of this one (--netem)
CPU_PARTS = ("cpu_main", "cpu_pool", "cpu_prefetch", "cpu_client", "cpu_other", "cpu_ranks", "cpu_shards")


def _stat_cpu_ms(path: str) -> float:
    """utime + stime of /proc/.../stat, in ms."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_MS


def _descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (children, their children, ...)."""
    parents: Dict[int, List[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(f.read().rsplit(")", 1)[1].split()[1])].append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out.extend(children)
        todo.extend(children)
    return out


def _role(tid: int, names: Dict[int, str], main_tid: int) -> str:
    name = names.get(tid)
    if tid == main_tid:
        return "cpu_main"
    if name is None:  # not a Python thread: torch's pool (named after the process) or a native library's
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except FileNotFoundError:
            comm = ""
        return "cpu_pool" if comm.startswith(("python", "pt_")) else "cpu_other"
    if name.startswith("persia-prefetch"):
        return "cpu_prefetch"
    if name.startswith("persia-ps-client"):
        return "cpu_client"
    return "cpu_other"


def cpu_snapshot() -> Dict[str, Any]:
    """CPU ms so far of each thread of this process (with its role), of the process, of the shards, and of the
    other trainer-side processes below it (other ranks, DataLoader workers)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    main_tid = threading.main_thread().native_id
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        tid_i = int(tid)
        threads[tid_i] = (_role(tid_i, names, main_tid), _stat_cpu_ms(f"/proc/self/task/{tid}/stat"))
    shards = ranks = 0.0
    for pid in set(_descendants(os.getpid())) | set(SHARD_PIDS):
        ms = _stat_cpu_ms(f"/proc/{pid}/stat")
        if pid in SHARD_PIDS or _is_shard(pid):
            shards += ms
        else:  # with 2 ranks, rank 0 is the launcher of rank 1; DataLoader workers
            ranks += ms
    return {"threads": threads, "process": _stat_cpu_ms("/proc/self/stat"), "children": shards, "ranks": ranks}


def _is_shard(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    return b"serve" in args and b"ps" in args


def thread_cpu_ms() -> float:
    """CPU ms so far of the calling thread."""
    return _stat_cpu_ms(f"/proc/self/task/{threading.get_native_id()}/stat")


def cpu_delta(start: Dict[str, Any], end: Dict[str, Any], final: Dict[int, float]) -> Dict[str, float]:
    """CPU ms by role between two snapshots; threads that ended in between count for the role they had
    (``final``: the last CPU figure some of them recorded just before they ended)."""
    out = dict.fromkeys(CPU_PARTS, 0.0)
    end = {**end, "threads": dict(end["threads"])}
    for tid, ms in final.items():
        if tid in start["threads"] and tid not in end["threads"]:
            role, before = start["threads"][tid]
            out[role] += ms - before
            start = {**start, "threads": {k: v for k, v in start["threads"].items() if k != tid}}
            start["process"] -= before
            end["process"] -= ms
    for tid, (role, ms) in end["threads"].items():
        before = start["threads"].get(tid)
        if before is None:
            out[role] += ms
        else:  # a thread keeps the role it had (a finished Python thread may linger as a nameless task)
            out[before[0]] += ms - before[1]
    ended = [start["threads"][tid] for tid in start["threads"] if tid not in end["threads"]]
    live_end = sum(ms for _, ms in end["threads"].values())
    live_start_kept = sum(ms for tid, (_, ms) in start["threads"].items() if tid in end["threads"])
    # the process total keeps the CPU of ended threads: what they (and threads born and ended since) used
    ended_ms = (end["process"] - live_end) - (start["process"] - live_start_kept)
    roles = {role for role, _ in ended}
    out[roles.pop() if len(roles) == 1 else "cpu_other"] += max(0.0, ended_ms)
    out["cpu_shards"] = end["children"] - start["children"]
    out["cpu_ranks"] = end["ranks"] - start["ranks"]
    return out


class CpuMeter(L.Callback):
    """CPU ms per step, after the first ``warmup`` steps, of the trainer process (rank 0), of the other
    trainer-side processes (other ranks, DataLoader workers) and of the shards; cheap enough for timed runs."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self._steps = 0
        self._start: Dict[str, Any] = {}
        self._end: Dict[str, Any] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._steps += 1
        if self._steps == self.warmup:
            self._start = cpu_snapshot()

    def on_train_end(self, trainer, module) -> None:
        self._end = cpu_snapshot()

    def summary(self) -> Dict[str, float]:
        steps = self._steps - self.warmup
        if not self._start or not self._end or steps < 1:
            return {}
        return {
            "trainer_cpu_ms": (self._end["process"] - self._start["process"]) / steps,
            "other_trainer_cpu_ms": (self._end["ranks"] - self._start["ranks"]) / steps,
            "shards_cpu_ms": (self._end["children"] - self._start["children"]) / steps,
        }


TRAINER_PARTS = ("data", "forward", "wait", "transfer", "backward", "push", "optimizer")
BACKGROUND_PARTS = ("plan", "gate", "lookup", "update")


class StepProbe(L.Callback):
    """Per-step timings (ms) of rank 0; :meth:`install_worker_probes` adds the embedding worker's parts."""

    def __init__(self, element_size: int = 2) -> None:
        self.element_size = element_size
        self.steps: List[Dict[str, float]] = []
        self.background: Dict[str, List[float]] = defaultdict(list)
        self.wire_bytes: List[float] = []
        self.lags: List[float] = []  # updates each step's lookup missed (at most the staleness bound)
        self._lock = threading.Lock()
        self._current: Dict[str, float] = defaultdict(float)
        self._marks: Dict[str, float] = {}
        self._last_end = None
        self.warmup = 0
        self._cpu_start: Dict[str, Any] = {}
        self._cpu_end: Dict[str, Any] = {}
        self._cpu_steps = 0
        self.final_cpu: Dict[int, float] = {}  # tid -> CPU ms recorded by a thread just before it ended

    # ---- trainer thread ---------------------------------------------------------------------------

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        now = time.perf_counter()
        self._current = defaultdict(float)
        if self._last_end is not None:
            self._current["data"] = (now - self._last_end) * 1e3
        self._marks = {"start": now}

    def on_before_backward(self, trainer, module, loss) -> None:
        self._marks["forward_end"] = time.perf_counter()

    def on_after_backward(self, trainer, module) -> None:
        self._marks["backward_end"] = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        marks, cur = self._marks, self._current
        if "forward_end" in marks and "backward_end" in marks:
            forward = (marks["forward_end"] - marks["start"]) * 1e3
            cur["forward"] = forward - cur["wait"] - cur["transfer"]
            cur["backward"] = (marks["backward_end"] - marks["forward_end"]) * 1e3
            cur["optimizer"] = (now - marks["backward_end"]) * 1e3 - cur["push"]
            self.steps.append(dict(cur))
        self._last_end = now
        if len(self.steps) == self.warmup:
            self._cpu_start = cpu_snapshot()
            self._cpu_steps = 0
        self._cpu_steps += 1

    def on_train_end(self, trainer, module) -> None:
        self._cpu_end = cpu_snapshot()
        self._cpu_steps -= 1  # counted from the step after the snapshot

    def add(self, part: str, ms: float) -> None:
        self._current[part] += ms

    def add_background(self, part: str, ms: float) -> None:
        with self._lock:
            self.background[part].append(ms)

    # ---- the embedding worker ---------------------------------------------------------------------

    def install_worker_probes(self) -> None:
        """Wraps BatchRows.materialize, EmbeddingWorker.plan/issue/finish_step and PSClient lookups/updates."""
        from lightning_persia.embedding import batch_rows, prefetch, worker
        from lightning_persia.remote_ps import client
        from lightning_persia.strategy.persia import PersiaStrategy

        probe = self
        run = prefetch._PrefetchIterator._run

        def recorded_run(self, *args, **kwargs):
            try:
                return run(self, *args, **kwargs)
            finally:
                probe.final_cpu[threading.get_native_id()] = thread_cpu_ms()

        prefetch._PrefetchIterator._run = recorded_run

        batch_start = PersiaStrategy.on_train_batch_start

        def timed_batch_start(self, *args, **kwargs):  # opens the step; the recovery check waits for its rows
            start = time.perf_counter()
            out = batch_start(self, *args, **kwargs)
            probe.add("wait", (time.perf_counter() - start) * 1e3)
            return out

        PersiaStrategy.on_train_batch_start = timed_batch_start
        materialize = batch_rows.BatchRows.materialize

        def timed_materialize(rows, *args, **kwargs):
            start = time.perf_counter()
            out = materialize(rows, *args, **kwargs)
            total = (time.perf_counter() - start) * 1e3
            probe.add("wait", rows.wait_ms)
            probe.add("transfer", total - rows.wait_ms)
            probe.wire_bytes.append(float(rows.wire_bytes(probe.element_size)))
            return out

        batch_rows.BatchRows.materialize = timed_materialize

        plan = worker.EmbeddingWorker.plan

        def timed_plan(self, *args, **kwargs):
            start = time.perf_counter()
            out = plan(self, *args, **kwargs)
            probe.add_background("plan", (time.perf_counter() - start) * 1e3)
            return out

        worker.EmbeddingWorker.plan = timed_plan

        issue = worker.EmbeddingWorker.issue
        lookup_call = threading.local()

        def timed_issue(self, *args, **kwargs):
            lookup_call.ms = 0.0
            start = time.perf_counter()
            issue(self, *args, **kwargs)
            probe.add_background("gate", (time.perf_counter() - start) * 1e3 - lookup_call.ms)

        worker.EmbeddingWorker.issue = timed_issue

        finish = worker.EmbeddingWorker.finish_step

        def timed_finish(self, *args, **kwargs):
            if self._current is None:
                return finish(self, *args, **kwargs)
            probe.lags.append(float(self._current.lag))
            start = time.perf_counter()
            out = finish(self, *args, **kwargs)
            probe.add("push", (time.perf_counter() - start) * 1e3)
            return out

        worker.EmbeddingWorker.finish_step = timed_finish

        lookup_async = client.PSClient.lookup_async

        def timed_lookup(self, ids, **kwargs):
            start = time.perf_counter()
            future = lookup_async(self, ids, **kwargs)
            lookup_call.ms = getattr(lookup_call, "ms", 0.0) + (time.perf_counter() - start) * 1e3
            future.add_done_callback(lambda f: probe.add_background("lookup", (time.perf_counter() - start) * 1e3))
            return future

        client.PSClient.lookup_async = timed_lookup

        update_async = client.PSClient.update_async

        def timed_update(self, updates, **kwargs):
            start = time.perf_counter()
            future = update_async(self, updates, **kwargs)
            future.add_done_callback(lambda f: probe.add_background("update", (time.perf_counter() - start) * 1e3))
            return future

        client.PSClient.update_async = timed_update

    # ---- summary ------------------------------------------------------------------------------------

    def summary(self, skip: int) -> Dict[str, Any]:
        steps = self.steps[skip:] or self.steps
        out: Dict[str, Any] = {"steps": len(steps)}
        for part in TRAINER_PARTS:
            values = [s.get(part, 0.0) for s in steps]
            out[part] = statistics.mean(values) if values else 0.0
        out["step"] = sum(out[p] for p in TRAINER_PARTS)
        with self._lock:
            for part in BACKGROUND_PARTS:
                values = self.background.get(part, [])[skip:]
                out[f"{part}_mean"] = statistics.mean(values) if values else None
                out[f"{part}_median"] = statistics.median(values) if values else None
        lags = self.lags[skip:]
        out["staleness_mean"] = statistics.mean(lags) if lags else None
        wire = self.wire_bytes[skip:]
        out["wire_mb_per_step"] = statistics.mean(wire) / 2**20 if wire else None
        if self._cpu_start and self._cpu_end and self._cpu_steps > 0:
            delta = cpu_delta(self._cpu_start, self._cpu_end, self.final_cpu)
            for part in CPU_PARTS:
                out[part] = delta[part] / self._cpu_steps
            out["cpu_total"] = sum(out[p] for p in CPU_PARTS)
        return out
