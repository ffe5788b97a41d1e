"""The write-ahead log of one shard: what it records, how a restarted shard replays it, and which clients may go on.

:func:`open_shard_log` runs once at start, before the shard serves: it loads the checkpoint the log follows,
replays the log past it (:class:`ReplayReport` says how far it got, and how fast), and opens a new segment for
this process. A shard whose log replayed completely holds every write it acknowledged before it died, so the
clients of its earlier incarnations may go on without a rollback: :attr:`ShardLog.accepted` lists them.

A log that cannot be used is not trusted: one without its ``BASE.json`` or with segments missing, whose checkpoint
does not load (damaged or incomplete), that was written with ``durability: log`` before the machine restarted (its
last records may have been lost with the page cache), with a damaged record before its end, or whose replay fails
(an unknown table, a record that does not decode, a full disk). The shard then starts from ``restore_from`` (or
empty) with a fresh log, its clients roll back, and the old log is kept whole in a folder beside the new one
(``untrusted-*``), never deleted. A log whose checkpoint folder is missing or cannot be read is kept as it is and
the shard refuses to start, naming it: a volume not mounted yet is no reason to roll back.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.store.errors import CheckpointError
from lightning_persia.remote_ps.store.wal import changes as records
from lightning_persia.durable import fsync_path
from lightning_persia.remote_ps.store.wal.log import BASE_FILE, WriteAheadLog, read_base, segment_numbers, segment_path
from lightning_persia.remote_ps.store.wal.records import ReadEnd, read_records

log = logging.getLogger("lightning_persia.ps")


class ReplayTarget(Protocol):
    """What a replay needs of the shard's store (``shard_store.ShardStore``): the log does not import the store."""

    shard_index: int

    def load(self, directory: str, own_part: bool = False) -> None: ...

    def load_latest(self, root: str) -> str: ...

    def replay_configure(self, config: dict) -> None: ...

    def replay_change(self, change: records.Change) -> int: ...

    def replay_map(self, shard_map: ShardMap, addresses: Sequence[str] = ()) -> None: ...

    def replay_fence(self, fence: Optional[dict]) -> None: ...

    def replay_given_up(self, version: int) -> None: ...

    @property
    def fence(self) -> Optional[dict]: ...

    @property
    def given_up_version(self) -> int: ...

    @property
    def shard_map(self) -> ShardMap: ...

    @property
    def map_addresses(self) -> tuple[str, ...]: ...

    def clear(self) -> None: ...


