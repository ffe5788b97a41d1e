"""Changing the number of parameter-server shards while training runs: slots move to their new owners live.

:func:`rescale` coordinates one move from the cluster's map to :meth:`ShardMap.resized` of the new shard count (the
steps and why nothing is lost or applied twice: ``remote_ps/store/slot_moves.py``):

1. every shard that gives slots away (a *source*) takes a consistent point; its rows of those slots at the point
   go, page by page, to every shard that takes slots (a *taker*), which keeps the part the new map gives it;
2. rounds of the changes made since, while the sources keep serving, until a round is small;
3. the sources fence the moving slots (a request for them waits and retries), the last changes go over, the takers
   adopt the new map, then the sources (which drop the rows handed over), then the other shards;
4. trainers whose requests reach a source with the old map hear that it moved, fetch it and route again.

The pause a trainer can notice is step 3: one round of the changes of about one training step.

The move goes through when its first taker adopts the new map (``remote_ps/move_settling.py``). A failure before that
gives the move up on every shard (the old map stays; the takers drop what they took); one after it finishes the move
on the shards that answer, and the sources that do not finish it themselves (they ask the first taker). A coordinator
that dies leaves it to the fenced sources (after ``handover_deadline_s``), or to the next :func:`rescale`, which first
settles any move under way.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.client.admin import ShardAdmin
from lightning_persia.remote_ps.client.errors import PSError
from lightning_persia.remote_ps.protocol import SHARD_PROCESS_ENV, TOKEN_ENV, persia_pb2

log = logging.getLogger("lightning_persia.ps.scaling")

Step = persia_pb2.HandoverStep


@dataclass(frozen=True)
class ScaleReport:
    """What one :func:`rescale` did."""

    from_shards: int
    to_shards: int
    map_version: int
    slots_moved: int
    rows_moved: int  # rows at the move's point
    changed_rows: int  # rows written again by the rounds of changes
    rounds: int
    seconds: float
    fenced_seconds: float  # from the fence to the sources' adoption: how long requests for moving slots waited


def rescale(admin: ShardAdmin, addresses: Sequence[str], *, max_rounds: int = 8, settle_rows: int = 50_000,
            on_step: Callable[[str], None] = lambda step: None) -> ScaleReport:
    """Moves the cluster that ``admin`` talks to onto the shards of ``addresses`` (its first shards, in order, then
    new ones; or its first ``len(addresses)`` shards, the others drained), live.

    The new shards must be running (``ps serve --shard-index i --num-shards len(addresses)``) and hold no rows. A
    drained shard answers every id with "moved" once it is done; stop it when its clients have moved (any request
    since routes elsewhere). ``max_rounds`` / ``settle_rows``: rounds of changes before the fence, at most, and the
    round size under which the fence comes early. ``on_step(name)`` hears each step as it begins (``"begin"``,
    ``"rows"``, ``"changes"``, ``"fence"``, ``"last changes"``, ``"adopt"``, ``"finish"``): progress, or a test
    that stops the coordinator there.

    A move a coordinator left under way (it died) is settled first: finished if its first taker adopted the new map,
    given up otherwise; a cluster already at ``len(addresses)`` shards then has nothing to move.
    """
    if max_rounds < 0 or settle_rows < 0:
        raise ValueError(f"max_rounds and settle_rows must be >= 0, got {max_rounds} and {settle_rows}")
    began = time.monotonic()
    current = _settled_map(admin, addresses)
    old = list(admin.addresses[: current.num_shards])
    to_map = current.resized(len(addresses))
    moves = current.moves(to_map)
    if current.num_shards == len(addresses) and not moves:
        log.info("the cluster is at %d shards already (shard map version %d): nothing to move", len(addresses), current.version)
        return ScaleReport(len(old), len(addresses), current.version, 0, 0, 0, 0, time.monotonic() - began, 0.0)
    sources = sorted({was for was, _ in moves.values()})
    takers = sorted({now for _, now in moves.values()})
    everyone = list(addresses) if len(addresses) > len(old) else old
    admin.reach(everyone)
    log.info("moving %d of %d slots from %d to %d shards (shard map version %d -> %d): sources %s, takers %s",
             len(moves), len(to_map.owners), len(old), len(addresses), current.version, to_map.version, sources, takers)
    begun: list[int] = []
    rows = changed = rounds = 0
    adopting = False  # once the first taker was asked to adopt, the move may have gone through
    try:
        on_step("begin")
        for shard in sources:
            admin.handover(shard, Step.BEGIN, to_map, addresses)
            begun.append(shard)
        on_step("rows")
        for shard in sources:
            while True:
                page = admin.handover(shard, Step.ROWS)
                _forward(admin, page, takers, to_map)
                rows += page.rows
                log.info("moving slots: %d rows sent (shard %d, %.1f s)", rows, shard, time.monotonic() - began)
                if page.done:
                    break
        on_step("changes")
        for rounds in range(1, max_rounds + 1):
            written = sum(_forward(admin, admin.handover(shard, Step.CHANGES), takers, to_map) for shard in sources)
            changed += written
            if written < settle_rows:
                break
        on_step("fence")
        for shard in sources:
            admin.handover(shard, Step.FENCE)
        fenced = time.monotonic()
        on_step("last changes")
        changed += sum(_forward(admin, admin.handover(shard, Step.CHANGES), takers, to_map) for shard in sources)
        on_step("adopt")
        adopting = True
        admin.take_over(takers[0], persia_pb2.HandoverPage(), to_map, adopt=True, addresses=addresses)
    except BaseException:
        if adopting and _went_through(admin, takers[0], to_map):
            log.warning("the first taker, shard %d, adopted shard map version %d before the failure: finishing the move",
                        takers[0], to_map.version)
        else:
            log.warning("moving slots failed before the new shard map was adopted: giving it up on every shard")
            _tell(admin, sorted(set(begun) | set(takers)), lambda shard: admin.handover(shard, Step.ABORT, to_map, addresses),
                  "give the move up")
            raise
    # the move went through: every other shard adopts the map. A taker that does not answer keeps the sources fenced
    # (they finish once it adopts, asking it themselves); a source that does not finish it on its own once back.
    missing = _tell(admin, takers[1:], lambda shard: admin.take_over(shard, persia_pb2.HandoverPage(), to_map, adopt=True,
                                                                       addresses=addresses), "adopt the new map")
    on_step("finish")
    if not missing:
        _tell(admin, sources, lambda shard: admin.handover(shard, Step.FINISH, to_map, addresses),
              "finish (it will on its own: it asks the first taker)")
    unfenced = time.monotonic()
    _tell(admin, [s for s in range(len(addresses)) if s not in sources and s not in takers],
          lambda shard: admin.take_over(shard, persia_pb2.HandoverPage(), to_map, adopt=True, addresses=addresses),
          "adopt the new map")
    if missing:
        raise PSError(f"the move to shard map version {to_map.version} went through, but shards {missing} did not adopt "
                      "it: the sources stay fenced and finish the move once those shards answer (handover_deadline_s)")
    report = ScaleReport(len(old), len(addresses), to_map.version, len(moves), rows, changed, rounds,
                         time.monotonic() - began, unfenced - fenced)
    log.info("moved %d slots (%d rows, %d changed rows in %d rounds) in %.1f s; requests for them waited %.3f s; "
             "shard map version %d on %d shards", report.slots_moved, rows, changed, rounds, report.seconds,
             report.fenced_seconds, to_map.version, len(addresses))
    return report


def _settled_map(admin: ShardAdmin, addresses: Sequence[str]) -> ShardMap:
    """The cluster's map once any move a coordinator left under way is settled; checks ``addresses`` against it."""
    current, _ = admin.shard_map_of(0)
    old = list(admin.addresses[: current.num_shards])
    shared = min(len(old), len(addresses))
    if not addresses or list(addresses[:shared]) != old[:shared]:
        raise PSError(f"the new shards' addresses {list(addresses)} must start with the cluster's {old[:shared]}: shards "
                      "keep their positions; new ones come after them, drained ones are the last")
    known = list(addresses) if len(addresses) > len(old) else old
    admin.reach(known)
    # twice: the first pass settles the moves under way (a source that rolls one back makes its takers refuse it),
    # the second finds none under way and lets every shard take part in a new move (the takers forget the refusal)
    versions = [admin.handover(shard, Step.SETTLE).map_version for _ in range(2) for shard in range(len(known))]
    if max(versions) != current.version:
        log.warning("settled a move its coordinator left under way: the cluster is at shard map version %d", max(versions))
        current, _ = admin.shard_map_of(versions.index(max(versions)))
    return current


