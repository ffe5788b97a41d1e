"""Changing the number of parameter-server shards while training runs: slots move to their new owners live.

:func:`rescale` coordinates a move from the cluster's map to :meth:`ShardMap.resized` of the new shard count, in waves
through the maps of :meth:`ShardMap.waves` (:class:`ScaleSettings`). Each wave is a whole move of its own (the steps
and why nothing is lost or applied twice: ``remote_ps/store/slot_moves.py``):

1. every shard that gives slots away (a *source*) takes a consistent point; its rows of those slots at the point
   go, page by page, to the shards that take slots (the *takers*): the source sends each taker the part the new map
   gives it and answers the coordinator with the page's counts (``remote_ps/handover_delivery.py``);
2. rounds of the changes made since, while the sources keep serving, until a round is small;
3. the sources fence the moving slots (a request for them waits and retries), the last changes go over with the
   slots' sightings of ids not admitted yet (``store/admission.py``), the takers adopt the new map, then the sources
   (which drop the rows handed over), then the other shards;
4. trainers whose requests reach a source with the old map hear that it moved, fetch it and route again.

The pause a trainer can notice is step 3: one round of the wave's changes. Waves keep it short: a wave's rounds
carry only its slots' changes, so they shrink where a third of all slots at once would not.

The move goes through when its first taker adopts the new map (``remote_ps/move_settling.py``). A failure before that
gives the move up on every shard (the old map stays; the takers drop what they took); one after it finishes the move
on the shards that answer, and the sources that do not finish it themselves (they ask the first taker). A coordinator
that dies leaves it to the fenced sources (after ``handover_deadline_s``), or to the next :func:`rescale`, which first
settles any move under way.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from lightning_persia.ops.shard_map import SLOTS, ShardMap
from lightning_persia.remote_ps.client.admin import ShardAdmin
from lightning_persia.remote_ps.client.errors import PSError
from lightning_persia.remote_ps.protocol import SHARD_PROCESS_ENV, TOKEN_ENV, persia_pb2

log = logging.getLogger("lightning_persia.ps.scaling")

Step = persia_pb2.HandoverStep


@dataclass(frozen=True)
class ScaleSettings:
    """How :func:`rescale` paces a move."""

    wave_rows: int = 500_000
    """Rows a wave moves, about: a move goes in waves of ``wave_rows / (cluster rows / SLOTS)`` slots, each a complete
    move through a map of its own (a cluster with fewer rows moves in one). A wave's fenced last round carries only its
    slots' changes, and its rounds converge when its share of the trainers' writes ships faster than it is made: at
    20M rows, a client writing 1.8M rows/s and a copy of 250k rows/s, a third of the slots at once never converged
    (fenced 1.9 to 3.8 s); 14 waves of 102 slots each do (a grow: 27 rounds in all, 1.1M changed rows against 4.7M,
    and the longest step 0.7 s over the median against 1.8 s)."""
    copy_share: float = 0.25
    """Share of the coordinator's time spent moving: after each unfenced page, and after each wave's end, it waits
    for the time since x ``(1 / copy_share - 1)``, leaving the trainers the CPU the move would take (1: no wait; the
    fenced last round never waits). The trainer loses about a second per CPU-second of the move at any pace, so the
    share is what it gives up. At 20M rows on a 2-core machine, with the shards' move threads at the requests'
    priority (``PSConfig.move_nice`` 0), samples/s during a grow and a drain were 0.59x to 0.75x and 0.63x to 0.76x
    of the rate at the median step before the move at 0.35 (a grow took 26 to 31 s), 0.69x to 0.88x and 0.73x to 0.94x
    at 0.25 (37 to 45 s), and 0.72x to 0.82x and 0.70x to 0.77x at 0.2 (47 to 52 s): below 0.25 the slower move
    ships more changed rows and the trainers gain nothing more."""
    unpaced_s: float = 3.0
    """Seconds a move copies before ``copy_share`` paces it: a move that ends sooner never competes with training
    long enough to matter, and pacing it only stretches its rounds. At 1M rows a memory table's move took 0.8 to
    1.1 s unpaced and 3 to 4.4 s paced from its start, shipping 5 to 6 times the changed rows."""
    max_rounds: int = 8
    """Rounds of changes per wave before the fence, at most."""
    settle_rows: int = 50_000
    """A round with fewer changed rows fences the wave early."""

    def __post_init__(self) -> None:
        if (self.wave_rows < 1 or not 0 < self.copy_share <= 1 or self.unpaced_s < 0 or self.max_rounds < 0
                or self.settle_rows < 0):
            raise ValueError(f"scale settings need wave_rows >= 1, 0 < copy_share <= 1, unpaced_s >= 0, max_rounds >= 0 "
                             f"and settle_rows >= 0, got {self}")


@dataclass(frozen=True)
class ScaleReport:
    """What one :func:`rescale` did (over all its waves)."""

    from_shards: int
    to_shards: int
    map_version: int
    slots_moved: int
    rows_moved: int  # rows at the waves' points
    changed_rows: int  # rows written again by the rounds of changes
    rounds: int
    seconds: float
    fenced_seconds: float  # the longest wave's wait from its fence to its sources' adoption (requests for its slots waited)
    waves: int = 0
    paced_seconds: float = 0.0  # the coordinator waited so, leaving the trainers the CPU (ScaleSettings.copy_share)


@dataclass
class _Wave:
    """What one wave moved."""

    rows: int = 0
    changed: int = 0
    rounds: int = 0
    fenced_seconds: float = 0.0


class _Pacer:
    """Waits after each unfenced page, and after each wave's end, so that the move takes ``share`` of the
    coordinator's time, once it has run ``unpaced_s`` seconds."""

    def __init__(self, share: float, unpaced_s: float) -> None:
        self._idle = 1.0 / share - 1.0
        self._since = time.monotonic()
        self._paced_from = self._since + unpaced_s
        self.waited = 0.0

    def page_done(self) -> None:
        wait = (time.monotonic() - self._since) * self._idle
        if wait > 0 and self._since >= self._paced_from:
            time.sleep(wait)
            self.waited += wait
        self._since = time.monotonic()

    def restart(self) -> None:
        """The next page's time counts from now (the fenced round, which never waits, came in between)."""
        self._since = time.monotonic()


