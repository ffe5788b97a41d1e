"""Where a training step's time goes: the trainer's hooks, and the embedding path's profiler spans.

Only installed with ``--profile`` (the timed figures of a normal run come from uninstrumented code; a profiled
run's own samples/s include the profiler's overhead). Figures are per step, on global rank 0, over the timed
steps (after warm-up):

trainer thread (they add up to the step time)
  data       end of the previous step -> start of this one (next batch from the loader / prefetch queue)
  forward    the forward and loss, *without* the two parts below
  wait       the ``persia.lookup_wait`` spans: waiting for this batch's rows (the PS on the critical path;
             PersiaStrategy's recovery check at the start of the batch waits for the prefetched lookup) and
             moving them to the device
  pooled     the ``persia.pooled_lookup`` spans: the twins' fused lookups over the batch-local rows
  backward   ``loss.backward()``
  push       the ``persia.gradient_push`` span: the step's gradient started on its way to the host and queued
  optimizer  dense optimizer step, Lightning bookkeeping

CPU time (ms of CPU per step, from the end of the warm-up to the profiled steps; 2 cores give at most 2 x the
step time)
  cpu_main      the trainer thread (Python, Lightning, and its share of every torch op)
  cpu_pool      torch's other intra-op (OpenMP) threads
  cpu_prefetch  the prefetch thread (planning: dedup, bucketing and encoding of lookups)
  cpu_push      the pusher's thread (gradients checked, encoded and sent)
  cpu_client    the PS client's event-loop thread (gRPC calls, decoding rows)
  cpu_other     every other thread of the trainer process (gRPC core, Lightning, the rank merge, the embedding
                workers' replies)
  cpu_workers   the embedding-worker processes (``PersiaStrategy(embedding_workers=...)``): bucketing, encoding, the
                shards' calls, decoding
  cpu_ranks     the other trainer ranks (rank 0 launched them) and DataLoader workers, whole processes
  cpu_shards    the shard processes (and, with --netem without kernel netem, the delaying forwarder)

in the background (overlapping the above)
  plan       the ``persia.plan`` spans (prefetch thread), per step
  encode     the ``persia.gradient_encode`` spans (push thread): a gradient checked, encoded and sent
  merge      the ``persia.merge`` spans (rank-merge thread), per step
  lookup     a prefetched lookup's latency: issue -> rows decoded (the pipeline scheduler's moving average)
  update     an update's latency: push -> acknowledged by every shard (the same)
  lag        updates of earlier steps the step's lookup missed (mean; at most the staleness bound)

The spans come from ``torch.profiler`` (``profile_all_threads``, so that the prefetch and merge threads show),
run over the last :data:`PROFILED_STEPS` steps, whose hooks' timings go with them (the profiler adds a little
to every op); the CPU figures come from the timed steps before them, unprofiled. Every span name is in
``lightning_persia.embedding.phases``.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from collections import defaultdict
from typing import Any, Dict, List, Optional

import lightning as L
import torch
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

from lightning_persia.embedding.phases import GRADIENT_ENCODE, GRADIENT_PUSH, LOOKUP_WAIT, MERGE, PHASES, PLAN, POOLED_LOOKUP

_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")
SHARD_PIDS: List[int] = []  # shard processes that are not children of this one (--netem)
CPU_PARTS = ("cpu_main", "cpu_pool", "cpu_prefetch", "cpu_push", "cpu_client", "cpu_other", "cpu_workers", "cpu_ranks", "cpu_shards")
OTHER_THREADS = ("cpu_prefetch", "cpu_push", "cpu_client", "cpu_other")
"""The trainer process's threads other than the main one and torch's pool: ``cpu_other_threads`` sums them."""


def device_name(accelerator: str) -> str:
    """What a run trained on: the GPU's name, or the CPU's model and core count."""
    import torch

    if accelerator == "gpu":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    model = platform_cpu_model()
    return f"{model}, {os.cpu_count()} cores" if model else f"{os.cpu_count()} CPU cores"


def platform_cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


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
    if name.startswith("persia-push"):
        return "cpu_push"
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
    shards = ranks = workers = 0.0
    for pid in set(_descendants(os.getpid())) | set(SHARD_PIDS):
        ms = _stat_cpu_ms(f"/proc/{pid}/stat")
        command = _cmdline(pid)
        if pid in SHARD_PIDS or (b"serve" in command and b"ps" in command):
            shards += ms
        elif EMBEDDING_WORKER_MODULE in command:
            workers += ms
        else:  # with 2 ranks, rank 0 is the launcher of rank 1; DataLoader workers
            ranks += ms
    return {"threads": threads, "process": _stat_cpu_ms("/proc/self/stat"), "children": shards, "ranks": ranks, "workers": workers}


EMBEDDING_WORKER_MODULE = b"lightning_persia.embedding.embedding_worker"


def _cmdline(pid: int) -> List[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return []


def cpu_delta(start: Dict[str, Any], end: Dict[str, Any]) -> Dict[str, float]:
    """CPU ms by role between two snapshots; threads that ended in between count for the role they had."""
    out = dict.fromkeys(CPU_PARTS, 0.0)
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
    out["cpu_workers"] = end["workers"] - start["workers"]
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
            "workers_cpu_ms": (self._end["workers"] - self._start["workers"]) / steps,
        }


TRAINER_PARTS = ("data", "forward", "wait", "pooled", "backward", "push", "optimizer")
BACKGROUND_PARTS = ("plan", "encode", "merge", "lookup", "update")
PROFILED_STEPS = 12
_SPAN_PARTS = {"wait": LOOKUP_WAIT, "pooled": POOLED_LOOKUP, "push": GRADIENT_PUSH, "plan": PLAN, "encode": GRADIENT_ENCODE, "merge": MERGE}


class StepProbe(L.Callback):
    """Per-step timings (ms) of rank 0: the trainer's hooks, the embedding path's spans, CPU per thread.

    Args:
        warmup: steps not measured.
        steps: the run's steps (the CPU figures end with the last one, before the loaders close).
    """

    def __init__(self, warmup: int, steps: int, trace: Optional[str] = None) -> None:
        """``trace``: a file the profiled steps' device waits and busiest ops are appended to (see :func:`write_trace`)."""
        self.warmup, self.total, self._trace = warmup, steps, trace
        self.profile_from = max(warmup + 1, steps - PROFILED_STEPS)  # the hooks and CPU figures stop there
        self.steps: List[Dict[str, float]] = []
        self.lags: List[float] = []  # updates each step's lookup missed (at most the staleness bound)
        self.wire_bytes: List[float] = []
        self.spans: Dict[str, float] = {}  # part -> ms per profiled step
        self.latencies: Dict[str, Optional[float]] = {}
        self._marks: Dict[str, float] = {}
        self._last_end: Optional[float] = None
        self._profiler: Optional[profile] = None
        self._profiled = 0
        self._cpu_start: Dict[str, Any] = {}
        self._cpu_end: Dict[str, Any] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        now = time.perf_counter()
        self._marks = {"start": now, "data": (now - self._last_end) * 1e3 if self._last_end is not None else 0.0}

    def on_before_backward(self, trainer, module, loss) -> None:
        self._marks["forward_end"] = time.perf_counter()

    def on_after_backward(self, trainer, module) -> None:
        self._marks["backward_end"] = time.perf_counter()
        pipeline = getattr(trainer.strategy, "pipeline", None)
        metrics = pipeline.step_metrics() if pipeline is not None else {}
        if metrics:  # the step is still open: its lookup's figures
            self.lags.append(metrics["staleness"])
            self.wire_bytes.append(metrics["wire_bytes"])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        marks = self._marks
        if "forward_end" in marks and "backward_end" in marks:
            self.steps.append({
                "data": marks["data"],
                "forward": (marks["forward_end"] - marks["start"]) * 1e3,
                "backward": (marks["backward_end"] - marks["forward_end"]) * 1e3,
                "optimizer": (now - marks["backward_end"]) * 1e3,
            })
        self._last_end = now
        count = len(self.steps)
        if count == self.warmup:
            self._cpu_start = cpu_snapshot()
        if count == self.profile_from:
            self._cpu_end = cpu_snapshot()
            pipeline = getattr(trainer.strategy, "pipeline", None)
            if pipeline is not None:
                scheduler = pipeline.scheduler
                self.latencies = {"lookup": scheduler.lookup_seconds, "update": scheduler.update_seconds}
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._trace and torch.cuda.is_available() else [])
            self._profiler = profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True))
            self._profiler.__enter__()
        elif count == self.total and self._profiler is not None:
            self._stop_profiler(count - self.profile_from)

    def on_train_end(self, trainer, module) -> None:
        if self._profiler is not None:
            self._stop_profiler(len(self.steps) - self.profile_from)

    def _stop_profiler(self, steps: int) -> None:
        profiler, self._profiler = self._profiler, None
        assert profiler is not None
        profiler.__exit__(None, None, None)
        if self._trace:
            write_trace(profiler, self._trace, max(steps, 1))
        totals: Dict[str, float] = defaultdict(float)
        for event in profiler.events():
            if event.name in PHASES:
                totals[event.name] += event.time_range.elapsed_us() / 1e3
        self._profiled = max(steps, 1)
        self.spans = {part: totals.get(name, 0.0) / self._profiled for part, name in _SPAN_PARTS.items()}

    # ---- summary ------------------------------------------------------------------------------------

    def summary(self, skip: int) -> Dict[str, Any]:
        steps = self.steps[self.profile_from :] or self.steps  # the window of the spans: the parts add up
        out: Dict[str, Any] = {"steps": len(steps), "profiled_steps": self._profiled}
        for part in ("data", "forward", "backward", "optimizer"):
            values = [s.get(part, 0.0) for s in steps]
            out[part] = statistics.mean(values) if values else 0.0
        for part in ("wait", "pooled", "push", "plan", "encode", "merge"):
            out[part] = self.spans.get(part, 0.0)
        out["forward"] -= out["wait"] + out["pooled"]
        out["optimizer"] -= out["push"]
        out["step"] = sum(out[p] for p in TRAINER_PARTS)
        for part in ("lookup", "update"):
            seconds = self.latencies.get(part)
            out[part] = seconds * 1e3 if seconds is not None else None
        lags = self.lags[skip : self.profile_from]
        out["staleness_mean"] = statistics.mean(lags) if lags else None
        wire = self.wire_bytes[skip : self.profile_from]
        out["wire_mb_per_step"] = statistics.mean(wire) / 2**20 if wire else None
        if self._cpu_start and self._cpu_end:
            delta = cpu_delta(self._cpu_start, self._cpu_end)
            timed = max(self.profile_from - self.warmup, 1)
            for part in CPU_PARTS:
                out[part] = delta[part] / timed
            out["cpu_total"] = sum(out[p] for p in CPU_PARTS)
            out["cpu_other_threads"] = sum(out[p] for p in OTHER_THREADS)
        return out


WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
         "aten::item", "aten::nonzero", "cudaHostAlloc", "cudaMalloc", "cudaFree")
"""The calls a trace counts: those that may wait for the device (a synchronisation, a copy, a value read back) or
allocate on it."""


def write_trace(profiler: profile, path: str, steps: int) -> None:
    """Appends to ``path`` every call of :data:`WAITS` of the profiled steps, grouped by thread and by the spans and ops
    around it (count and ms of CPU per step), then the ops with the most CPU: where a GPU step's time goes."""
    calls: Dict[str, List[float]] = defaultdict(lambda: [0, 0.0])
    events = list(profiler.events())
    for event in events:
        if event.name in WAITS:
            chain, parent = [event.name], event.cpu_parent
            while parent is not None and len(chain) < 7:
                chain.append(parent.name)
                parent = parent.cpu_parent
            key = f"[thread {event.thread}] " + " < ".join(chain)
            calls[key][0] += 1
            calls[key][1] += event.cpu_time_total / 1e3
    with open(path, "a") as out:
        out.write(f"==== {steps} profiled steps, {len(events)} events; calls that may wait: per step, count and ms of CPU\n")
        for key, (count, ms) in sorted(calls.items(), key=lambda item: -item[1][1]):
            out.write(f"{count / steps:8.1f} {ms / steps:9.3f} ms  {key}\n")
        out.write(profiler.key_averages().table(sort_by="cpu_time_total", row_limit=40) + "\n")
