"""A multi-host run on this machine, with Linux network namespaces as hosts (root, iproute2), and the same run
with 2 ranks on one host, compared.

Four hosts, each a namespace with its own address on one bridge (``common/netem.py``: ``HostNetwork``):

  ps-0, ps-1            two shards each (shards 0, 1 on ps-0; 2, 3 on ps-1):
                        ``lightning-persia ps serve --host <its address> --port 5000|5001 --shard-index i
                        --num-shards 4 --token T``, each under a supervisor loop on its host that starts it
                        again when it exits (what systemd's ``Restart=always`` or a Kubernetes pod's restart
                        policy does on a real cluster)
  trainer-0, trainer-1  ``torchrun --nnodes 2 --node-rank i --nproc-per-node 1 --master-addr <trainer-0's
                        address>`` running ``lightning-persia fit --config examples/dlrm/config.yaml`` with
                        ``trainer.num_nodes: 2`` and ``ps.addresses`` naming the four shards

then the same ``lightning-persia fit`` with ``trainer.devices: 2`` on one host (this namespace, 4 embedded
shards), and prints what ran where (read from ``ip netns pids``), the validation AUC of both and their
difference. ``--kill`` SIGKILLs shard 3 (on ps-1) as soon as the first checkpoint exists: its supervisor
starts it again (empty), and the trainers roll back to that checkpoint, loading it into every shard, and go on
(see ``lightning_persia/strategy/recovery.py``), as they do on one host.

    .venv/bin/python -m benchmarks.cluster.multihost                       # DLRM, 100 steps of 2 x 1,024 rows, τ=0
    .venv/bin/python -m benchmarks.cluster.multihost --kill                # + a shard killed and recovered
    .venv/bin/python -m benchmarks.cluster.multihost --steps 12 --batch-size 256 --staleness 0 --json   # the test's size

The namespaces, and every process started in them, are removed at the end, on error and on Ctrl-C (SIGINT or
SIGTERM); a run killed before it could clean up leaves namespaces that the next run removes.
"""
from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Deque, Dict, List, Optional, Sequence

from benchmarks.common.netem import HostNetwork, NetemError
from lightning_persia.remote_ps.protocol import LISTENING_PREFIX, TOKEN_ENV

_ROOT = Path(__file__).resolve().parents[2]

PS_HOSTS = ("ps-0", "ps-1")
TRAINER_HOSTS = ("trainer-0", "trainer-1")
SHARDS_PER_HOST = 2
SHARD_PORT = 5000
MASTER_PORT = 29500
KILLED_SHARD = 3  # the second shard of ps-1

# Starts the shard command ("$@") again whenever it exits; SIGTERM stops the shard and the loop.
SUPERVISOR = r"""
trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 0' TERM INT
while :; do
  "$@" &
  child=$!
  echo "$child" > "$PIDFILE"
  wait "$child"
  echo "supervisor: shard pid $child exited with status $?; starting it again" >&2
  sleep 0.5
done
"""


class MultihostError(RuntimeError):
    pass


def executable(name: str) -> str:
    """A console script of this virtualenv (``torchrun``, ``lightning-persia``), by absolute path."""
    found = shutil.which(name, path=os.path.dirname(sys.executable))
    if found is None:
        raise MultihostError(f"`{name}` is not installed beside {sys.executable} (scripts/setup.sh installs it)")
    return found


def check_requirements() -> None:
    """Raises :class:`MultihostError` naming what this machine lacks for a multi-host run."""
    if os.geteuid() != 0:
        raise MultihostError("a multi-host run needs root: it creates network namespaces")
    for tool in ("ip", "bash"):
        if shutil.which(tool) is None:
            raise MultihostError(f"a multi-host run needs `{tool}`")
    executable("torchrun")
    executable("lightning-persia")