def rescale(admin: ShardAdmin, addresses: Sequence[str], settings: ScaleSettings = ScaleSettings(), *,
            on_step: Callable[[str], None] = lambda step: None) -> ScaleReport:
    """Moves the cluster that ``admin`` talks to onto the shards of ``addresses`` (its first shards, in order, then
    new ones; or its first ``len(addresses)`` shards, the others drained), live, in waves (:class:`ScaleSettings`).

    The new shards must be running (``ps serve --shard-index i --num-shards len(addresses)``) and hold no rows. A
    drained shard answers every id with "moved" once it is done; stop it when its clients have moved (any request
    since routes elsewhere). ``on_step(name)`` hears each step of each wave as it begins (``"wave"``, ``"begin"``,
    ``"rows"``, ``"changes"``, ``"fence"``, ``"last changes"``, ``"adopt"``, ``"finish"``): progress, or a test
    that stops the coordinator there.

    A move a coordinator left under way (it died) is settled first: finished if its first taker adopted the new map,
    given up otherwise; the waves go on from the map the cluster is at then (a cluster already at
    ``len(addresses)`` even shards has nothing to move).
    """
    began = time.monotonic()
    current = _settled_map(admin, addresses)
    old = list(admin.addresses[: current.num_shards])
    target = current.resized(len(addresses))
    slots = len(current.moves(target))
    if current.num_shards == len(addresses) and not slots:
        log.info("the cluster is at %d shards already (shard map version %d): nothing to move", len(addresses), current.version)
        return ScaleReport(len(old), len(addresses), current.version, 0, 0, 0, 0, time.monotonic() - began, 0.0)
    everyone = list(addresses) if len(addresses) > len(old) else old
    admin.reach(everyone)
    waves = current.waves(len(addresses), _wave_slots(admin, range(len(old)), settings.wave_rows))
    log.info("moving %d of %d slots from %d to %d shards in %d waves (shard map version %d -> %d)", slots, SLOTS,
             len(old), len(addresses), len(waves), current.version, waves[-1].version)
    pacer = _Pacer(settings.copy_share, settings.unpaced_s)
    done: list[_Wave] = []
    for to_map in waves:
        on_step("wave")
        done.append(_move(admin, current, to_map, everyone[: to_map.num_shards], settings, pacer, on_step))
        log.info("wave %d of %d: shard map version %d (%.1f s so far)", len(done), len(waves), to_map.version,
                 time.monotonic() - began)
        current = to_map
    report = ScaleReport(len(old), len(addresses), current.version, slots, sum(w.rows for w in done),
                         sum(w.changed for w in done), sum(w.rounds for w in done), time.monotonic() - began,
                         max(w.fenced_seconds for w in done), len(done), pacer.waited)
    log.info("moved %d slots (%d rows, %d changed rows in %d rounds) in %d waves, %.1f s (%.1f s paced); requests for "
             "a wave's slots waited %.3f s at most; shard map version %d on %d shards", slots, report.rows_moved,
             report.changed_rows, report.rounds, report.waves, report.seconds, report.paced_seconds,
             report.fenced_seconds, current.version, len(addresses))
    return report


