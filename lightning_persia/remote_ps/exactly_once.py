"""Exactly-once application of updates that a client may send more than once.

A client tags every Update with ``(client_id, seq)`` and resends the same pair when an attempt times out or
the connection drops, without knowing whether the shard applied it. :class:`UpdateDeduplicator` remembers,
per client, a bounded window of the sequence numbers it applied:

- a seq seen for the first time is applied;
- a seq already applied is answered as a duplicate and changes nothing;
- a seq whose first attempt is still being applied waits for it, then answers as that attempt did;
- a seq whose attempt failed is forgotten, so a retry applies it;
- a seq older than every seq the window still remembers cannot be told apart from an applied one, and is
  refused with :class:`StaleSequenceError` rather than risk applying it twice;
- with a ``digest`` of the content, a duplicate whose digest differs from the first attempt's is refused with
  :class:`ConflictingDuplicateError`: senders that share a client id (an embedding worker started in place of a dead one
  resends its updates) must send the same bytes, and a divergence is an error, not a silent choice of one version.

Memory is bounded by ``window`` seqs per client and ``max_clients`` clients (least recently seen dropped).
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, Iterator, Optional, TypeVar

T = TypeVar("T")


class StaleSequenceError(RuntimeError):
    """An update whose seq fell out of the de-duplication window: whether it was applied is unknown."""


class ConflictingDuplicateError(RuntimeError):
    """A seq sent again with other content than the attempt that was applied."""


class _Pending(Generic[T]):
    __slots__ = ("done", "ok", "result", "digest")

    def __init__(self, digest: Optional[int]) -> None:
        self.done = threading.Event()
        self.ok = False
        self.result: Optional[T] = None
        self.digest = digest


class _Client:
    __slots__ = ("applied", "floor", "pending")

    def __init__(self) -> None:
        self.applied: OrderedDict[int, tuple] = OrderedDict()  # seq -> (result, digest), oldest first
        self.floor = 0  # highest seq dropped from `applied`
        self.pending: dict[int, _Pending] = {}


class UpdateDeduplicator:
    """Lets each ``(client_id, seq)`` be applied at most once (:meth:`once`; see the module docstring)."""

    def __init__(self, window: int = 4096, max_clients: int = 4096) -> None:
        if window < 1 or max_clients < 1:
            raise ValueError(f"window and max_clients must be >= 1, got {window} and {max_clients}")
        self.window = window
        self.max_clients = max_clients
        self._clients: OrderedDict[str, _Client] = OrderedDict()
        self._lock = threading.Lock()
        self.duplicates = 0

    def remember(self, client_id: str, seqs: list[int]) -> None:
        """Marks ``seqs`` of ``client_id`` applied (read back from a write-ahead log: a restarted shard answers
        their retries as duplicates). Their result is unknown: a duplicate answers 0 rows."""
        with self._lock:
            client = self._clients.setdefault(client_id, _Client())
            for seq in seqs:
                client.applied[seq] = (0, None)
            while len(client.applied) > self.window:
                dropped, _ = client.applied.popitem(last=False)
                client.floor = max(client.floor, dropped)

    def applied(self) -> dict[str, list[int]]:
        """The seqs each client had applied, as far as the window remembers (what :meth:`remember` takes)."""
        with self._lock:
            return {client_id: list(client.applied) for client_id, client in self._clients.items() if client.applied}

    @contextlib.contextmanager
    def once(self, client_id: str, seq: int, digest: Optional[int] = None) -> Iterator["Attempt"]:
        """The attempt of ``(client_id, seq)``: where :attr:`Attempt.duplicate` is False, the block applies the update
        and sets :attr:`Attempt.result`; else the result is the first attempt's, and the block applies nothing.

        ``digest`` (optional) identifies the content; a duplicate must carry the first attempt's. A block that raises
        leaves the seq unapplied (a retry applies it)."""
        while True:
            with self._lock:
                client = self._clients.get(client_id)
                if client is None:
                    client = self._clients[client_id] = _Client()
                    if len(self._clients) > self.max_clients:
                        self._clients.popitem(last=False)
                else:
                    self._clients.move_to_end(client_id)
                if seq in client.applied:
                    result, first_digest = client.applied[seq]
                    _check_same(client_id, seq, first_digest, digest)
                    self.duplicates += 1
                    yield Attempt(True, result)
                    return
                pending = client.pending.get(seq)
                if pending is not None:
                    _check_same(client_id, seq, pending.digest, digest)
                else:
                    if seq <= client.floor:
                        raise StaleSequenceError(
                            f"update seq {seq} of client {client_id!r} is older than the de-duplication window "
                            f"(the last {self.window} updates, seqs above {client.floor}); whether it was applied "
                            "is unknown, so it is refused"
                        )
                    pending = client.pending[seq] = _Pending(digest)
                    break
            # Another thread is applying this seq: wait, then answer as it did, or try again if it failed.
            pending.done.wait()
            if pending.ok:
                with self._lock:
                    self.duplicates += 1
                yield Attempt(True, pending.result)
                return

        attempt = Attempt(False)
        try:
            yield attempt
        except BaseException:
            with self._lock:
                client.pending.pop(seq, None)
            pending.done.set()
            raise
        with self._lock:
            client.pending.pop(seq, None)
            client.applied[seq] = (attempt.result, digest)
            while len(client.applied) > self.window:
                dropped, _ = client.applied.popitem(last=False)
                client.floor = max(client.floor, dropped)
        pending.ok, pending.result = True, attempt.result
        pending.done.set()


@dataclass
class Attempt:
    """One delivery of an update (:meth:`UpdateDeduplicator.once`): a ``duplicate`` answers with the first attempt's
    ``result``; the first attempt sets it."""

    duplicate: bool
    result: Any = None


def _check_same(client_id: str, seq: int, first: Optional[int], again: Optional[int]) -> None:
    if first is not None and again is not None and first != again:
        raise ConflictingDuplicateError(
            f"update seq {seq} of client {client_id!r} arrived again with other content than the attempt applied "
            "first; clients sharing a client id must send identical updates (nothing was applied from this one)"
        )
