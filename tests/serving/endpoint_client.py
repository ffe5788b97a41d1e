"""`lightning-persia serve` in its own process group, and the HTTP calls the endpoint tests make to it."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Optional

from tiny_dlrm import ROOT, serving_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, method: str, path: str, body: Optional[bytes] = None, content_type: str = "application/json") -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": content_type} if body is not None else {})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data.decode()


def predict(port: int, payload: Any) -> tuple[int, Any]:
    return request(port, "POST", "/predict", payload if isinstance(payload, bytes) else json.dumps(payload).encode())


class Server:
    """``lightning-persia serve BUNDLE *args`` on a free port, healthy; its output (server, worker, shards) kept in :attr:`lines`."""

    def __init__(self, bundle, *args: str, timeout_s: float = 180) -> None:
        self.port = free_port()
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lightning_persia.cli", "serve", str(bundle), "--port", str(self.port), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=serving_env(), cwd=ROOT, start_new_session=True,
        )
        threading.Thread(target=lambda: self.lines.extend(line.rstrip("\n") for line in self.process.stdout), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, "\n".join(self.lines[-50:])
            try:
                if request(self.port, "GET", "/health") == (200, "ok"):
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy in time:\n" + "\n".join(self.lines[-50:])
            time.sleep(0.5)

    def wait_for_line(self, text: str, timeout_s: float = 60) -> str:
        """The first output line holding ``text`` (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [line for line in list(self.lines) if text in line]
            if found:
                return found[0]
            time.sleep(0.1)
        raise AssertionError(f"no output line with {text!r}; the last lines:\n" + "\n".join(self.lines[-30:]))

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