def boot_id() -> str:
    """This boot of the machine (Linux); a log written without fsync is trusted only within the same boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass
class ReplayReport:
    """How the start of a shard went: what it loaded, what it replayed, and whether its clients may go on."""

    checkpoint: Optional[str] = None
    segments: int = 0
    records: int = 0
    rows: int = 0
    bytes_total: int = 0
    bytes_read: int = 0
    dropped_bytes: int = 0
    dropped: str = ""  # why the last bytes were not replayed (a torn record), if any
    seconds: float = 0.0  # the log's replay (after the checkpoint's load)
    load_seconds: float = 0.0  # the load of the checkpoint the log follows
    replayed: bool = False  # a log was found and replayed to its end
    not_trusted: str = ""  # why the clients of earlier incarnations must roll back, if they must

    def describe(self) -> str:
        rate = self.rows / self.seconds if self.seconds > 0 else 0.0
        text = (f"{self.records} records, {self.rows} rows of {self.segments} segments ({self.bytes_read / 1e6:.1f} MB) "
                f"in {self.seconds:.2f} s ({rate:,.0f} rows/s) after {self.checkpoint or 'empty tables'}"
                f"{f' (loaded in {self.load_seconds:.2f} s)' if self.checkpoint else ''}")
        if self.dropped_bytes:
            text += f"; dropped {self.dropped_bytes} bytes at the end ({self.dropped})"
        return text


class ShardLog:
    """The open log of a shard (:func:`open_shard_log` makes it). Thread-safe."""

    def __init__(self, wal: WriteAheadLog, incarnation: str, accepted: list[str], applied: dict[str, deque], window: int,
                 report: ReplayReport, max_clients: int = 4096, fence: Optional[dict] = None,
                 addresses: Sequence[str] = (), given_up: int = 0) -> None:
        self.wal = wal
        self._fence = fence  # the FENCE in force: every segment's OPEN repeats it, so a save's rotation keeps it
        self._given_up = given_up  # the GIVEN_UP in force, repeated likewise
        self._addresses = tuple(addresses)  # where the map's shards listen: every OPEN repeats them with the map
        self.incarnation = incarnation
        self.accepted = frozenset(accepted)
        self.report = report
        self._applied: OrderedDict[str, deque] = OrderedDict(applied)
        self._window = window
        self._max_clients = max_clients
        self._lock = threading.Lock()

    @property
    def durability(self) -> str:
        return self.wal.durability

    def record(self, change: records.Change) -> int:
        """Queues ``change`` (call it with the tables' locks held); its ticket for :meth:`wait`."""
        ticket = self.wal.append(records.encode_change(change))
        if change.client:
            with self._lock:
                seqs = self._applied.get(change.client)
                if seqs is None:
                    seqs = self._applied[change.client] = deque(maxlen=self._window)
                    if len(self._applied) > self._max_clients:  # as the exactly-once memory: least recent first
                        self._applied.popitem(last=False)
                else:
                    self._applied.move_to_end(change.client)
                seqs.append(change.seq)
        return ticket

    def applied_seqs(self) -> dict[str, list[int]]:
        """The seqs of each client's recent updates in the log (oldest first): the exactly-once memory of a restart."""
        with self._lock:
            return {client: list(seqs) for client, seqs in self._applied.items()}

    def record_map(self, shard_map: ShardMap, addresses: Sequence[str] = ()) -> int:
        """Queues the adoption of ``shard_map``, whose shards listen at ``addresses`` (empty: not known), so that a
        restarted shard still tells its clients where they are. Call it where no request runs (the routing gate
        passed alone)."""
        fence = self._fence
        if fence is not None and shard_map.version >= fence["to_map"]["version"]:
            self._fence = None  # the move went through
        self._addresses = tuple(addresses)
        return self.wal.append(records.encode(records.MAP, {"shard_map": map_value(shard_map, addresses)}))

    def record_fence(self, fence: Optional[dict]) -> int:
        """Queues a fence of the slots handed over (``{"to_map", "addresses"}``), or with ``None`` its end without
        the new map (the move given up); called where no request runs, like :meth:`record_map`."""
        self._fence = fence
        return self.wal.append(records.encode(records.FENCE, {"fence": fence}))

    def record_given_up(self, version: int) -> int:
        """Queues the newest map version a move to this shard was given up from (``0``: forgotten); called where no
        request runs, like :meth:`record_map`."""
        self._given_up = version
        return self.wal.append(records.encode(records.GIVEN_UP, {"version": version}))

    def record_configure(self, table: dict) -> int:
        """Queues a table's creation (call it holding the lock under which the table appears); its ticket."""
        return self.wal.append(records.encode(records.CONFIGURE, {"table": table}))

    def wait(self, ticket: int) -> None:
        self.wal.wait(ticket)

    def wait_all(self) -> None:
        """Returns once every record queued so far is written: whatever a caller has seen of the tables is then in
        the log."""
        self.wal.wait_all()

    def begin_base(self, base: Optional[str], shard_map: ShardMap) -> int:
        """Starts a segment after every record so far (a checkpoint's consistent point: call it with every table's
        lock held; ``shard_map``: the store's); the segment's number, for :meth:`end_base` once the checkpoint is
        complete."""
        return self.wal.rotate(self._opening(base, shard_map).encode())

    def end_base(self, segment: int, checkpoint: str) -> None:
        """``checkpoint`` holds every record before ``segment``: the log before it is deleted."""
        self.wal.set_base(segment, checkpoint)

    def close(self) -> None:
        self.wal.close()

    def _opening(self, base: Optional[str], shard_map: ShardMap) -> records.Opening:
        return records.Opening(self.incarnation, sorted(self.accepted), boot_id(), self.durability, self.applied_seqs(), base,
                               map_value(shard_map, self._addresses), self._fence, self._given_up)


def open_shard_log(store: ReplayTarget, directory: str, durability: str, incarnation: str, restore_from: Optional[str],
                   window: int, on_progress: Callable[[ReplayReport], None] = lambda report: None,
                   pause_s: float = 0.0) -> ShardLog:
    """Restores ``store`` from its log in ``directory`` (or from ``restore_from`` when the log cannot be used) and
    opens the log for this process (see the module docstring). Raises :class:`CheckpointError` when neither
    restores a shard that must be restored.

    ``on_progress(report)`` hears how the replay goes when it begins, every second, and at its end; ``pause_s``
    (testing only) sleeps after each replayed record."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    report = ReplayReport()
    accepted: set[str] = set()
    applied: dict[str, deque] = {}
    segments = segment_numbers(path)
    base = read_base(path)
    if segments:
        _check_readable(path, base)
        reason = (_left_behind(path, segments, base, restore_from)
                  or _replay(store, path, base, segments, report, accepted, applied, window, on_progress, pause_s))
        if reason:
            report.not_trusted, report.replayed = reason, False
            accepted.clear()
            applied.clear()
            store.clear()  # nothing of a replay that stopped half-way stays
            kept = _set_aside(path, segments)
            log.warning("shard %d: its write-ahead log in %s is not used (%s); its clients roll back; the log is kept in %s",
                        store.shard_index, path, reason, kept)
    if not report.replayed:
        report.checkpoint = store.load_latest(restore_from) if restore_from else None
    accepted.add(incarnation)
    opening = records.Opening(incarnation, sorted(accepted), boot_id(), durability,
                              {client: list(seqs) for client, seqs in applied.items()}, report.checkpoint,
                              map_value(store.shard_map, store.map_addresses), store.fence, store.given_up_version)
    wal = WriteAheadLog(path, durability, opening.encode())
    if not report.replayed:  # a fresh log: it follows what was just loaded, and the old segments go
        wal.set_base(wal.segment, report.checkpoint)
    return ShardLog(wal, incarnation, sorted(accepted), applied, window, report, fence=store.fence, addresses=store.map_addresses,
                    given_up=store.given_up_version)


def map_value(shard_map: ShardMap, addresses: Sequence[str]) -> dict:
    """A map as MAP and OPEN records hold it: :meth:`ShardMap.to_dict`, and its shards' addresses when known."""
    value = shard_map.to_dict()
    if addresses:
        value["addresses"] = list(addresses)
    return value


def _replay_map(store: ReplayTarget, value: dict) -> None:
    store.replay_map(ShardMap.from_dict(value), tuple(value.get("addresses", ())))


def _check_readable(path: Path, base: Optional[dict]) -> None:
    """Raises :class:`CheckpointError` when the checkpoint the log follows is missing or cannot be read: the shard does
    not start, and the log stays as it is for a start that can read it."""
    checkpoint = base.get("checkpoint") if base else None
    if not checkpoint:
        return
    try:
        os.listdir(checkpoint)
    except OSError as err:
        raise CheckpointError(
            f"the write-ahead log in {path} follows the checkpoint {checkpoint}, which cannot be read now "
            f"({err.strerror or err}); the shard does not start, so that a start that can read it replays the log with "
            f"no rollback. To start without it (its clients then roll back), move {path} away.") from None


def _left_behind(path: Path, segments: list[int], base: Optional[dict], restore_from: Optional[str]) -> str:
    """Why the log is older than the checkpoint this start was told to restore from, or "": its last record was
    written before ``restore_from`` (a checkpoint folder, not the one the log follows) was saved. Such a log was left
    by an earlier run of this shard, before the job went on elsewhere (another shard count, another cluster) and
    saved ``restore_from``; replayed, it would serve that earlier run's rows. A ``restore_from`` older than the log
    (the supervisor's last checkpoint, from before a later save or load) leaves the log trusted."""
    checkpoint = base.get("checkpoint") if base else None
    if not restore_from or not checkpoint or os.path.abspath(checkpoint) == os.path.abspath(restore_from):
        return ""
    manifests = list(Path(restore_from).glob("shard-*-of-*/manifest.json"))
    if not manifests:  # a folder of checkpoints, or none: nothing to compare with
        return ""
    written = max(segment_path(path, number).stat().st_mtime for number in segments)
    saved = min(manifest.stat().st_mtime for manifest in manifests)
    if written >= saved:
        return ""
    return (f"it follows {checkpoint} and its last record was written at {_utc(written)}, before restore_from "
            f"{restore_from} was saved ({_utc(saved)}): the log was left by an earlier run")


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _set_aside(path: Path, segments: list[int]) -> Path:
    """Moves the segments and the ``BASE.json`` of a log that is not used into a folder of their own beside it."""
    kept = path / time.strftime("untrusted-%Y%m%dT%H%M%S", time.gmtime())
    while kept.exists():
        kept = kept.with_name(kept.name + "+")
    kept.mkdir()
    for number in segments:
        os.replace(segment_path(path, number), segment_path(kept, number))
    if (path / BASE_FILE).exists():
        os.replace(path / BASE_FILE, kept / BASE_FILE)
    fsync_path(path)
    return kept


def _replay(store: ReplayTarget, path: Path, base: Optional[dict], segments: list[int], report: ReplayReport, accepted: set[str],
            applied: dict[str, deque], window: int, on_progress, pause_s: float) -> str:
    """Loads the log's checkpoint and replays the segments after it; returns why the log is not trusted, or ""."""
    try:
        return _replay_segments(store, path, base, segments, report, accepted, applied, window, on_progress, pause_s)
    except Exception as err:  # noqa: BLE001 - whatever stops a replay half-way makes the log unusable, not the shard
        return f"its replay failed: {type(err).__name__}: {err}"


def _replay_segments(store: ReplayTarget, path: Path, base: Optional[dict], segments: list[int], report: ReplayReport,
                     accepted: set[str], applied: dict[str, deque], window: int, on_progress, pause_s: float) -> str:
    if base is None:
        return f"no {path / 'BASE.json'} names the checkpoint it follows"
    first = int(base["segment"])
    if first not in segments:
        return f"its first segment {segment_path(path, first).name} is missing"
    following = [n for n in segments if n >= first]
    if following != list(range(first, first + len(following))):
        return f"segments are missing between {following[0]} and {following[-1]}"
    started = time.monotonic()
    report.checkpoint = base["checkpoint"]
    opening = _first_opening(segment_path(path, first))
    if opening is not None and opening.shard_map is not None:  # the checkpoint's rows are sifted by the map it had
        _replay_map(store, opening.shard_map)
    try:
        if report.checkpoint:
            store.load(report.checkpoint, own_part=True)  # the other shards may not have finished that save
    except CheckpointError as err:
        return f"its checkpoint {report.checkpoint} does not load: {err}"
    report.load_seconds = time.monotonic() - started
    started = time.monotonic()
    report.segments = len(following)
    report.bytes_total = sum(segment_path(path, n).stat().st_size for n in following)
    this_boot = boot_id()
    on_progress(report)
    last_report = time.monotonic()
    for number in following:
        end = ReadEnd()
        with open(segment_path(path, number), "rb") as stream:
            for payload in read_records(stream, end):
                report.bytes_read += len(payload)
                try:
                    kind, meta, tensors = records.decode(payload)
                except records.RecordFormatError as err:
                    raise CheckpointError(f"{segment_path(path, number)}: {err}") from None
                if kind == records.OPEN:
                    opening = records.Opening.from_meta(meta)
                    accepted.update(opening.accepted)
                    for client, seqs in opening.applied.items():
                        applied.setdefault(client, deque(maxlen=window)).extend(seqs)
                    if opening.boot_id != this_boot and opening.durability != "fsync":
                        return (f"segment {number} was written with durability {opening.durability!r} before the "
                                "machine restarted: its last acknowledged records may be lost")
                    if opening.shard_map is not None:
                        _replay_map(store, opening.shard_map)
                    store.replay_fence(opening.fence)
                    store.replay_given_up(opening.given_up)
                elif kind == records.FENCE:
                    store.replay_fence(meta["fence"])
                elif kind == records.GIVEN_UP:
                    store.replay_given_up(int(meta["version"]))
                elif kind == records.CONFIGURE:
                    store.replay_configure(meta["table"])
                elif kind == records.MAP:
                    _replay_map(store, meta["shard_map"])
                elif kind == records.CHANGE:
                    change = records.decode_change(meta, tensors)
                    report.rows += store.replay_change(change)
                    if change.client:
                        applied.setdefault(change.client, deque(maxlen=window)).append(change.seq)
                report.records += 1
                if pause_s:
                    time.sleep(pause_s)
                if time.monotonic() - last_report >= 1.0:
                    last_report = time.monotonic()
                    report.seconds = last_report - started
                    on_progress(report)
        if end.damaged:
            return (f"{segment_path(path, number).name} holds a damaged record followed by whole ones ({end.reason}): "
                    "acknowledged records after it cannot be replayed in order")
        if end.dropped_bytes:
            report.dropped_bytes += end.dropped_bytes
            report.dropped = f"{segment_path(path, number).name}: {end.reason}"
            os.truncate(segment_path(path, number), end.valid_bytes)  # never a torn record in the middle of the log
    report.seconds = time.monotonic() - started
    report.replayed = True
    on_progress(report)
    return ""


def _first_opening(segment: Path) -> Optional[records.Opening]:
    """The OPEN record a segment begins with, if it can be read."""
    with open(segment, "rb") as stream:
        for payload in read_records(stream, ReadEnd()):
            kind, meta, _ = records.decode(payload)
            return records.Opening.from_meta(meta) if kind == records.OPEN else None
    return None
