"""What a user sees when the strategy cannot start: the error that stopped it, as the last line, unmasked.

Each case runs the console entry (``lightning-persia fit`` on the DLRM example) as a subprocess, as a user does,
with short timeouts. Before, every case ended with the teardown's ``NotImplementedError: Cannot copy out of
meta tensor`` (the tables, never swapped, are still on ``meta``) and the real error was buried above it.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_persia.remote_ps.config import load_ps_config
from lightning_persia.remote_ps.protocol import ADDRESSES_ENV, TOKEN_ENV
from lightning_persia.remote_ps.server import Endpoint, ShardServer
from lightning_persia.remote_ps.store import ShardStore

ROOT = Path(__file__).resolve().parents[2]
FIT = [sys.executable, "-m", "lightning_persia.cli", "fit", "--config", "examples/dlrm/config.yaml", "--trainer.max_steps=1"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _fit(*args: str) -> tuple[int, list[str]]:
    done = subprocess.run([*FIT, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    return done.returncode, (done.stdout + done.stderr).splitlines()


def _last(lines: list[str]) -> str:
    return [line for line in lines if line.strip()][-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_shard_is_reported_while_waiting_and_ends_the_output():
    port = _free_port()
    rc, lines = _fit(f"--trainer.strategy.init_args.ps.addresses=[127.0.0.1:{port}]", "--trainer.strategy.init_args.ps.timeout_s=3")
    text = "\n".join(lines)
    assert rc == 1
    assert re.search(rf"ShardUnavailableError: shard 0 at 127\.0\.0\.1:{port} did not answer after \d+ tries over [\d.]+ s: UNAVAILABLE", _last(lines))
    assert f"PersiaStrategy: waiting for parameter-server shard 0 at 127.0.0.1:{port}: 2 s of ps.timeout_s=3 so far (UNAVAILABLE" in text
    assert "meta tensor" not in text and "During handling" not in text


def test_a_wrong_token_ends_the_output_with_the_shard_s_answer():
    shard = ShardServer(ShardStore(0, 1), load_ps_config(None, []), Endpoint(token="the-right-one"))
    address = shard.start()
    try:
        rc, lines = _fit(f"--trainer.strategy.init_args.ps.addresses=[{address}]",
                         "--trainer.strategy.init_args.ps.token=a-wrong-one", "--trainer.strategy.init_args.ps.timeout_s=3")
    finally:
        shard.stop(grace_s=1)
    text = "\n".join(lines)
    assert rc == 1
    assert _last(lines).endswith(f"PSRequestError: shard 0 at {address} answered UNAUTHENTICATED: wrong token")
    assert "meta tensor" not in text and "During handling" not in text


def test_ctrl_c_while_the_embedded_shards_start_shuts_down_quietly_and_stops_them():
    process = subprocess.Popen(FIT, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # its own process group, as a terminal's foreground job
    lines: list[str] = []
    starting = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if "PersiaStrategy: starting 2 embedded parameter-server shards" in line:
                starting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert starting.wait(120), "\n".join(lines)
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C sends: the trainer and the shards it is starting
        assert process.wait(120) == 1
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(10)
    text = "\n".join(lines)
    assert "embedded parameter server (shards started here)" not in text  # interrupted before the shards answered
    assert _last(lines) == "Detected KeyboardInterrupt, attempting graceful shutdown ..."
    assert "Traceback" not in text
    assert _shards_of(process.pid, within_s=10) == []


def _shards_of(pid: int, within_s: float) -> list[int]:
    """Pids of the shard processes still running that ``pid`` started (``--parent-pid pid``)."""
    marker = f"--parent-pid\0{pid}\0".encode()
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes():
                    alive.append(int(entry.name))
            except OSError:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.fixture(autouse=True)
def _no_addresses_from_the_environment(monkeypatch):
    monkeypatch.delenv(ADDRESSES_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def test_a_failing_cleanup_is_reported_and_the_start_s_error_still_raised(monkeypatch, caplog):
    """In-process: a failure of the cleanup after a failed start is a warning; the start's error is what fit raises."""
    import lightning as L

    from lightning_persia import PersiaStrategy, PSSettings
    from lightning_persia.remote_ps.client import PSClient, ShardUnavailableError
    from toy import ToyRecommender, loader, make_batches

    real_close, clients = PSClient.close, []

    def broken_close(self) -> None:
        clients.append(self)
        raise RuntimeError("the channel would not close")

    monkeypatch.setattr(PSClient, "close", broken_close)
    port = _free_port()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        strategy=PersiaStrategy(ps=PSSettings(addresses=[f"127.0.0.1:{port}"], timeout_s=1)))
    with pytest.raises(ShardUnavailableError, match=rf"shard 0 at 127\.0\.0\.1:{port} did not answer"):
        trainer.fit(ToyRecommender(device="meta"), loader(make_batches(2)))
    assert "PersiaStrategy: cleaning up after ShardUnavailableError failed: RuntimeError: the channel would not close" in caplog.text
    assert trainer.strategy.client is None
    for client in clients:
        real_close(client)
