"""Starts ``lightning-persia ps serve`` processes on this machine, reads their addresses, and stops them.

- :func:`serve_command` is the command line of one shard process.
- :func:`read_listening_address` waits for the ``PERSIA_PS_LISTENING`` line a shard prints once it serves.
- :class:`LocalShards` starts N shards on loopback, optionally restarts those that die, and stops them (tests,
  benchmarks, the embedded cluster of the strategy, serving).
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import MutableSequence, Optional, Sequence

from lightning_persia.remote_ps.allocator import shard_environment
from lightning_persia.remote_ps.protocol import LISTENING_PREFIX, SHARD_PROCESS_ENV

log = logging.getLogger("lightning_persia.ps")


def serve_command(
    shard_index: int,
    num_shards: int,
    *,
    port: int = 0,
    host: str = "127.0.0.1",
    parent_pid: Optional[int] = None,
    restore_from: Optional[str] = None,
    config_path: Optional[str] = None,
    extra_args: Sequence[str] = (),
    overrides: Sequence[str] = (),
) -> list[str]:
    """The command line of one shard process. ``extra_args`` come after the built options (a later ``--port``
    wins), the ``key=value`` ``overrides`` last (a later one wins)."""
    command = [sys.executable, "-m", "lightning_persia.cli", "ps", "serve", "--port", str(port)]
    if restore_from:
        command += ["--restore-from", str(restore_from)]
    command += ["--host", host, "--shard-index", str(shard_index), "--num-shards", str(num_shards)]
    if parent_pid is not None:
        command += ["--parent-pid", str(parent_pid)]
    command += list(extra_args)
    if config_path:
        command += ["--config", config_path]
    return command + list(overrides)


def read_listening_address(process: subprocess.Popen, lines: MutableSequence[str], deadline: float, thread_name: str) -> Optional[str]:
    """The address a ``ps serve`` process prints on its ``LISTENING`` line, or None if none came by ``deadline``.

    A daemon thread keeps reading the process's (text) stdout afterwards, so a chatty shard never blocks on
    its pipe; every other line is appended to ``lines`` (a bounded ``deque`` keeps only the last ones).
    """
    found: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        for line in process.stdout:
            line = line.rstrip("\n")
            if line.startswith(LISTENING_PREFIX + " ") and not ready.is_set():
                found.append(line.split(" ", 1)[1].strip())
                ready.set()
            else:
                lines.append(line)
        ready.set()

    threading.Thread(target=drain, name=thread_name, daemon=True).start()
    ready.wait(max(0.0, deadline - time.monotonic()))
    return found[0] if found else None


def stop_processes(processes: list[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM to every process still running, then SIGKILL to any still alive after ``timeout_s``."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ShardStartError(RuntimeError):
    """A shard process exited or stayed silent before it printed its address."""


@dataclass
class ShardEvent:
    """Something the supervisor of :class:`LocalShards` saw or did: ``exited``, ``restarted``, ``restart_failed``, ``gave_up``."""

    time: float
    shard: int
    kind: str
    detail: str


class LocalShards:
    """``num_shards`` shard processes on loopback, started with ``lightning-persia ps serve --port 0``.

    Each shard exits when this process dies (``--parent-pid``). Use as a context manager or call
    :meth:`stop`. The shards share this machine with each other and with the caller, so unless told
    otherwise each gets ``cpu_count // (num_shards + 1)`` torch threads (at least one), and OpenMP threads
    that sleep instead of spinning when idle (``OMP_WAIT_POLICY=PASSIVE``): spinning threads of several
    processes on the same cores multiply request latency. Their ``malloc`` is jemalloc's where the system has it
    (``allocator``: one of ``remote_ps/allocator.py``'s ``ALLOCATORS``; ``"jemalloc"`` raises ``AllocatorError``
    where it has not, ``"system"`` keeps this process's).

    With ``restart=True`` a supervisor (the thread that forked the shards) checks them every ``poll_s``
    seconds and restarts a shard that died (SIGKILL, OOM, crash) on the same port, at most ``max_restarts``
    times per shard, with ``--restore-from restore_from`` when that is set (assign the attribute after each
    checkpoint). A restarted shard is a new *incarnation*: clients that knew the old one are refused until
    they refresh (see ``PSClient.wait_healthy``). What the supervisor saw and did is in :attr:`events`.

    Example::

        with LocalShards(2, overrides=["seed=7"]) as shards:
            client = PSClient(shards.addresses)
    """

    def __init__(
        self,
        num_shards: int,
        *,
        host: str = "127.0.0.1",
        config_path: Optional[str] = None,
        overrides: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        env: Optional[dict] = None,
        allocator: str = "auto",
        startup_timeout_s: float = 120.0,
        restart: bool = False,
        max_restarts: int = 3,
        restore_from: Optional[str] = None,
        poll_s: float = 0.2,
    ) -> None:
        self.num_shards = num_shards
        self.processes: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.restart = restart
        self.max_restarts = max_restarts
        self.restore_from = restore_from
        self.restarts = [0] * num_shards
        # the shard count each shard was started with: a restart passes it again, so that the shard finds its own
        # write-ahead log (named by it) and routes by the map the log holds, whatever grow or shrink did since
        self._started_as = [num_shards] * num_shards
        self.events: list[ShardEvent] = []
        self.startup_timeout_s = startup_timeout_s
        self._logs: list[collections.deque] = [collections.deque(maxlen=200) for _ in range(num_shards)]
        self._lock = threading.Lock()
        self._stopping = False
        self._seen_dead: set[int] = set()  # pids whose exit was recorded
        threads = max(1, (os.cpu_count() or 1) // (num_shards + 1))
        self._command = dict(host=host, parent_pid=os.getpid(), config_path=config_path, extra_args=tuple(extra_args),
                             overrides=(f"torch_threads={threads}", *overrides))  # a later override of the caller's wins
        self._env = shard_environment(allocator, {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, SHARD_PROCESS_ENV: "1", **(env or {})})
        # The kernel's parent-death signal follows the *thread* that forked a shard, so the shards are forked
        # by a thread of their own that lives until stop(), whatever thread creates this object. The same
        # thread restarts dead shards.
        self._keeper_done = threading.Event()
        self._spawns: queue.Queue = queue.Queue()  # (indices, future) of shards to start on the keeper's thread
        spawned: futures.Future = futures.Future()

        def keeper() -> None:
            try:
                for index in range(num_shards):
                    self.processes.append(self._popen(index, 0, None))
            except BaseException as err:
                spawned.set_exception(err)
                return
            spawned.set_result(None)
            while not self._keeper_done.wait(poll_s):
                self._spawn_asked()
                if self.restart:
                    try:
                        self._supervise()
                    except Exception:  # never let the supervisor die: the shards' parent-death signal hangs on it
                        log.exception("shard supervisor failed")

        threading.Thread(target=keeper, name="persia-ps-shard-keeper", daemon=True).start()
        try:
            spawned.result()
            deadline = time.monotonic() + startup_timeout_s
            for index, process in enumerate(self.processes):
                self.addresses.append(self._read_address(index, process, deadline))
        except BaseException:
            self.stop()
            raise

    def grow(self, num_shards: int) -> list[str]:
        """Starts the shards from the current count up to ``num_shards`` (each told the cluster has ``num_shards``;
        they hold nothing until ``remote_ps.client.scaling.rescale`` moves slots to them); returns every address."""
        if num_shards < self.num_shards:
            raise ValueError(f"grow to {num_shards} shards: the cluster has {self.num_shards} already")
        started: futures.Future = futures.Future()
        self._spawns.put((range(len(self.processes), num_shards), num_shards, started))
        processes = started.result()
        deadline = time.monotonic() + self.startup_timeout_s
        with self._lock:
            self.restarts += [0] * len(processes)
            self._started_as += [num_shards] * len(processes)
            self.num_shards = num_shards
        self.addresses += [self._read_address(len(self.addresses), process, deadline) for process in processes]
        return list(self.addresses)

    def shrink(self, num_shards: int, timeout_s: float = 15.0) -> None:
        """Stops the shards from ``num_shards`` on (drained first: ``rescale`` moved their slots away)."""
        with self._lock:
            drained, self.processes = self.processes[num_shards:], self.processes[:num_shards]
            self.addresses, self.restarts = self.addresses[:num_shards], self.restarts[:num_shards]
            self._started_as = self._started_as[:num_shards]
            self.num_shards = num_shards
        stop_processes(drained, timeout_s)

    def _spawn_asked(self) -> None:
        """Starts the shards :meth:`grow` asked for (on the keeper's thread: the parent-death signal follows it)."""
        while not self._spawns.empty():
            indices, num_shards, started = self._spawns.get()
            try:
                processes = []
                for index in indices:
                    self._logs.append(collections.deque(maxlen=200))
                    processes.append(self._popen(index, 0, None, num_shards))
                with self._lock:
                    self.processes += processes
                started.set_result(processes)
            except BaseException as err:  # noqa: BLE001 - the caller of grow hears of it
                started.set_exception(err)

    def _popen(self, index: int, port: int, restore_from: Optional[str], num_shards: Optional[int] = None) -> subprocess.Popen:
        command = serve_command(index, num_shards or self.num_shards, port=port, restore_from=restore_from, **self._command)
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=self._env)

    def _event(self, shard: int, kind: str, detail: str) -> None:
        (log.warning if kind != "restarted" else log.info)("shard %d: %s: %s", shard, kind, detail)
        self.events.append(ShardEvent(time.time(), shard, kind, detail))

    def _supervise(self) -> None:
        for index in range(self.num_shards):
            with self._lock:
                if self._stopping:
                    return
                process = self.processes[index]
            status = process.poll()
            if status is None:
                continue
            if process.pid not in self._seen_dead:
                self._seen_dead.add(process.pid)
                self._event(index, "exited", f"pid {process.pid} exited with status {status}; last output:\n"
                            + "\n".join(list(self._logs[index])[-5:]))
            if self.restarts[index] >= self.max_restarts:
                if self.restarts[index] == self.max_restarts:
                    self.restarts[index] += 1  # report once
                    self._event(index, "gave_up", f"not restarted: max_restarts={self.max_restarts} reached")
                continue
            self._restart(index)

    def _restart(self, index: int) -> None:
        self.restarts[index] += 1
        port = int(self.addresses[index].rsplit(":", 1)[1])
        restore = self.restore_from
        with self._lock:
            if self._stopping:
                return
            process = self._popen(index, port, restore, self._started_as[index])
            self.processes[index] = process
        try:
            address = self._read_address(index, process, time.monotonic() + self.startup_timeout_s)
        except ShardStartError as err:
            if process.poll() is None:
                process.kill()
                process.wait()
            self._seen_dead.add(process.pid)
            self._event(index, "restart_failed", f"attempt {self.restarts[index]}/{self.max_restarts}: {err}")
            return
        if address != self.addresses[index]:  # cannot happen with a fixed port; a safety net for the clients
            self._event(index, "restart_failed", f"came back on {address}, not {self.addresses[index]}")
            process.kill()
            return
        origin = f"restored from {restore}" if restore else "with empty tables (no checkpoint to restore)"
        self._event(index, "restarted", f"pid {process.pid} on {address}, {origin} (restart {self.restarts[index]}/{self.max_restarts})")

    def _read_address(self, index: int, process: subprocess.Popen, deadline: float) -> str:
        lines = self._logs[index]
        address = read_listening_address(process, lines, deadline, thread_name=f"persia-ps-{index}-output")
        if address is None:
            status = process.poll()
            state = f"exited with status {status}" if status is not None else "did not print its address in time"
            raise ShardStartError(f"shard {index}/{self.num_shards} {state}; its output:\n" + "\n".join(lines))
        return address

    def output(self, index: int) -> str:
        """The last lines a shard printed (its log, across restarts), for error messages."""
        return "\n".join(self._logs[index]) if index < len(self._logs) else ""

    def alive(self) -> list[bool]:
        """Whether each shard process is running now."""
        with self._lock:
            return [p.poll() is None for p in self.processes]

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to every shard, then SIGKILL to any still alive after ``timeout_s``; no restart after this."""
        with self._lock:
            self._stopping = True
            processes = list(self.processes)
        stop_processes(processes, timeout_s)
        self._keeper_done.set()

    def __enter__(self) -> "LocalShards":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
