"""`lightning-persia serve BUNDLE --deltas DIR` over HTTP: refused deltas keep the last good version serving; training
while serving moves the served version on, every answer computed by the one version it names, none failing."""
from __future__ import annotations

import json
import math
import shutil
import threading
import time
from pathlib import Path

import pytest

from endpoint_client import Server, predict
from lightning_persia.serving.delta import delta_path
from online_run import train_online

# A minute of processes, and the second test goes on from the version the first leaves served: both run in CI's
# scenario step (`make scenarios`), in this order, not in `make test`.
pytestmark = pytest.mark.scenario


@pytest.fixture(scope="module")
def following(bundle, online, tmp_path_factory):
    """The endpoint (two embedded inference shards) following a folder that holds version 2 when it starts."""
    root = tmp_path_factory.mktemp("served") / "deltas"
    root.mkdir()
    shutil.copytree(delta_path(online.deltas, 2), delta_path(root, 2))
    server = Server(bundle.path, "--deltas", str(root), "--watch-interval", "0.2", "--max-batch-size", "8", "--batch-timeout", "0.01")
    yield server, root
    server.kill()


def _publish(online, version: int, root: Path, change=None) -> Path:
    """Puts version ``version`` of ``online`` under ``root`` at once (a copy renamed into place), after ``change(copy)``."""
    staging = root.parent / f"staging-{version}-{time.monotonic_ns()}"
    shutil.copytree(delta_path(online.deltas, version), staging)
    if change is not None:
        change(staging)
    staging.rename(delta_path(root, version))
    return delta_path(root, version)


def _answer(port: int, body: dict) -> tuple[float, int]:
    status, answer = predict(port, body)
    assert status == 200, answer
    return answer["score"], answer["version"]


def _wait_for_version(port: int, body: dict, version: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while _answer(port, body)[1] != version:
        assert time.monotonic() < deadline, f"version {version} was not served in time"
        time.sleep(0.1)


def test_a_refused_delta_leaves_the_last_good_version_serving_until_a_good_one_comes(following, trained, online):
    server, root = following
    body, row = trained.expected["requests"][5], 5
    score, version = _answer(server.port, body)
    assert version == 2 and math.isclose(score, online.flat(2)[row], abs_tol=1e-6)

    def corrupt_a_table_file(folder: Path) -> None:
        table_file = next(folder.glob("tables/shard-00001-of-00002/*.weights.npy"))
        data = bytearray(table_file.read_bytes())
        data[-1] ^= 0xFF  # same size: only its checksum tells
        table_file.write_bytes(bytes(data))

    third = _publish(online, 3, root, corrupt_a_table_file)
    line = server.wait_for_line(f"delta {third} refused, still serving version 2")
    assert f"checkpoint file {third / 'tables' / 'shard-00001-of-00002'}" in line and "is truncated or corrupted" in line
    assert _answer(server.port, body) == (score, 2)

    def from_version_1(folder: Path) -> None:
        manifest = json.loads((folder / "manifest.json").read_text())
        (folder / "manifest.json").write_text(json.dumps({**manifest, "base_version": 1}))

    shutil.rmtree(third)
    _publish(online, 3, root, from_version_1)
    assert "makes version 3 from version 1, not from version 2: out of order" in server.wait_for_line(f"{third / 'manifest.json'} makes version 3")
    shutil.rmtree(third)
    _publish(online, 4, root)
    assert f"{third} is missing, but {delta_path(root, 4)} is there" in server.wait_for_line("version gap")
    assert _answer(server.port, body) == (score, 2)

    _publish(online, 3, root)
    _wait_for_version(server.port, body, 4)
    assert math.isclose(_answer(server.port, body)[0], online.flat(4)[row], abs_tol=1e-6)


class _Clients:
    """Client threads posting the test rows one after the other, each on its own, until stopped; every answer kept."""

    def __init__(self, port: int, bodies: list, count: int) -> None:
        self.answers: list[list[tuple[int, int, dict]]] = [[] for _ in range(count)]  # per client: (row, status, answer)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(port, bodies, i)) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def _run(self, port: int, bodies: list, index: int) -> None:
        row = index * 7
        while not self._stop.is_set():
            status, answer = predict(port, bodies[row % len(bodies)])
            self.answers[index].append((row % len(bodies), status, answer))
            row += 1

    def stop(self) -> list[list[tuple[int, int, dict]]]:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        return self.answers


def test_training_on_two_ranks_while_serving_moves_the_version_on_and_no_request_fails(following, trained, online, tmp_path):
    """The endpoint serves version 4 (the test above); a new 2-rank run publishes versions 5, 6, 7 meanwhile."""
    server, root = following
    bodies = trained.expected["requests"]
    assert _answer(server.port, bodies[0])[1] == 4
    clients = _Clients(server.port, bodies, 4)
    try:
        run = train_online(trained.ckpt, trained.expected["scores"], root, tmp_path, "--devices", "2")
        assert sorted(run.scores) == [1, 5, 6, 7]  # its first version is whole: it applies on top of version 4
        _wait_for_version(server.port, bodies[0], 7)
    finally:
        answers = clients.stop()
    expected = {4: online.flat(4), **{version: run.flat(version) for version in (5, 6, 7)}}
    seen = set()
    for per_client in answers:
        versions = [answer["version"] for _, status, answer in per_client if status == 200]
        assert len(versions) == len(per_client), [a for a in per_client if a[1] != 200][:3]  # no request failed
        assert versions == sorted(versions)  # a client never goes back to an older version
        seen.update(versions)
        for row, _, answer in per_client:  # computed entirely by the version it names
            assert math.isclose(answer["score"], expected[answer["version"]][row], abs_tol=1e-6), (row, answer)
    assert {4, 7} <= seen
    assert any(not math.isclose(a, b, abs_tol=1e-4) for a, b in zip(expected[4], expected[5]))  # the swap changed the scores
