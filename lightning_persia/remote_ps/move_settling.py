"""A move of slots whose coordinator is gone: the giving shard ends it on its own, by what the move's first taker holds.

The rule (``docs/elastic.md``, *A move without its coordinator*): a move goes through at the moment its **first taker**
(the lowest shard index the move gives slots to, which the coordinator makes adopt the new map before any other shard)
adopts it. Until then the giving shards (*sources*) own the slots; from then on the takers do. The coordinator fences
every source before that adoption, so no moment has two owners accepting writes for a slot; and the takers hold every
row and change of the moving slots before it, so none is lost.

A source fenced for :attr:`PSConfig.handover_deadline_s` without a step from its coordinator (or restarted fenced from
its log) asks the first taker ``ABORT`` with the new map: a taker that adopted it answers so (the move went through:
the source makes the other takers and the bystanders adopt it, then finishes); one that did not never will (the move
rolled back: the source tells the other takers to drop what they took, and serves its slots again). A source not yet
fenced knows no taker adopted: it rolls back without asking (``SETTLE`` from a new coordinator run does that).
While the first taker cannot be reached, the source stays fenced and asks again: it cannot tell which way the move went.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence

import grpc

from lightning_persia.remote_ps import handover_wire
from lightning_persia.remote_ps.peers import Peers
from lightning_persia.remote_ps.protocol import persia_pb2
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.slot_moves import OutgoingSlots

log = logging.getLogger("lightning_persia.ps")

PEER_TIMEOUT_S = 30.0
"""Deadline of one call to another shard of the move (an adoption writes a MAP record; a roll-back drops rows)."""


class MoveSettlingError(RuntimeError):
    """The move under way cannot be settled now (its first taker does not answer, or its addresses are unknown)."""


class MoveSettler:
    """Settles the handover under way on ``store`` without its coordinator: on :meth:`settle`, and on its own once
    the handover has been fenced for ``deadline_s`` with no coordinator step (:meth:`heard_coordinator`); ``peers``:
    the channels to the move's other shards."""

    def __init__(self, store: ShardStore, deadline_s: float, peers: Peers) -> None:
        self._store = store
        self._deadline_s = deadline_s
        self._peers = peers
        self._lock = threading.Lock()  # one settling at a time
        # None: no coordinator step since this process started, so a fence replayed from the log is settled at once
        self._last_step: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.finished = 0  # moves this shard finished without their coordinator (Stats: ``moves_settled``)
        self.rolled_back = 0  # and those it gave up

    def heard_coordinator(self) -> None:
        """A coordinator's step arrived: the deadline counts from now."""
        self._last_step = time.monotonic()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="persia-move-settler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def settle(self) -> int:
        """Ends the handover under way, if any, by the rule above; returns this shard's map version after it. Raises
        :class:`MoveSettlingError` when it cannot decide."""
        with self._lock:
            outgoing = self._store.handover
            if outgoing is None:  # a coordinator starts over: a move given up here may be run again
                self._store.forget_given_up()
                return self._store.shard_map.version
            to_map, takers = outgoing.to_map, outgoing.takers
            if not outgoing.fenced:  # no taker can have adopted the map: it would have been fenced first
                log.warning("shard %d: the move to shard map version %d was not fenced yet; giving it up (its coordinator "
                            "is gone)", self._store.shard_index, to_map.version)
                self._tell(takers, lambda address: self._abort(address, outgoing), outgoing, must=False)
                self.rolled_back += 1
                return self._store.abort_handover(to_map)
            if len(outgoing.addresses) != to_map.num_shards:
                raise MoveSettlingError(f"the move to shard map version {to_map.version} came without its shards' "
                                        "addresses: end it with `ps scale` (ABORT or FINISH by hand)")
            try:
                went_through = self._abort(outgoing.addresses[takers[0]], outgoing) >= to_map.version
            except grpc.RpcError as err:
                raise MoveSettlingError(f"the move's first taker, shard {takers[0]} ({outgoing.addresses[takers[0]]}), "
                                        f"does not answer ({err.code().name}): the move stays fenced until it does") from None
            if not went_through:
                log.warning("shard %d: the move to shard map version %d rolled back (its first taker, shard %d, never "
                            "adopted it); serving the slots again", self._store.shard_index, to_map.version, takers[0])
                self._tell(takers[1:], lambda address: self._abort(address, outgoing), outgoing, must=False)
                self.rolled_back += 1
                return self._store.abort_handover(to_map)
            bystanders = [s for s in range(to_map.num_shards) if s not in outgoing.sources and s != self._store.shard_index]
            self._tell([s for s in bystanders if s != takers[0]], lambda address: self._adopt(address, outgoing),
                       outgoing, must=True)
            self._store.finish_handover()
            self.finished += 1
            log.warning("shard %d: finished the move to shard map version %d without its coordinator (its first taker "
                        "had adopted it)", self._store.shard_index, to_map.version)
            return to_map.version

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self._deadline_s / 4)):
            outgoing = self._store.handover
            last = self._last_step
            if outgoing is None or not outgoing.fenced or (last is not None and time.monotonic() - last < self._deadline_s):
                continue
            try:
                self.settle()
            except MoveSettlingError as err:
                log.warning("shard %d: %s", self._store.shard_index, err)
            except Exception:  # noqa: BLE001 - the watch goes on; the next round tries again
                log.exception("shard %d: settling the move under way failed", self._store.shard_index)

    def _tell(self, shards: Sequence[int], call: Callable[[str], object], outgoing: OutgoingSlots, *, must: bool) -> None:
        """``call(address)`` on each of ``shards``; with ``must``, a shard that does not answer stops the
        settling (the move stays fenced, and the next round asks again)."""
        for shard in shards:
            if shard >= len(outgoing.addresses):
                continue
            address = outgoing.addresses[shard]
            try:
                call(address)
            except grpc.RpcError as err:
                if must:
                    raise MoveSettlingError(f"shard {shard} ({address}) did not adopt shard map version "
                                            f"{outgoing.to_map.version} ({err.code().name}); asking again") from None
                log.warning("shard %d: shard %d (%s) did not hear that the move rolled back (%s); it drops the rows it "
                            "took at the next move's roll-back or `ps scale`", self._store.shard_index, shard, address,
                            err.code().name)

    def _abort(self, address: str, outgoing: OutgoingSlots) -> int:
        request = persia_pb2.HandoverStep(step=persia_pb2.HandoverStep.ABORT,
                                          map=handover_wire.map_message(outgoing.to_map, outgoing.addresses))
        return self._call(address, "Handover", request).map_version

    def _adopt(self, address: str, outgoing: OutgoingSlots) -> None:
        request = persia_pb2.TakeOverRequest(page=persia_pb2.HandoverPage(), adopt=True,
                                             to_map=handover_wire.map_message(outgoing.to_map, outgoing.addresses))
        self._call(address, "TakeOver", request)

    def _call(self, address: str, method: str, request):
        return self._peers.call(address, method, request, PEER_TIMEOUT_S)
