"""When a client call is retried, how long it waits in between, and how calls are fenced against restarts.

A call that fails with UNAVAILABLE or DEADLINE_EXCEEDED is sent again (every PS call is idempotent: an update
carries a sequence number the shard applies once): at least ``max_retries`` times, and more until the call
has lasted ``retry_for_s``, with an exponential back-off and jitter. A call of :data:`FENCED_METHODS` carries
the incarnation of the shard the client knows; a shard that restarted since answers ABORTED, which becomes
:class:`ShardRestartedError` and is never retried. Any other status is the shard's answer
(:class:`PSRequestError`). A call that has waited ``WAIT_REPORT_S`` says so on the log, and again as often, so that a
long wait (a shard restarting, replaying its write-ahead log) is never silent.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import grpc
import grpc.aio

from lightning_persia.remote_ps.client.errors import PSRequestError, ShardMapMovedError, ShardRestartedError, ShardUnavailableError
from lightning_persia.remote_ps.protocol import FENCED_METHODS, INCARNATION_METADATA_KEY, MAP_VERSION_METADATA_KEY

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
WAIT_REPORT_S = 5.0

log = logging.getLogger("lightning_persia.ps.client")

Metadata = tuple[tuple[str, str], ...]


@dataclass
class RetryPolicy:
    """Deadlines and retries of a client's calls (its fields may be changed while the client is in use).

    Args:
        timeout_s: deadline of one attempt of a lookup, update or table call.
        max_retries: retries of an attempt that failed with UNAVAILABLE or DEADLINE_EXCEEDED.
        retry_for_s: a failed attempt is also retried, beyond ``max_retries``, until the call has lasted this
            long: how long a shard may take to come back (a restart, a paused host) before the call fails.
        backoff_s, max_backoff_s: exponential back-off between retries (with jitter).
    """

    timeout_s: float = 30.0
    max_retries: int = 5
    retry_for_s: float = 0.0
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0 or self.retry_for_s < 0:
            raise ValueError(f"retry policy: timeout_s must be > 0, max_retries, retry_for_s and backoff_s >= 0, got {self}")

    @property
    def budget_s(self) -> float:
        """The longest a call can last with its retries before it fails."""
        retries = self.max_retries * (self.timeout_s + self.max_backoff_s)
        return max(retries, self.retry_for_s + self.max_backoff_s) + self.timeout_s

    def gives_up(self, attempt: int, elapsed_s: float) -> bool:
        """Whether a call whose ``attempt``-th try just failed (retryably) after ``elapsed_s`` fails for good."""
        return attempt > self.max_retries and elapsed_s >= self.retry_for_s

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after the ``attempt``-th failed try."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


def _map_version(err: grpc.aio.AioRpcError) -> Optional[int]:
    """The shard map version a refusal names in its trailing metadata (a shard whose map moved), or None."""
    for key, value in err.trailing_metadata() or ():
        if key == MAP_VERSION_METADATA_KEY:
            return int(value)
    return None


def fenced(metadata: Metadata, method: str, incarnation: Optional[str]) -> Metadata:
    """``metadata`` of a call of ``method``, with the shard's known ``incarnation`` when the method is fenced."""
    if incarnation is None or method not in FENCED_METHODS:
        return metadata
    return metadata + ((INCARNATION_METADATA_KEY, incarnation),)


async def call_with_retry(
    rpc: Callable[..., Awaitable], request, *, method: str, shard: int, address: str, timeout_s: float,
    metadata: Metadata, incarnation: Callable[[], Optional[str]], policy: RetryPolicy,
    before_retry: Optional[Callable[[], Awaitable[None]]] = None,
):
    """``rpc(request)`` on shard ``shard`` under ``policy``; ``incarnation()`` is read again at every attempt, and
    ``before_retry()`` awaited before each retry (it may raise to end the call: the shard left the map, say)."""
    start = time.monotonic()
    next_report = WAIT_REPORT_S
    for attempt in itertools.count(1):
        try:
            return await rpc(request, timeout=timeout_s, metadata=fenced(metadata, method, incarnation()) or None)
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code == grpc.StatusCode.ABORTED and method in FENCED_METHODS:
                raise ShardRestartedError(shard, address, code, err.details() or "") from None
            moved_to = _map_version(err) if code == grpc.StatusCode.FAILED_PRECONDITION else None
            if moved_to is not None:
                raise ShardMapMovedError(shard, address, code, err.details() or "", moved_to) from None
            if code not in RETRYABLE_CODES:
                raise PSRequestError(shard, address, code, err.details() or "") from None
            waited = time.monotonic() - start
            if policy.gives_up(attempt, waited):
                raise ShardUnavailableError(shard, address, attempt, waited, f"{method}: {code.name}: {err.details()}") from None
            if waited >= next_report:
                next_report += WAIT_REPORT_S
                log.warning("waiting for shard %d at %s: %s has not been answered for %.0f s (%s); retrying for up to %.0f s "
                            "(a restarted shard replays its write-ahead log before it answers)", shard, address, method,
                            waited, code.name, max(policy.retry_for_s, waited))
        if before_retry is not None:
            await before_retry()
        await asyncio.sleep(policy.backoff(attempt))
