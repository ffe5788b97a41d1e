"""UpdateDeduplicator: each (client id, seq) applied at most once, with a bounded memory."""
from __future__ import annotations

import threading

import pytest

from lightning_persia.remote_ps.exactly_once import ConflictingDuplicateError, StaleSequenceError, UpdateDeduplicator


def run(dedup: UpdateDeduplicator, client_id: str, seq: int, apply, digest=None) -> tuple[int, bool]:
    """``apply()`` within :meth:`UpdateDeduplicator.once`, as the servicer runs an update: ``(result, duplicate)``."""
    with dedup.once(client_id, seq, digest) as attempt:
        if not attempt.duplicate:
            attempt.result = apply()
    return attempt.result, attempt.duplicate


class Counter:
    def __init__(self, fail_first: int = 0) -> None:
        self.calls = 0
        self.fail_first = fail_first

    def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.fail_first:
            raise RuntimeError("apply failed")
        return 10 * self.calls


def test_second_delivery_is_a_duplicate_with_the_first_result():
    dedup, apply = UpdateDeduplicator(), Counter()
    assert run(dedup, "a", 1, apply) == (10, False)
    assert run(dedup, "a", 1, apply) == (10, True)
    assert run(dedup, "b", 1, apply) == (20, False)  # seqs are per client
    assert apply.calls == 2 and dedup.duplicates == 1


def test_retry_during_the_first_apply_waits_for_it():
    dedup = UpdateDeduplicator()
    started, release = threading.Event(), threading.Event()
    calls = []

    def slow() -> int:
        calls.append(1)
        started.set()
        release.wait(10)
        return 7

    first = []
    thread = threading.Thread(target=lambda: first.append(run(dedup, "a", 5, slow)))
    thread.start()
    started.wait(10)
    second = []
    waiter = threading.Thread(target=lambda: second.append(run(dedup, "a", 5, slow)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # blocked on the first attempt
    release.set()
    thread.join(10)
    waiter.join(10)
    assert first == [(7, False)] and second == [(7, True)] and len(calls) == 1


def test_failed_apply_can_be_retried():
    dedup, apply = UpdateDeduplicator(), Counter(fail_first=1)
    with pytest.raises(RuntimeError, match="apply failed"):
        run(dedup, "a", 1, apply)
    assert run(dedup, "a", 1, apply) == (20, False)
    assert run(dedup, "a", 1, apply) == (20, True)


def test_waiter_reapplies_when_the_first_attempt_fails():
    dedup = UpdateDeduplicator()
    started, release = threading.Event(), threading.Event()
    calls = []

    def flaky() -> int:
        calls.append(1)
        if len(calls) == 1:
            started.set()
            release.wait(10)
            raise RuntimeError("first attempt failed")
        return 3

    errors, results = [], []
    first = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, run, dedup, "a", 1, flaky)))
    first.start()
    started.wait(10)
    second = threading.Thread(target=lambda: results.append(run(dedup, "a", 1, flaky)))
    second.start()
    second.join(0.2)
    release.set()
    first.join(10)
    second.join(10)
    assert len(errors) == 1 and results == [(3, False)] and len(calls) == 2


def test_window_is_bounded_and_older_seqs_are_refused():
    dedup, apply = UpdateDeduplicator(window=3), Counter()
    for seq in range(1, 6):
        run(dedup, "a", seq, apply)
    assert run(dedup, "a", 5, apply)[1] is True
    with pytest.raises(StaleSequenceError, match="seq 2 of client 'a' is older than the de-duplication window"):
        run(dedup, "a", 2, apply)
    assert run(dedup, "a", 6, apply) == (60, False)
    assert apply.calls == 6


def test_least_recently_seen_clients_are_forgotten():
    dedup, apply = UpdateDeduplicator(max_clients=2), Counter()
    for client in ("a", "b", "c"):
        run(dedup, client, 1, apply)
    assert run(dedup, "c", 1, apply)[1] is True
    assert run(dedup, "a", 1, apply)[1] is False  # "a" was dropped to keep two clients


def test_a_duplicate_with_other_content_is_refused_not_dropped():
    dedup, apply = UpdateDeduplicator(), Counter()
    assert run(dedup, "shared", 1, apply, digest=111) == (10, False)
    assert run(dedup, "shared", 1, apply, digest=111) == (10, True)  # the same bytes again: a duplicate
    with pytest.raises(ConflictingDuplicateError, match="seq 1 of client 'shared'.*other content"):
        run(dedup, "shared", 1, apply, digest=222)
    assert run(dedup, "shared", 1, apply) == (10, True)  # no digest: nothing to compare
    assert apply.calls == 1
