"""`lightning-persia serve` in its own process, called over HTTP: answers, 400s that name the field, batching, SIGTERM."""
from __future__ import annotations

import copy
import json
import math
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from endpoint_client import Server, free_port, predict, request


def _group_alive(pgid: int) -> list[str]:
    listing = subprocess.run(["ps", "-o", "stat=,pid=,cmd=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if line.strip() and not line.strip().startswith("Z")]


@pytest.fixture(scope="module")
def server(bundle):
    """``lightning-persia serve BUNDLE`` (embedded read-only shards; batches of up to 8 requests gathered for 20 ms)."""
    served = Server(bundle.path, "--max-batch-size", "8", "--batch-timeout", "0.02")
    yield served.process, served.port
    served.kill()


def test_predict_answers_as_trainer_predict_with_the_bundle_version(server, trained):
    _, port = server
    requests, expected = trained.expected["requests"], trained.expected["flat_scores"]
    with ThreadPoolExecutor(16) as pool:  # concurrent clients: LitServe batches their rows
        answers = list(pool.map(lambda body: predict(port, body), requests))
    for (status, answer), score in zip(answers, expected):
        assert status == 200, answer
        assert answer["version"] == 1
        assert math.isclose(answer["score"], score, abs_tol=1e-6), (answer, score)
    assert request(port, "GET", "/info")[1]["model"]["bundle_version"] == 1


def _without(body: dict, feature: str) -> dict:
    body = copy.deepcopy(body)
    del body["sparse"][feature]
    return body


def _with(body: dict, path: tuple, value: Any) -> dict:
    body = copy.deepcopy(body)
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


def _malformed(good: dict) -> list[tuple[Any, str]]:
    """(request body, what the 400's message must say)."""
    return [
        (b'{"sparse": {"cat_0": [1]', "body: not valid JSON"),
        (b"[1, 2, 3]", "body: must be a JSON object"),
        (_without(good, "cat_1"), "sparse.cat_1: missing feature"),
        (_with(good, ("dense",), good["dense"][:-1]), "dense: 2 numbers, the model takes 3"),
        (_with(good, ("sparse", "cat_0"), [4, 2.5]), "sparse.cat_0[1]: 2.5 is not an integer id"),
        (_with(good, ("sparse", "cat_2"), ["7"]), "sparse.cat_2[0]: '7' is not an integer id"),
        (_with(good, ("sparse", "cat_9"), [1]), "sparse.cat_9: unknown feature"),
        (_with(good, ("dense", 0), None), "dense[0]: None is not a finite number"),
    ]


def test_malformed_requests_get_400_naming_the_field_and_the_next_request_succeeds(server, trained):
    _, port = server
    good, score = trained.expected["requests"][5], trained.expected["flat_scores"][5]
    for body, message in _malformed(good):
        status, answer = predict(port, body)
        assert status == 400 and message in answer["detail"], (body, answer)
        status, answer = predict(port, good)
        assert status == 200 and math.isclose(answer["score"], score, abs_tol=1e-6)
    status, answer = request(port, "POST", "/predict", json.dumps(good).encode(), content_type="application/x-www-form-urlencoded")
    assert status == 400 and "application/json" in answer["detail"]


def test_a_malformed_request_fails_alone_in_its_batch(server, trained):
    _, port = server
    requests, expected = trained.expected["requests"][:16], trained.expected["flat_scores"][:16]
    bad = [body for body, _ in _malformed(requests[0]) if not isinstance(body, bytes)]  # decoded in the worker, batched
    mixed = [item for pair in zip(requests, bad + bad) for item in pair]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda body: predict(port, body), mixed))
    for (status, answer), score in zip(answers[0::2], expected):
        assert status == 200 and math.isclose(answer["score"], score, abs_tol=1e-6), answer
    assert all(status == 400 for status, _ in answers[1::2])


def test_sigterm_stops_the_server_its_workers_and_its_shards(server):
    process, port = server
    assert len(_group_alive(process.pid)) >= 4  # the server, its HTTP and inference workers, two shards
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    deadline = time.monotonic() + 30
    while _group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _group_alive(process.pid) == []


def test_serving_a_folder_that_is_no_bundle_fails_with_status_2(tmp_path, capsys):
    from lightning_persia import cli

    assert cli.main(["serve", str(tmp_path), "--port", str(free_port())]) == 2
    assert f"lightning-persia serve: error: {tmp_path} is not a serving bundle" in capsys.readouterr().err
