"""A two-namespace emulated network: trainers in one Linux network namespace, PS shards in another.

    [ns <name>-tr]  veth <name>a 10.<x>.<y>.1/30  <==== veth pair ====>  veth <name>b 10.<x>.<y>.2/30  [ns <name>-ps]
                    tc netem delay D rate R                               tc netem delay D rate R

Each direction is shaped by ``tc qdisc ... netem delay D rate R`` on the sending end, so a round trip costs
2 D plus serialisation at rate R. Only addresses inside the two namespaces are used (nothing in the root
namespace changes); each namespace has its own loopback for the trainers' DDP rendezvous. Deleting the
namespaces removes the veth pair with them. Needs root (``ip netns``) and iproute2.

Kernels built without ``netem`` (``CONFIG_NET_SCH_NETEM`` unset; this machine's is one) get the same shape
from two pieces: a ``tbf`` qdisc (token bucket) for the rate on both veth ends, and a user-space forwarder
(:mod:`delay_proxy`) in the shards' namespace in front of every shard that holds each chunk ``D`` ms in each
direction. The trainers then talk to the forwarder's port; the shards still bind the namespace's address
with a token. What the forwarder does not model: TCP's own behaviour over a long path (it terminates TCP,
so windows and acknowledgements see a short path) and its CPU (a few % of a core at these rates).

Example::

    with EmulatedNetwork(delay_ms=1.0, rate="10gbit") as net, net.shards(2, token="t") as shards:
        subprocess.run(net.in_trainer_ns(["python", "train.py"]), ...)   # connects to shards.addresses
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Deque, List, Optional, Sequence

from lightning_persia.remote_ps.server import read_listening_address, stop_processes


class NetemError(RuntimeError):
    pass


def parse_netem(text: str) -> tuple[float, str]:
    """``"1,10gbit"`` -> ``(1.0, "10gbit")``; ``"0.5"`` -> ``(0.5, "")`` (no rate limit)."""
    delay, _, rate = text.partition(",")
    try:
        delay_ms = float(delay)
    except ValueError:
        raise NetemError(f"--netem wants DELAY_MS[,RATE] (e.g. 1,10gbit), got {text!r}") from None
    if delay_ms < 0:
        raise NetemError(f"netem delay must be >= 0 ms, got {delay_ms}")
    return delay_ms, rate.strip()


def _burst_bytes(rate: str) -> int:
    """A token-bucket size for ``rate`` (tc units): 4 ms worth of bytes, at least 64 KiB."""
    units = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
             "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
    text = rate.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            try:
                return max(1 << 16, int(float(text[: -len(unit)]) * units[unit] * 0.004))
            except ValueError:
                break
    return 1 << 22


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise NetemError(f"`{' '.join(command)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


class EmulatedNetwork:
    """The two namespaces and the shaped veth pair between them; removed by :meth:`close` (idempotent)."""

    def __init__(self, delay_ms: float, rate: str = "", name: Optional[str] = None, limit_packets: int = 100_000) -> None:
        if os.geteuid() != 0:
            raise NetemError("--netem needs root (it creates network namespaces)")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise NetemError(f"--netem needs `{tool}` (apt-get install iproute2)")
        self.delay_ms, self.rate = delay_ms, rate
        tag = name or f"pb{os.getpid() % 100000}"
        self.trainer_ns, self.ps_ns = f"{tag}-tr", f"{tag}-ps"
        self._veth_a, self._veth_b = f"{tag}a", f"{tag}b"
        octet = os.getpid() % 250 + 1
        self.trainer_ip, self.ps_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
        self._closed = False
        self.delay_by_proxy = False
        try:
            for ns in (self.trainer_ns, self.ps_ns):
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", self._veth_a, "netns", self.trainer_ns, "type", "veth", "peer", "name", self._veth_b, "netns", self.ps_ns)
            for ns, dev, ip in ((self.trainer_ns, self._veth_a, self.trainer_ip), (self.ps_ns, self._veth_b, self.ps_ip)):
                _run("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
            for ns, dev in ((self.trainer_ns, self._veth_a), (self.ps_ns, self._veth_b)):
                shape = ["delay", f"{delay_ms}ms"] + (["rate", rate] if rate else []) + ["limit", str(limit_packets)]
                try:
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", *shape)
                except NetemError as err:
                    if "unknown" not in str(err):
                        raise
                    self.delay_by_proxy = True  # no netem in this kernel: tbf for the rate, a forwarder for the delay
                    if rate:
                        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                             "burst", str(_burst_bytes(rate)), "latency", "100ms")
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        rate = f", rate {self.rate}" if self.rate else ""
        how = ("tc netem" if not self.delay_by_proxy else
               f"no netem in this kernel: {'tc tbf for the rate, ' if self.rate else ''}a delaying forwarder in front of each shard")
        return (f"emulated network, delay {self.delay_ms:g} ms each way{rate} ({how}); trainers in netns {self.trainer_ns} "
                f"({self.trainer_ip}), shards in netns {self.ps_ns} ({self.ps_ip})")

    def qdisc(self) -> str:
        return _run("ip", "netns", "exec", self.ps_ns, "tc", "qdisc", "show", "dev", self._veth_b).strip()

    def rpc_round_trip_ms(self, addresses: Sequence[str], token: str, calls: int = 20) -> float:
        """Median time of a Stats RPC to every shard at once, measured from the trainers' namespace."""
        code = (
            "import json, statistics, sys, time\n"
            "from lightning_persia.remote_ps.client import PSClient\n"
            "c = PSClient(json.loads(sys.argv[1]), token=sys.argv[2], timeout_s=30)\n"
            "c.wait_healthy(30)\n"
            "ts = []\n"
            f"for _ in range({calls}):\n"
            "    t = time.perf_counter(); c.stats(); ts.append((time.perf_counter() - t) * 1e3)\n"
            "print(statistics.median(ts)); c.close()\n"
        )
        out = _run(*self.in_trainer_ns([sys.executable, "-c", code, json.dumps(list(addresses)), token]))
        return float(out.strip().splitlines()[-1])

    def in_trainer_ns(self, command: Sequence[str]) -> List[str]:
        return ["ip", "netns", "exec", self.trainer_ns, *command]

    def shards(self, num_shards: int, token: str, overrides: Sequence[str] = (), threads: Optional[int] = None) -> "NamespaceShards":
        return NamespaceShards(self, num_shards, token, overrides, threads)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ns in (self.trainer_ns, self.ps_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __enter__(self) -> "EmulatedNetwork":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NamespaceShards:
    """``lightning-persia ps serve`` shards bound to the PS namespace's address, protected by a token.

    Like :class:`lightning_persia.remote_ps.server.LocalShards`: each shard gets
    ``cpu_count // (num_shards + 1)`` torch threads and passive OpenMP waits, and exits with this process.
    """

    def __init__(self, net: EmulatedNetwork, num_shards: int, token: str, overrides: Sequence[str], threads: Optional[int]) -> None:
        self.processes: List[subprocess.Popen] = []
        self.addresses: List[str] = []
        self._logs: List[Deque[str]] = []
        threads = threads or max(1, (os.cpu_count() or 1) // (num_shards + 1))
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PERSIA_PS_TOKEN": token}  # token via env, not argv
        started = threading.Event()
        self._keeper_done = threading.Event()
        errors: list = []

        def keeper() -> None:  # --parent-pid's death signal follows the forking thread: keep it alive
            try:
                for index in range(num_shards):
                    command = ["ip", "netns", "exec", net.ps_ns, sys.executable, "-m", "lightning_persia.cli", "ps", "serve",
                               "--host", net.ps_ip, "--port", "0", "--shard-index", str(index), "--num-shards", str(num_shards),
                               "--parent-pid", str(os.getpid()), f"torch_threads={threads}", *overrides]
                    self.processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env))
            except BaseException as err:
                errors.append(err)
            started.set()
            self._keeper_done.wait()

        threading.Thread(target=keeper, name="netem-shard-keeper", daemon=True).start()
        started.wait()
        try:
            if errors:
                raise errors[0]
            deadline = time.monotonic() + 120
            for index, process in enumerate(list(self.processes)):
                self.addresses.append(self._read_address(index, process, deadline))
            self.shard_addresses = list(self.addresses)
            if net.delay_by_proxy and net.delay_ms > 0:
                self.addresses = self._start_proxy(net, deadline)
        except BaseException:
            self.stop()
            raise

    def _start_proxy(self, net: EmulatedNetwork, deadline: float) -> List[str]:
        """The delaying forwarder, in the PS namespace: one listener per shard on the namespace's address."""
        mappings = [f"{net.ps_ip}:0={address}" for address in self.shard_addresses]
        command = ["ip", "netns", "exec", net.ps_ns, sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay_proxy.py"),
                   "--delay-ms", str(net.delay_ms), *mappings]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.processes.append(process)
        line = ""
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line or line.startswith("DELAY_PROXY_READY"):
                break
        if not line.startswith("DELAY_PROXY_READY"):
            raise NetemError(f"the delaying forwarder did not start: {line.strip() or process.poll()}")
        threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
        ports = line.split()[1].split(",")
        return [f"{net.ps_ip}:{port}" for port in ports]

    def _read_address(self, index: int, process: subprocess.Popen, deadline: float) -> str:
        lines: Deque[str] = collections.deque(maxlen=100)
        self._logs.append(lines)
        address = read_listening_address(process, lines, deadline, thread_name=f"netem-shard-{index}-output")
        if address is None:
            raise NetemError(f"shard {index} in the PS namespace did not start:\n" + "\n".join(lines))
        return address

    def stop(self, timeout_s: float = 15.0) -> None:
        stop_processes(self.processes, timeout_s)
        self._keeper_done.set()

    def __enter__(self) -> "NamespaceShards":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