class _Process:
    """A process started in its own session, its output kept in a file and its last lines in memory."""

    def __init__(self, name: str, command: Sequence[str], log: Path, env: Dict[str, str]) -> None:
        self.name = name
        self.lines: Deque[str] = collections.deque(maxlen=400)
        self.listening: List[str] = []
        self._file = open(log, "w")
        self.popen = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                      env=env, cwd=_ROOT, start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"{name}-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self._file.write(line)
            self._file.flush()
            self.lines.append(line.rstrip("\n"))
            if line.startswith(LISTENING_PREFIX + " "):
                self.listening.append(line.split()[1])

    def tail(self, count: int = 30) -> str:
        return "\n".join(list(self.lines)[-count:])

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to the whole session (the process and what it started), SIGKILL after ``timeout_s``."""
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            if self.popen.poll() is not None and not _session_alive(self.popen.pid):
                break
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and (self.popen.poll() is None or _session_alive(self.popen.pid)):
                time.sleep(0.1)
        self._reader.join(5)
        self._file.close()


def _session_alive(sid: int) -> bool:
    """Whether a process of session ``sid`` is still running (not a zombie)."""
    listing = subprocess.run(["ps", "-o", "stat=", "-s", str(sid)], capture_output=True, text=True).stdout
    return any(line.strip() and not line.strip().startswith("Z") for line in listing.splitlines())


def write_overlay(path: Path, *, num_nodes: int, devices: int, steps: int, batch_size: int, staleness: int, out: Path,
                  ps_addresses: Optional[List[str]], checkpoint_every: int, val_batches: int) -> None:
    """A config laid over examples/dlrm/config.yaml: the run's size, its logger, where the shards are."""
    ps: Dict[str, object] = {"timeout_s": 30.0}
    if ps_addresses is None:
        ps["num_local_shards"] = len(PS_HOSTS) * SHARDS_PER_HOST
    else:
        ps["addresses"] = ps_addresses
    strategy: Dict[str, object] = {"staleness": staleness, "ps": ps}
    callbacks: List[Dict[str, object]] = [{"class_path": "examples.common.PrintAUC"}]
    if checkpoint_every:
        callbacks.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                          "init_args": {"dirpath": str(out / "ckpt"), "every_n_train_steps": checkpoint_every,
                                        "save_top_k": 1, "monitor": "step", "mode": "max"}})
    overlay = {
        "seed_everything": 0,
        "trainer": {
            "num_nodes": num_nodes, "devices": devices, "max_steps": steps, "max_epochs": 1, "val_check_interval": steps,
            "enable_progress_bar": False, "enable_checkpointing": bool(checkpoint_every), "callbacks": callbacks,
            "default_root_dir": str(out),
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(out), "name": "log"}},
            "strategy": {"class_path": "lightning_persia.PersiaStrategy", "init_args": strategy},
        },
        # `steps` batches per rank; the validation batches are dealt to the ranks
        "data": {"init_args": {"num_train_batches": steps * num_nodes * devices, "batch_size": batch_size,
                               "num_val_batches": val_batches}},
    }
    path.write_text(json.dumps(overlay, indent=1))  # JSON is YAML


def read_auc(out: Path) -> float:
    """The last ``val_auc`` of a run's CSVLogger file."""
    files = sorted(out.glob("log/version_*/metrics.csv"))
    if not files:
        raise MultihostError(f"no metrics.csv under {out}/log: the run logged no validation")
    with open(files[-1], newline="") as f:
        values = [float(row["val_auc"]) for row in csv.DictReader(f) if row.get("val_auc")]
    if not values:
        raise MultihostError(f"{files[-1]} holds no val_auc")
    return values[-1]


def where(net: HostNetwork, token: str) -> List[Dict[str, object]]:
    """Every process running in each host now: host, namespace, address, pid, command (the token masked)."""
    rows = []
    for host in net.hosts:
        for pid in net.pids(host):
            try:
                argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
            except OSError:
                continue
            rows.append({"host": host, "namespace": net.namespaces[host], "address": net.address(host), "pid": pid,
                         "command": _describe(argv).replace(token, "***")})
    return rows


def _describe(argv: List[str]) -> str:
    """A command line as a person would write it: console scripts by name, the supervisor loop by what it runs."""
    if argv[:2] == ["bash", "-c"] and len(argv) > 3 and argv[2] == SUPERVISOR:
        return "supervisor loop (bash), restarts: " + _describe(argv[4:])
    if len(argv) > 1 and os.path.basename(argv[0]).startswith("python") and argv[1].endswith(("lightning-persia", "torchrun")):
        argv = argv[1:]
    words = [os.path.basename(argv[0]), *argv[1:]]
    words = ["lightning-persia" if w.endswith("/lightning-persia") else w for w in words]
    return " ".join(words)


