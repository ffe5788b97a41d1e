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

:class:`HostNetwork` is the other shape: N namespaces, each a host with its own address, on one Linux bridge
(in a switch namespace of its own), for runs launched the way a cluster launches them (``benchmarks/cluster/multihost.py``)::

    with HostNetwork(["ps-0", "ps-1", "trainer-0", "trainer-1"]) as hosts:
        subprocess.Popen(hosts.run_in("ps-0", ["lightning-persia", "ps", "serve", "--host", hosts.address("ps-0"), ...]))
"""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Deque, Dict, List, Optional, Sequence

from lightning_persia.remote_ps.launcher import read_listening_address, stop_processes
from lightning_persia.remote_ps.protocol import TOKEN_ENV


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


def _check_tools(what: str) -> None:
    if os.geteuid() != 0:
        raise NetemError(f"{what} needs root (it creates network namespaces)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetemError(f"{what} needs `{tool}` (apt-get install iproute2)")


def _namespaces() -> List[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


class HostNetwork:
    """Hosts as Linux network namespaces, each with one address on a shared bridge; removed by :meth:`close`.

    Host ``i`` is namespace ``<prefix><pid>-h<i>`` with interface ``eth0`` at ``10.215.<x>.<i + 1>/24`` (and its
    own loopback); every ``eth0`` is one end of a veth pair whose other end is a port of bridge ``br0`` in the
    namespace ``<prefix><pid>-sw``. Nothing in the root namespace changes. Namespaces of an earlier run of this
    class whose process is gone (killed before it could clean up) are removed first.

    :meth:`close` stops what still runs inside a host (SIGTERM, SIGKILL after ``grace_s``) before it deletes the
    namespaces: a namespace outlives its name while a process holds it.
    """

    PREFIX = "lpmh"
    INTERFACE = "eth0"

    def __init__(self, hosts: Sequence[str]) -> None:
        _check_tools("a multi-host run")
        if not hosts or len(set(hosts)) != len(hosts) or len(hosts) > 250:
            raise NetemError(f"HostNetwork needs 1..250 distinct host names, got {list(hosts)}")
        self._remove_orphans()
        tag = f"{self.PREFIX}{os.getpid()}"
        self.switch = f"{tag}-sw"
        self.hosts = list(hosts)
        self.namespaces: Dict[str, str] = {host: f"{tag}-h{i}" for i, host in enumerate(self.hosts)}
        subnet = f"10.215.{os.getpid() % 250 + 1}"
        self.addresses: Dict[str, str] = {host: f"{subnet}.{i + 1}" for i, host in enumerate(self.hosts)}
        self._closed = False
        try:
            _run("ip", "netns", "add", self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                ns, port = self.namespaces[host], f"p{i}"
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "link", "add", f"{tag[-9:]}h{i}", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
                _run("ip", "-n", ns, "link", "set", f"{tag[-9:]}h{i}", "name", self.INTERFACE)
                _run("ip", "-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", self.INTERFACE)
                _run("ip", "-n", ns, "link", "set", self.INTERFACE, "up")
                _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.switch, "link", "set", port, "up")
        except BaseException:
            self.close()
            raise

    @classmethod
    def _remove_orphans(cls) -> None:
        for ns in _namespaces():
            match = re.fullmatch(rf"{cls.PREFIX}(\d+)-(sw|h\d+)", ns)
            if match and not os.path.exists(f"/proc/{match.group(1)}"):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def address(self, host: str) -> str:
        return self.addresses[host]

    def run_in(self, host: str, command: Sequence[str]) -> List[str]:
        """``command`` as it runs inside ``host`` (``ip netns exec`` replaces itself by the command)."""
        return ["ip", "netns", "exec", self.namespaces[host], *command]

    def pids(self, host: str) -> List[int]:
        """Processes running inside ``host`` now."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[host]], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def close(self, grace_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = [pid for host in self.hosts for pid in self.pids(host)]
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while left and time.monotonic() < deadline and any(self.pids(host) for host in self.hosts):
                time.sleep(0.1)
        for ns in [*self.namespaces.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __enter__(self) -> "HostNetwork":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EmulatedNetwork:
    """The two namespaces and the shaped veth pair between them; removed by :meth:`close` (idempotent)."""

    def __init__(self, delay_ms: float, rate: str = "", name: Optional[str] = None, limit_packets: int = 100_000) -> None:
        _check_tools("--netem")
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

    Like :class:`lightning_persia.remote_ps.launcher.LocalShards`: each shard gets
    ``cpu_count // (num_shards + 1)`` torch threads and passive OpenMP waits, and exits with this process.
    """

    def __init__(self, net: EmulatedNetwork, num_shards: int, token: str, overrides: Sequence[str], threads: Optional[int]) -> None:
        self.processes: List[subprocess.Popen] = []
        self.addresses: List[str] = []
        self._logs: List[Deque[str]] = []
        threads = threads or max(1, (os.cpu_count() or 1) // (num_shards + 1))
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, TOKEN_ENV: token}  # token via env, not argv
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
