"""Smoke tests of benchmarks/trainer/train_bench.py: a tiny run end to end, and the emulated network's plumbing."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.common.netem import EmulatedNetwork, NetemError, _burst_bytes, parse_netem

ROOT = Path(__file__).resolve().parents[3]
MODULE = "benchmarks.trainer.train_bench"

REQUIRED = ("local_samples_per_s", "sync_samples_per_s", "hybrid_samples_per_s", "auc_local", "auc_sync", "auc_hybrid")


@pytest.mark.scenario  # minutes of processes: CI's scenario step (`make scenarios`), not `make test`
def test_tiny_run_reports_every_figure(tmp_path):
    """1 rank, batch 256, 6 steps of local, sync and hybrid (τ=2) on tiny tables, two rounds, the small tables kept
    on the trainer: the JSON has every figure, and --trace a section for each run."""
    command = [
        sys.executable, "-m", MODULE, "--json", "--steps", "6", "--warmup", "2", "--window", "2", "--batch-size", "256",
        "--test-batches", "2", "--ranks", "1", "--staleness", "2", "--cardinality-scale", "0.001",
        "--cache-dir", str(tmp_path / "cache"), "--profile", "--timeout", "120", "--repeat", "2", "--data-parallel-max-rows", "20",
        "--trace", str(tmp_path / "trace.txt"),
    ]
    start = time.monotonic()
    # A guard against a hang, not a speed check: each PersiaStrategy run also starts its embedding worker (a fresh
    # interpreter), and on 2 busy cores the whole command took 154 s without workers and 176 s with them.
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    for key in REQUIRED:
        assert isinstance(summary[key], float) and summary[key] > 0, (key, summary[key])
    assert summary["hybrid_vs_local"] > 0 and summary["hybrid_vs_sync"] > 0
    assert {r["name"] for r in summary["runs"]} == {"local", "sync", "hybrid-2"}
    assert all(len(r["samples_per_s_runs"]) == 2 and len(r["auc_runs"]) == 2 for r in summary["runs"])
    profile = next(r["profile"] for r in summary["runs"] if r["name"] == "hybrid-2")
    assert profile["step"] > 0 and profile["cpu_total"] > 0
    assert "where a step's time goes" in done.stdout
    trace = (tmp_path / "trace.txt").read_text()
    assert trace.count("profiled steps") == 6 and trace.count("Self CPU %") == 6  # each run's waits, then its ops
    print(f"smoke run took {time.monotonic() - start:.0f} s")


@pytest.mark.scenario  # minutes of processes: CI's scenario step (`make scenarios`), not `make test`
def test_grow_stops_at_its_row_count_and_compares_the_ends():
    """--grow on tiny batches: windows until the shards hold 150k rows, then the first and last windows compared."""
    command = [sys.executable, "-m", MODULE, "--grow", "--grow-rows", "1.5e5", "--grow-batch-size", "512", "--window", "2",
               "--shards", "1", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    windows = summary["windows"]
    assert len(windows) >= 2 and windows[-1]["ps_rows"] >= 150_000 > windows[-2]["ps_rows"]
    assert [w["ps_rows"] for w in windows] == sorted(w["ps_rows"] for w in windows)
    assert all(w["samples_per_s"] > 0 and w["cpu_s_per_1k_samples"] > 0 and w["ps_rss_bytes"] > 0 for w in windows)
    assert summary["grow_last_vs_first"] > 0 and summary["grow_cpu_last_vs_first"] > 0


@pytest.mark.parametrize("argv,message", [
    (["--repeat", "0"], "--repeat must be >= 1"),
    (["--steps", "10", "--warmup", "5", "--window", "10"], "must cover --warmup"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    from benchmarks.trainer import train_bench

    with pytest.raises(SystemExit):
        train_bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_quick_is_described_one_way_and_runs_as_described(capsys):
    from benchmarks.trainer import train_bench

    args = train_bench.parse_args(["--quick"])
    assert (args.no_local, args.ranks, args.staleness, args.steps, args.repeat) == (False, [1], [4], 40, 1)
    with pytest.raises(SystemExit):
        train_bench.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--quick local, sync and hybrid τ=4 on 1 rank, 40 steps, 1 round (about 1.5 min)" in help_text
    assert help_text.count("40 steps") == 1  # the usage examples at the top point to it instead of describing it again


def test_repeats_merge_into_medians():
    from benchmarks.trainer import train_bench

    runs = [dict(samples_per_s=v, auc=a, name="sync", profile={"step": v}) for v, a in ((30.0, 0.70), (10.0, 0.72), (20.0, 0.71))]
    merged = train_bench.merge_repeats(runs)
    assert merged["samples_per_s"] == 20.0 and merged["auc"] == 0.71 and merged["profile"] == {"step": 20.0}
    assert merged["samples_per_s_runs"] == [30.0, 10.0, 20.0]
    untimed = train_bench.merge_repeats([dict(samples_per_s=None, auc=0.7, name="sync")])
    assert untimed["samples_per_s"] is None and untimed["auc"] == 0.7


def test_netem_argument_parsing():
    assert parse_netem("1,10gbit") == (1.0, "10gbit")
    assert parse_netem("0.5") == (0.5, "")
    with pytest.raises(NetemError, match="DELAY_MS"):
        parse_netem("fast")
    assert _burst_bytes("10gbit") == 5_000_000  # 4 ms at 1.25 GB/s
    assert _burst_bytes("1mbit") == 1 << 16


def test_delay_proxy_adds_its_delay_each_way():
    """The forwarder that stands in for netem's delay holds each chunk ~delay ms in each direction."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    proxy = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "common" / "delay_proxy.py"), "--delay-ms", "20", f"127.0.0.1:0=127.0.0.1:{port}"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proxy.stdout.readline()
        assert line.startswith("DELAY_PROXY_READY"), line
        with socket.create_connection(("127.0.0.1", int(line.split()[1]))) as conn:
            times = []
            for _ in range(3):
                start = time.perf_counter()
                conn.sendall(b"x" * 1000)
                received = b""
                while len(received) < 1000:
                    received += conn.recv(65536)
                times.append(time.perf_counter() - start)
        assert 0.035 < min(times) < 0.5, times  # 2 x 20 ms
    finally:
        proxy.terminate()
        proxy.wait(10)
        server.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None, reason="builds network namespaces: needs root and iproute2 (ip, tc), which a non-root or minimal machine lacks")
def test_emulated_network_is_removed_on_close():
    net = EmulatedNetwork(1.0, "1gbit", name=f"pbt{os.getpid() % 10000}")
    try:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert net.trainer_ns in names and net.ps_ns in names
        assert ("netem" in net.qdisc()) != net.delay_by_proxy
        reach = subprocess.run(net.in_trainer_ns(["ip", "route", "get", net.ps_ip]), capture_output=True, text=True)
        assert reach.returncode == 0, reach.stderr
    finally:
        net.close()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.trainer_ns not in names and net.ps_ns not in names