def run_multihost(args: argparse.Namespace, out: Path, token: str, kill: bool) -> Dict[str, object]:
    """The four-host run (``kill``: shard 3 SIGKILLed after the first checkpoint); its figures and what ran where."""
    hosts = [*PS_HOSTS, *TRAINER_HOSTS]
    base_env = {**os.environ, "PYTHONPATH": str(_ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                TOKEN_ENV: token, "GLOO_SOCKET_IFNAME": HostNetwork.INTERFACE}
    processes: List[_Process] = []
    result: Dict[str, object] = {}
    with HostNetwork(hosts) as net:
        try:
            serve = executable("lightning-persia")
            addresses = []
            shards: Dict[int, _Process] = {}
            for h, host in enumerate(PS_HOSTS):
                for k in range(SHARDS_PER_HOST):
                    index = h * SHARDS_PER_HOST + k
                    address = f"{net.address(host)}:{SHARD_PORT + k}"
                    addresses.append(address)
                    command = [serve, "ps", "serve", "--host", net.address(host), "--port", str(SHARD_PORT + k),
                               "--shard-index", str(index), "--num-shards", str(len(PS_HOSTS) * SHARDS_PER_HOST),
                               "--token", token, "torch_threads=1", f"server_threads={4 + len(TRAINER_HOSTS)}"]
                    env = {**base_env, "PIDFILE": str(out / f"shard{index}.pid")}
                    shards[index] = _Process(f"shard-{index}", net.run_in(host, ["bash", "-c", SUPERVISOR, "supervisor", *command]),
                                             out / f"shard{index}.log", env)
                    processes.append(shards[index])
            deadline = time.monotonic() + args.timeout
            for index, process in shards.items():
                while not process.listening:
                    if process.popen.poll() is not None or time.monotonic() > deadline:
                        raise MultihostError(f"shard {index} did not start:\n{process.tail()}")
                    time.sleep(0.1)
                if process.listening[0] != addresses[index]:
                    raise MultihostError(f"shard {index} listens on {process.listening[0]}, not {addresses[index]}")

            overlay = out / "multihost.yaml"
            write_overlay(overlay, num_nodes=len(TRAINER_HOSTS), devices=1, steps=args.steps, batch_size=args.batch_size,
                          staleness=args.staleness, out=out, ps_addresses=addresses,
                          checkpoint_every=args.checkpoint_every if kill else 0, val_batches=args.val_batches)
            master = net.address(TRAINER_HOSTS[0])
            trainers = []
            started = time.monotonic()
            for node, host in enumerate(TRAINER_HOSTS):
                command = [executable("torchrun"), "--nnodes", str(len(TRAINER_HOSTS)), "--node-rank", str(node),
                           "--nproc-per-node", "1", "--master-addr", master, "--master-port", str(MASTER_PORT),
                           "--no-python", serve, "fit", "--config", "examples/dlrm/config.yaml", "--config", str(overlay)]
                trainers.append(_Process(f"trainer-{node}", net.run_in(host, command), out / f"trainer{node}.log", base_env))
                processes.append(trainers[-1])

            killed = None
            snapshot: List[Dict[str, object]] = []
            while any(t.popen.poll() is None for t in trainers):
                if time.monotonic() - started > args.timeout:
                    raise MultihostError(f"the trainers did not finish within {args.timeout:.0f} s:\n"
                                         + "\n".join(t.tail(15) for t in trainers))
                if not snapshot and all(len(net.pids(h)) >= 2 for h in TRAINER_HOSTS):  # torchrun and its rank
                    snapshot = where(net, token)
                if kill and killed is None and list((out / "ckpt").glob("*.ckpt")):
                    pid = int((out / f"shard{KILLED_SHARD}.pid").read_text())
                    os.kill(pid, signal.SIGKILL)
                    killed = {"shard": KILLED_SHARD, "host": PS_HOSTS[KILLED_SHARD // SHARDS_PER_HOST], "pid": pid,
                              "after_s": round(time.monotonic() - started, 1)}
                time.sleep(0.05)
            seconds = time.monotonic() - started
            for trainer in trainers:
                if trainer.popen.returncode != 0:
                    raise MultihostError(f"{trainer.name} exited with status {trainer.popen.returncode}:\n{trainer.tail()}")
            result = {"auc": read_auc(out), "seconds": round(seconds, 1), "where": snapshot or where(net, token),
                      "shard_addresses": addresses, "master": f"{master}:{MASTER_PORT}"}
            if kill:
                result["killed"] = killed
                result["rollbacks"] = sum("PersiaStrategy: rolled back to" in line for line in trainers[0].lines)  # rank 0's
                result["shard_restarts"] = sum(1 for line in shards[KILLED_SHARD].lines if line.startswith("supervisor: shard pid"))
                result["listening_after_restart"] = shards[KILLED_SHARD].listening[1:]
        finally:
            for process in reversed(processes):
                process.stop()
    return result


def run_single_host(args: argparse.Namespace, out: Path) -> Dict[str, object]:
    """The same training with 2 ranks on this host (Lightning's launcher) and 4 embedded shards."""
    overlay = out / "single.yaml"
    write_overlay(overlay, num_nodes=1, devices=len(TRAINER_HOSTS), steps=args.steps, batch_size=args.batch_size,
                  staleness=args.staleness, out=out, ps_addresses=None, checkpoint_every=0, val_batches=args.val_batches)
    env = {**os.environ, "PYTHONPATH": str(_ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    started = time.monotonic()
    process = _Process("single", [executable("lightning-persia"), "fit", "--config", "examples/dlrm/config.yaml",
                                  "--config", str(overlay)], out / "single.log", env)
    try:
        status = process.popen.wait(args.timeout)
    except subprocess.TimeoutExpired:
        raise MultihostError(f"the single-host run did not finish within {args.timeout:.0f} s:\n{process.tail()}") from None
    finally:
        process.stop()
    if status != 0:
        raise MultihostError(f"the single-host run exited with status {status}:\n{process.tail()}")
    return {"auc": read_auc(out), "seconds": round(time.monotonic() - started, 1)}


def print_report(args: argparse.Namespace, multi: Dict[str, object], killed: Optional[Dict[str, object]], single: Dict[str, object]) -> None:
    print(f"{args.steps} steps of 2 x {args.batch_size} rows, staleness {args.staleness}, {args.val_batches} validation "
          f"batches; load average {os.getloadavg()[0]:.2f} at the end")
    print("\nwhat ran where (ip netns pids, while training):")
    print(f"{'host':<10} {'namespace':<15} {'address':<14} {'pid':>7}  command")
    for row in multi["where"]:
        print(f"{row['host']:<10} {row['namespace']:<15} {row['address']:<14} {row['pid']:>7}  {row['command']}")
    print(f"\nps.addresses: {', '.join(multi['shard_addresses'])}; torchrun rendezvous at {multi['master']}")
    print("\n| run | val AUC | seconds |\n|---|---|---|")
    print(f"| 2 trainer hosts x 1 rank, 2 PS hosts x 2 shards | {multi['auc']:.5f} | {multi['seconds']} |")
    if killed is not None:
        print(f"| the same, shard {KILLED_SHARD} SIGKILLed after the first checkpoint | {killed['auc']:.5f} | {killed['seconds']} |")
    print(f"| 1 host, 2 ranks, 4 embedded shards | {single['auc']:.5f} | {single['seconds']} |")
    print(f"\nAUC, multi-host minus single host: {multi['auc'] - single['auc']:+.5f}")
    if killed is not None:
        event = killed["killed"]
        if event is None:
            print("kill: training ended before the first checkpoint; nothing was killed")
        else:
            print(f"kill: SIGKILL to shard {event['shard']} (pid {event['pid']}) on {event['host']} {event['after_s']} s into "
                  f"training; its supervisor started it again {killed['shard_restarts']} time(s) (listening on "
                  f"{', '.join(killed['listening_after_restart'])}); the trainers rolled back {killed['rollbacks']} time(s) "
                  "(the steps since the checkpoint are lost, hence another AUC)")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps (each rank: one batch a step)")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per batch and rank")
    parser.add_argument("--staleness", type=int, default=0, help="0 (default): both runs train the same model, whatever "
                        "the timing; with more, which updates a lookup misses depends on timing, and so does the AUC")
    parser.add_argument("--val-batches", type=int, default=25, help="validation batches (all ranks together)")
    parser.add_argument("--kill", action="store_true", help="then a multi-host run in which shard 3 is SIGKILLed once the first checkpoint exists")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="with --kill: checkpoint period in steps (default steps // 4)")
    parser.add_argument("--no-single-host", action="store_true", help="skip the single-host run")
    parser.add_argument("--out", help="keep configs, logs and checkpoints here (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each run may take")
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.val_batches < 2 or args.staleness < 0:
        parser.error("--steps and --batch-size must be >= 1, --val-batches >= 2 (one per rank), --staleness >= 0")
    args.checkpoint_every = args.checkpoint_every or max(1, args.steps // 4)
    return args


def _raise_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        check_requirements()
    except MultihostError as err:
        print(f"multihost: {err}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_on_sigterm)  # SIGINT already raises KeyboardInterrupt: cleanup runs either way
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="multihost-"))
    try:
        for name in ("multi", "killed", "single"):
            (work / name).mkdir(parents=True, exist_ok=True)
        multi = run_multihost(args, work / "multi", token=secrets.token_hex(16), kill=False)
        killed = run_multihost(args, work / "killed", token=secrets.token_hex(16), kill=True) if args.kill else None
        single = {"auc": float("nan"), "seconds": 0.0} if args.no_single_host else run_single_host(args, work / "single")
    except (MultihostError, NetemError) as err:
        print(f"multihost: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("multihost: interrupted; processes and namespaces removed", file=sys.stderr)
        return 130
    finally:
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)
    print_report(args, multi, killed, single)
    if args.json:
        summary = {"multihost_auc": multi["auc"], "single_host_auc": single["auc"], "auc_difference": multi["auc"] - single["auc"],
                   "multihost_seconds": multi["seconds"], "single_host_seconds": single["seconds"], "where": multi["where"]}
        if killed is not None:
            summary["kill"] = {k: killed[k] for k in ("auc", "seconds", "killed", "rollbacks", "shard_restarts", "listening_after_restart")}
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
