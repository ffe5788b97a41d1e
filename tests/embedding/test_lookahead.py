"""The prefetcher issues a hybrid lookup just early enough to hide its latency, never beyond the staleness bound."""
from __future__ import annotations

import threading

import pytest
import torch

from lightning_persia.embedding.worker import EmbeddingWorker, _Step


def _worker(staleness: int) -> EmbeddingWorker:
    return EmbeddingWorker(client=None, staleness=staleness, wire_dtype="fp32", device=torch.device("cpu"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "staleness, lookup_s, update_s, step_s, expected",
    [
        (0, None, None, None, 0), (4, None, None, None, 1), (4, 0.05, None, 0.1, 1), (4, 0.25, None, 0.1, 3),
        (4, 1.0, None, 0.1, 4), (1, 1.0, None, 0.1, 1),
        (4, 0.04, 0.04, 0.1, 1), (4, 0.095, 0.094, 0.146, 2), (8, 0.25, 0.25, 0.1, 6),  # the update's ack counts too
    ],
)
def test_lookahead_hides_the_measured_latencies_within_the_bound(staleness, lookup_s, update_s, step_s, expected):
    worker = _worker(staleness)
    worker.lookup_seconds, worker.update_seconds, worker.step_seconds = lookup_s, update_s, step_s
    assert worker.lookahead() == expected


def test_a_lookup_waits_until_the_trainer_is_lookahead_steps_away():
    worker = _worker(staleness=4)  # nothing measured yet: lookahead 1
    step = _Step(2)  # no planned rows: issuing only passes the gate and the window
    stop = threading.Event()
    issued = threading.Event()
    thread = threading.Thread(target=lambda: (worker.issue(step, stop), issued.set()), daemon=True)
    thread.start()
    assert not issued.wait(0.3)  # the trainer has begun no step yet
    worker._observe_begin(0)
    assert not issued.wait(0.3)  # step 2 waits for the trainer to begin step 1
    worker._observe_begin(1)
    assert not issued.wait(0.3)  # ... and for the update of step 0 (pushed by now) to be acknowledged
    worker.window.acknowledge(0)
    assert issued.wait(5)
    assert step.lag == 1  # it misses only the update of step 1, which is not computed yet
    thread.join(5)


def test_a_stopped_prefetch_leaves_the_gate():
    worker = _worker(staleness=4)
    stop = threading.Event()
    errors: list = []

    def run() -> None:
        try:
            worker.issue(_Step(5), stop)
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and "stopped before its lookup" in str(errors[0])
