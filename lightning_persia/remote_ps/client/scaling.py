"""Changing the number of parameter-server shards while training runs: slots move to their new owners live.

:func:`rescale` coordinates one move from the cluster's map to :meth:`ShardMap.resized` of the new shard count (the
steps and why nothing is lost or applied twice: ``remote_ps/store/slot_moves.py``):

1. every shard that gives slots away (a *source*) takes a consistent point; its rows of those slots at the point
   go, page by page, to every shard that takes slots (a *taker*), which keeps the part the new map gives it;
2. rounds of the changes made since, while the sources keep serving, until a round is small;
3. the sources fence the moving slots (a request for them waits and retries), the last changes go over, the takers
   adopt the new map, then the sources (which drop the rows handed over), then the other shards;
4. trainers whose requests reach a source with the old map hear that it moved, fetch it and route again.

The pause a trainer can notice is step 3: one round of the changes of about one training step. A failure before
the takers adopted the map gives the move up on every shard (the old map stays; the takers drop what they took).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

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


def rescale(admin: ShardAdmin, addresses: Sequence[str], *, max_rounds: int = 8, settle_rows: int = 50_000) -> ScaleReport:
    """Moves the cluster that ``admin`` talks to onto the shards of ``addresses`` (its first shards, in order, then
    new ones; or its first ``len(addresses)`` shards, the others drained), live.

    The new shards must be running (``ps serve --shard-index i --num-shards len(addresses)``) and hold no rows. A
    drained shard answers every id with "moved" once it is done; stop it when its clients have moved (any request
    since routes elsewhere). ``max_rounds`` / ``settle_rows``: rounds of changes before the fence, at most, and the
    round size under which the fence comes early.
    """
    if max_rounds < 0 or settle_rows < 0:
        raise ValueError(f"max_rounds and settle_rows must be >= 0, got {max_rounds} and {settle_rows}")
    current, _ = admin.shard_map_of(0)
    old = list(admin.addresses[: current.num_shards])
    shared = min(len(old), len(addresses))
    if not addresses or list(addresses[:shared]) != old[:shared]:
        raise PSError(f"the new shards' addresses {list(addresses)} must start with the cluster's {old[:shared]}: shards "
                      "keep their positions; new ones come after them, drained ones are the last")
    to_map = current.resized(len(addresses))
    moves = current.moves(to_map)
    sources = sorted({was for was, _ in moves.values()})
    takers = sorted({now for _, now in moves.values()})
    everyone = list(addresses) if len(addresses) > len(old) else old
    admin.reach(everyone)
    began = time.monotonic()
    log.info("moving %d of %d slots from %d to %d shards (shard map version %d -> %d): sources %s, takers %s",
             len(moves), len(to_map.owners), len(old), len(addresses), current.version, to_map.version, sources, takers)
    begun: list[int] = []
    rows = changed = rounds = 0
    try:
        for shard in sources:
            admin.handover(shard, Step.BEGIN, to_map)
            begun.append(shard)
        for shard in sources:
            while True:
                page = admin.handover(shard, Step.ROWS)
                _forward(admin, page, takers, to_map)
                rows += page.rows
                log.info("moving slots: %d rows sent (shard %d, %.1f s)", rows, shard, time.monotonic() - began)
                if page.done:
                    break
        for rounds in range(1, max_rounds + 1):
            written = sum(_forward(admin, admin.handover(shard, Step.CHANGES), takers, to_map) for shard in sources)
            changed += written
            if written < settle_rows:
                break
        for shard in sources:
            admin.handover(shard, Step.FENCE)
        fenced = time.monotonic()
        changed += sum(_forward(admin, admin.handover(shard, Step.CHANGES), takers, to_map) for shard in sources)
        for shard in takers:
            admin.take_over(shard, persia_pb2.HandoverPage(), to_map, adopt=True, addresses=addresses)
    except BaseException:
        log.warning("moving slots failed before the new shard map was adopted: giving it up on every shard")
        for shard in sorted(set(begun) | set(takers)):
            try:
                admin.handover(shard, Step.ABORT)
            except PSError as err:  # noqa: PERF203 - each shard is told, whatever the others answer
                log.warning("shard %d did not give the move up: %s", shard, err)
        raise
    for shard in sources:
        admin.handover(shard, Step.FINISH, to_map, addresses)
    unfenced = time.monotonic()
    for shard in range(len(addresses)):
        if shard not in sources and shard not in takers:
            admin.take_over(shard, persia_pb2.HandoverPage(), to_map, adopt=True, addresses=addresses)
    report = ScaleReport(len(old), len(addresses), to_map.version, len(moves), rows, changed, rounds,
                         time.monotonic() - began, unfenced - fenced)
    log.info("moved %d slots (%d rows, %d changed rows in %d rounds) in %.1f s; requests for them waited %.3f s; "
             "shard map version %d on %d shards", report.slots_moved, rows, changed, rounds, report.seconds,
             report.fenced_seconds, to_map.version, len(addresses))
    return report


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