def _wave_slots(admin: ShardAdmin, shards: Sequence[int], wave_rows: int) -> int:
    """Slots that hold about ``wave_rows`` rows of the cluster's tables (ids hash evenly over the slots)."""
    rows = sum(table["rows"] for shard in shards for table in admin.shard_stats(shard).get("tables", {}).values())
    return max(1, wave_rows * SLOTS // max(rows, 1))


def _move(admin: ShardAdmin, current: ShardMap, to_map: ShardMap, addresses: Sequence[str], settings: ScaleSettings,
          pacer: _Pacer, on_step: Callable[[str], None]) -> _Wave:
    """One wave: the complete move from ``current`` to ``to_map`` (``addresses``: its shards')."""
    moves = current.moves(to_map)
    sources = sorted({was for was, _ in moves.values()})
    takers = sorted({now for _, now in moves.values()})
    log.info("moving %d slots (shard map version %d -> %d): sources %s, takers %s", len(moves), current.version,
             to_map.version, sources, takers)
    began = time.monotonic()
    wave = _Wave()
    begun: list[int] = []
    adopting = False  # once the first taker was asked to adopt, the move may have gone through
    try:
        on_step("begin")
        for shard in sources:
            admin.handover(shard, Step.BEGIN, to_map, addresses)
            begun.append(shard)
        on_step("rows")
        pacer.restart()
        for shard in sources:
            while True:
                page = _sent(admin, shard, Step.ROWS)
                pacer.page_done()
                wave.rows += page.rows
                log.info("moving slots: %d rows sent (shard %d, %.1f s)", wave.rows, shard, time.monotonic() - began)
                if page.done:
                    break
        on_step("changes")
        while wave.rounds < settings.max_rounds:
            wave.rounds += 1
            written = sum(_sent(admin, shard, Step.CHANGES).rows for shard in sources)
            wave.changed += written
            if written < settings.settle_rows or wave.rounds == settings.max_rounds:
                break
            pacer.page_done()
        # no wait between the last unfenced round and the fence: the fenced round carries what the trainers change
        # meanwhile, and a wait of (1 / copy_share - 1) times the round would nearly triple it. The last round and
        # the fence are paced once the wave is done.
        on_step("fence")
        for shard in sources:
            admin.handover(shard, Step.FENCE)
        fenced = time.monotonic()
        on_step("last changes")
        wave.changed += sum(_sent(admin, shard, Step.CHANGES).rows for shard in sources)
        for shard in sources:  # the sightings of ids not admitted yet, which the sources count no more once fenced
            done = False
            while not done:
                done = _sent(admin, shard, Step.SIGHTINGS).done
        on_step("adopt")
        adopting = True
        admin.adopt(takers[0], to_map, addresses)
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
    missing = _tell(admin, takers[1:], lambda shard: admin.adopt(shard, to_map, addresses), "adopt the new map")
    on_step("finish")
    if not missing:
        _tell(admin, sources, lambda shard: admin.handover(shard, Step.FINISH, to_map, addresses),
              "finish (it will on its own: it asks the first taker)")
    wave.fenced_seconds = time.monotonic() - fenced
    _tell(admin, [s for s in range(to_map.num_shards) if s not in sources and s not in takers],
          lambda shard: admin.adopt(shard, to_map, addresses), "adopt the new map")
    if missing:
        raise PSError(f"the move to shard map version {to_map.version} went through, but shards {missing} did not adopt "
                      "it: the sources stay fenced and finish the move once those shards answer (handover_deadline_s)")
    pacer.page_done()  # the sources' work since the fence (the last round, and dropping the rows they handed over)
    return wave


def _sent(admin: ShardAdmin, source: int, step: "persia_pb2.HandoverStep.Step") -> persia_pb2.HandoverPage:
    """``source``'s answer to ``step``: the counts of the page it sent its takers. A shard that answers with the page
    itself predates shards sending pages to each other: no taker got it, so the move must not go on."""
    page = admin.handover(source, step)
    if page.records or page.sightings:
        raise PSError(f"shard {source} answered {Step.Step.Name(step)} with the page's content instead of sending it to "
                      "the takers: it runs an older version; upgrade every shard before moving slots")
    return page


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


def rescale_apart(current: Sequence[str], addresses: Sequence[str], settings: ScaleSettings = ScaleSettings(), *,
                  token: Optional[str] = None, tls_root_cert: Optional[str] = None) -> ScaleReport:
    """:func:`rescale` (and, draining, :func:`wait_drained`) in a process of its own, ``lightning-persia ps scale``:
    its calls and pacing stay off a trainer's interpreter (the rows themselves go from shard to shard)."""
    command = [sys.executable, "-m", "lightning_persia.cli", "ps", "scale", "--addresses", ",".join(current),
               "--to", ",".join(addresses), "--json"]
    for name, value in dataclasses.asdict(settings).items():
        command += [f"--{name.replace('_', '-')}", repr(value)]
    if tls_root_cert is not None:
        command += ["--tls-root-cert", str(tls_root_cert)]
    environment = {**os.environ, SHARD_PROCESS_ENV: "1", **({TOKEN_ENV: token} if token else {})}
    result = subprocess.run(command, capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        raise PSError(f"moving the slots from {list(current)} to {list(addresses)} failed (exit {result.returncode}):\n"
                      + result.stderr[-3000:])
    return ScaleReport(**json.loads(result.stdout.strip().splitlines()[-1]))