def _went_through(admin: ShardAdmin, first_taker: int, to_map: ShardMap) -> bool:
    """Whether the move's first taker adopted ``to_map``; if not, it never will (``ABORT`` with the map)."""
    try:
        return admin.handover(first_taker, Step.ABORT, to_map).map_version >= to_map.version
    except PSError as err:
        raise PSError(f"the move's first taker, shard {first_taker}, does not answer whether it adopted shard map "
                      f"version {to_map.version} ({err}): the fenced sources settle the move once it does") from err


def _tell(admin: ShardAdmin, shards: Sequence[int], call: Callable[[int], object], what: str) -> list[int]:
    """``call(shard)`` for each of ``shards``, whatever the others answer; the shards that did not."""
    missing = []
    for shard in shards:
        try:
            call(shard)
        except PSError as err:  # noqa: PERF203 - each shard is told
            log.warning("shard %d did not %s: %s", shard, what, err)
            missing.append(shard)
    return missing


def _forward(admin: ShardAdmin, page: persia_pb2.HandoverPage, takers: Sequence[int], to_map) -> int:
    """Hands ``page`` to every taker (each keeps its part); returns the rows it holds."""
    if page.records or page.tables_json:
        for shard in takers:
            admin.take_over(shard, page, to_map)
    return page.rows



