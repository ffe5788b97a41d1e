"""A source shard's pages of a move, sent straight to the move's takers.

The coordinator (``client/scaling.py``) paces the steps; at ROWS, CHANGES and SIGHTINGS the source sends each taker
the part of the page that the new map gives it (``TakeOver``), and answers the coordinator with the page's counts
alone. Rows thus cross the network once, and no process decodes rows it does not keep: at 20M rows a coordinator that
forwarded every page to every taker spent 4 s of CPU on a move whose shards spent 13 to 15 s, and each taker of a
drain decoded the other takers' rows too.

A page that did not reach every taker (one failed, or did not answer in time) is kept, and the step's next call
sends it again to the takers that did not take it, before any other page: the coordinator retries a step whose call
failed with UNAVAILABLE or DEADLINE_EXCEEDED, as it retried its own forwarding, and gives the move up on any other
failure. Until then the source gives no other page (a take is idempotent: a row written twice holds the same value),
so no page is lost between source and taker, and the rows a page holds are dropped at the move's end only once
every taker took it (the move does not go through otherwise).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import grpc
import torch

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps import handover_wire, messages
from lightning_persia.remote_ps.messages import RpcRefusal, invalid
from lightning_persia.remote_ps.peers import Peers
from lightning_persia.remote_ps.protocol import persia_pb2, persia_pb2_grpc
from lightning_persia.remote_ps.store.slot_moves import part_of
from lightning_persia.remote_ps.store.wal.changes import Change
from lightning_persia.remote_ps.table_config import TableConfig

log = logging.getLogger("lightning_persia.ps")


class PageDelivery:
    """Sends one handover's pages from its source to ``takers`` (shards of ``to_map``, at ``addresses``), over
    channels open until :meth:`close`."""

    def __init__(self, peers: Peers, to_map: ShardMap, addresses: Sequence[str], takers: Sequence[int]) -> None:
        if len(addresses) != to_map.num_shards:
            raise invalid(f"a move needs the addresses of its new map's {to_map.num_shards} shards (got {len(addresses)}): "
                          "the source sends the moving rows to the takers itself")
        self._to_map = to_map
        self._map_message = handover_wire.map_message(to_map, addresses)
        self._addresses = list(addresses)
        self._metadata = peers.metadata
        self._channels = {taker: peers.channel(addresses[taker]) for taker in takers}
        self._stubs = {taker: persia_pb2_grpc.ParameterServerStub(channel) for taker, channel in self._channels.items()}
        self._step: Optional[int] = None  # the step of the page not every taker took yet, if any
        self._undelivered: dict[int, persia_pb2.TakeOverRequest] = {}
        self._answer = persia_pb2.HandoverPage()

    @property
    def pending(self) -> Optional[int]:
        """The step whose page some taker did not take yet (its next call sends that page again), or None."""
        return self._step if self._undelivered else None

    def changes(self, step: int, configs: Sequence[TableConfig], changes: Sequence[Change], *, done: bool = False,
                fenced: bool = False, applied_json: str = "", source: int = 0,
                timeout_s: Optional[float] = None) -> persia_pb2.HandoverPage:
        """Sends each taker its part of rows or changes (ROWS, CHANGES) with every table's configuration and the
        source's exactly-once memory; returns the coordinator's answer: the rows the page holds, and ``done``.
        ``fenced``: the source fenced the slots (requests for them wait for this page)."""
        requests = {}
        for taker in self._stubs:
            mine = lambda ids, taker=taker: self._to_map.shard_of(ids) == taker  # noqa: E731
            parts = [Change([part_of(part, mine, copy=False) for part in change.tables]) for change in changes]
            request = requests[taker] = self._request(fenced)
            messages.fill_handover_page(request.page, configs, parts)
            request.page.applied_json, request.page.source = applied_json, source
        rows = sum(part.rows["ids"].numel() if part.rows else 0 for change in changes for part in change.tables)
        return self._send(step, requests, persia_pb2.HandoverPage(rows=rows, done=done), timeout_s)

    def sightings(self, blocks: Sequence[tuple[str, torch.Tensor, torch.Tensor]], *, done: bool, fenced: bool = False,
                  timeout_s: Optional[float] = None) -> persia_pb2.HandoverPage:
        """Sends each taker the sighting counters of the slots the new map gives it (SIGHTINGS); returns ``done``."""
        requests = {}
        for taker in self._stubs:
            parts = []
            for name, slots, counters in blocks:
                mine = self._to_map.table[slots] == taker
                if bool(mine.any()):
                    parts.append((name, slots[mine], counters[mine]))
            request = requests[taker] = self._request(fenced)
            messages.fill_sightings_page(request.page, parts)
        return self._send(persia_pb2.HandoverStep.SIGHTINGS, requests, persia_pb2.HandoverPage(done=done), timeout_s)

    def resend(self, step: int, timeout_s: Optional[float] = None) -> persia_pb2.HandoverPage:
        """Sends the page of ``step`` again to the takers that did not take it; returns its answer."""
        if step != self._step:
            raise invalid(f"the page of handover step {persia_pb2.HandoverStep.Step.Name(self._step)} did not reach "
                          f"every taker yet: its step is called again, not {persia_pb2.HandoverStep.Step.Name(step)}")
        return self._deliver(timeout_s)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def _request(self, fenced: bool) -> persia_pb2.TakeOverRequest:
        request = persia_pb2.TakeOverRequest()
        request.to_map.CopyFrom(self._map_message)
        request.page.fenced = fenced
        return request

    def _send(self, step: int, requests: dict[int, persia_pb2.TakeOverRequest], answer: persia_pb2.HandoverPage,
              timeout_s: Optional[float]) -> persia_pb2.HandoverPage:
        self._step, self._answer = step, answer
        self._undelivered = {taker: request for taker, request in requests.items()
                             if request.page.records or request.page.tables_json or request.page.sightings}
        return self._deliver(timeout_s)

    def _deliver(self, timeout_s: Optional[float]) -> persia_pb2.HandoverPage:
        """Sends every undelivered page at once; raises the first failure (a taker's status, naming it)."""
        calls = {taker: self._stubs[taker].TakeOver.future(request, timeout=timeout_s, metadata=self._metadata)
                 for taker, request in self._undelivered.items()}
        failure: Optional[RpcRefusal] = None
        for taker, call in calls.items():
            try:
                call.result()
            except grpc.RpcError as err:  # noqa: PERF203 - every taker's answer is read
                log.warning("taker shard %d (%s) did not take a handover page: %s", taker, self._addresses[taker], err.code().name)
                failure = failure or RpcRefusal(err.code(), f"taker shard {taker} ({self._addresses[taker]}) did not take "
                                                            f"the page: {err.code().name}: {err.details()}")
                continue
            del self._undelivered[taker]
        if failure is not None:
            raise failure
        return self._answer