def wait_drained(admin: ShardAdmin, shards: Sequence[int], quiet_s: float = 2.0, timeout_s: float = 120.0) -> None:
    """Waits until no lookup or update has reached ``shards`` (drained by :func:`rescale`) for ``quiet_s``: their
    clients have followed the new map (each learns it from its next answer of any shard), so they can stop."""
    deadline = time.monotonic() + timeout_s
    last: dict[int, int] = {}
    quiet_since = time.monotonic()
    while True:
        seen = {shard: _requests(admin, shard) for shard in shards}
        if seen != last:
            last, quiet_since = seen, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        if time.monotonic() > deadline:
            raise PSError(f"drained shards {list(shards)} still had requests after {timeout_s:.0f} s; their clients have "
                          "not followed the new shard map")
        time.sleep(min(0.2, quiet_s / 4))


def _requests(admin: ShardAdmin, shard: int) -> int:
    server = admin.shard_stats(shard)["server"]
    return int(server.get("Lookup", 0)) + int(server.get("Update", 0))


def rescale_apart(current: Sequence[str], addresses: Sequence[str], *, token: Optional[str] = None,
                  tls_root_cert: Optional[str] = None) -> ScaleReport:
    """:func:`rescale` (and, draining, :func:`wait_drained`) in a process of its own, ``lightning-persia ps scale``:
    every page of rows passes through the coordinator's interpreter, which a trainer's work would otherwise wait for."""
    command = [sys.executable, "-m", "lightning_persia.cli", "ps", "scale", "--addresses", ",".join(current),
               "--to", ",".join(addresses), "--json"]
    if tls_root_cert is not None:
        command += ["--tls-root-cert", str(tls_root_cert)]
    environment = {**os.environ, SHARD_PROCESS_ENV: "1", **({TOKEN_ENV: token} if token else {})}
    result = subprocess.run(command, capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        raise PSError(f"moving the slots from {list(current)} to {list(addresses)} failed (exit {result.returncode}):\n"
                      + result.stderr[-3000:])
    return ScaleReport(**json.loads(result.stdout.strip().splitlines()[-1]))
