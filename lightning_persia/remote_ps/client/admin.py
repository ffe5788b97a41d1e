"""The client's calls off the training hot path: tables, checkpoints, serving deltas, stats and health.

:class:`ShardAdmin` adds them to a :class:`ShardConnection`; :class:`~lightning_persia.remote_ps.client.PSClient`
adds the lookups and updates on top. Each call goes to every shard (``Describe``: shard 0) and waits for all.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import grpc.aio
from grpc_health.v1 import health_pb2

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps import handover_wire, remote_folder
from lightning_persia.remote_ps.client.connection import ShardConnection
from lightning_persia.remote_ps.client.errors import PSError, ShardUnavailableError
from lightning_persia.remote_ps.protocol import SERVICE_NAME, persia_pb2
from lightning_persia.remote_ps.table_config import TableConfig


@dataclass(frozen=True)
class ShardWait:
    """What :meth:`PSClient.wait_healthy` reports while a shard has not answered yet."""

    shard: int
    address: str
    waited_s: float
    timeout_s: float
    last_error: str  # why the last health check failed


WaitCallback = Callable[[ShardWait], None]


class ShardAdmin(ShardConnection):
    """Tables, checkpoints, deltas, stats and health checks of every shard (see :class:`ShardConnection`).

    ``checkpoint_timeout_s``: deadline of a save, a load or a delta; the other calls take ``retry.timeout_s``.
    """

    def __init__(self, addresses: Sequence[str], *, checkpoint_timeout_s: float = 3600.0, **connection: Any) -> None:
        super().__init__(addresses, **connection)
        self.checkpoint_timeout_s = checkpoint_timeout_s

    # ---- tables --------------------------------------------------------------------------------------

    def configure(self, tables: Sequence[TableConfig]) -> List[TableConfig]:
        """Creates the tables on every shard (or checks them against existing ones); returns the configs in force."""
        request = persia_pb2.ConfigureRequest(tables_json=[json.dumps(t.to_dict()) for t in tables])
        responses = self._all("Configure", request, self.retry.timeout_s)
        configs = [[TableConfig.from_dict(json.loads(text)) for text in r.tables_json] for r in responses]
        for shard, shard_configs in enumerate(configs[1:], start=1):
            if shard_configs != configs[0]:
                raise PSError(f"shards 0 and {shard} hold different configurations of the same tables: {configs[0]} vs {shard_configs}")
        self._dims.update((c.name, c.dim) for c in configs[0])
        return configs[0]

    def describe(self, names: Optional[Sequence[str]] = None) -> Dict[str, TableConfig]:
        """Configurations of the given tables (default: all tables), as shard 0 holds them."""
        response = self._wait(self._call(0, "Describe", persia_pb2.DescribeRequest(names=list(names or ())), self.retry.timeout_s))
        configs = [TableConfig.from_dict(json.loads(text)) for text in response.tables_json]
        self._dims.update((c.name, c.dim) for c in configs)
        return {c.name: c for c in configs}

    # ---- checkpoints and deltas ----------------------------------------------------------------------

    def save(self, directory: Union[str, os.PathLike]) -> None:
        """Every shard writes its part of a checkpoint under ``directory``: a path all shards can reach, or an
        ``fsspec`` URL (``s3://bucket/run/step-100``) that each shard uploads its part to (``remote_ps/remote_folder.py``).

        Each shard's folder appears atomically; all carry one save id, so a save into the same directory that
        is interrupted half-way leaves a checkpoint that loads refuse. Save into a fresh directory to keep the
        previous checkpoint loadable until this one is complete.
        """
        request = persia_pb2.SaveRequest(directory=_folder(directory), save_id=uuid.uuid4().hex)
        self._all("Save", request, self.checkpoint_timeout_s)

    def load(self, directory: Union[str, os.PathLike]) -> None:
        """Every shard replaces its tables by its part of the checkpoint under ``directory`` (any shard count)."""
        self._all("Load", persia_pb2.LoadRequest(directory=_folder(directory)), self.checkpoint_timeout_s)
        self._dims.clear()

    def save_delta(self, directory: Union[str, os.PathLike], save_id: str, base_id: str = "") -> None:
        """Every shard writes under ``directory`` what changed since the delta ``base_id`` (an earlier ``save_id``).

        A shard that does not know ``base_id`` (empty, forgotten, or the shard restarted or loaded a checkpoint
        since) writes its tables whole; its manifest says so per table (``since: 0``). Used by
        ``lightning_persia.serving.PublishDeltas``.
        """
        request = persia_pb2.SaveDeltaRequest(directory=_folder(directory), save_id=save_id, base_id=base_id)
        self._all("SaveDelta", request, self.checkpoint_timeout_s)

    def stage_delta(self, directory: Union[str, os.PathLike], version: int, base_version: int) -> int:
        """Read-only shards read and check the delta's tables at ``directory`` (from ``base_version`` to ``version``)
        without applying them; returns the rows they will write. Nothing is staged on a shard that refuses it."""
        request = persia_pb2.StageDeltaRequest(directory=_folder(directory), version=version, base_version=base_version)
        return sum(response.rows for response in self._all("StageDelta", request, self.checkpoint_timeout_s))

    def commit_delta(self, version: int) -> None:
        """Read-only shards apply the delta they staged for ``version`` (a shard at ``version`` already does nothing)."""
        self._all("CommitDelta", persia_pb2.CommitDeltaRequest(version=version), self.checkpoint_timeout_s)

    # ---- the shard map and slots moving between shards (client/scaling.py) --------------------------

    def shard_map_of(self, shard: int = 0) -> Tuple[ShardMap, List[str]]:
        """The shard map ``shard`` routes by, and the addresses of its shards when it knows them."""
        response = self._wait(self._call(shard, "GetShardMap", persia_pb2.GetShardMapRequest(), self.retry.timeout_s))
        return handover_wire.map_of(response)

    def handover(self, shard: int, step: "persia_pb2.HandoverStep.Step", shard_map: Optional[ShardMap] = None,
                 addresses: Sequence[str] = ()) -> persia_pb2.HandoverPage:
        """One step of ``shard``'s handover of slots to others (see ``HandoverStep`` in ``persia.proto``)."""
        request = persia_pb2.HandoverStep(step=step)
        if shard_map is not None:
            request.map.CopyFrom(handover_wire.map_message(shard_map, addresses))
        return self._wait(self._call(shard, "Handover", request, self.checkpoint_timeout_s))

    def adopt(self, shard: int, to_map: ShardMap, addresses: Sequence[str] = ()) -> None:
        """Makes ``to_map`` the map of ``shard`` (``addresses``: its shards'), which took the rows a move gave it (the
        sources sent them: ``HandoverStep``)."""
        request = persia_pb2.TakeOverRequest(page=persia_pb2.HandoverPage(), to_map=handover_wire.map_message(to_map, addresses),
                                             adopt=True)
        self._wait(self._call(shard, "TakeOver", request, self.checkpoint_timeout_s))

    def reach(self, addresses: Sequence[str]) -> None:
        """Talks to the shards of ``addresses`` from now on (shards added or drained; see ``ShardConnection._reach``)."""
        async def reach() -> None:
            self._reach(addresses)
        self._wait(reach())

    # ---- stats and health ----------------------------------------------------------------------------

    def stats(self) -> List[Dict[str, Any]]:
        """Per shard: ``{"shard_index", "num_shards", "address", "tables": {...}, "server": {...}}``."""
        return [self._stats_of(shard, response)
                for shard, response in enumerate(self._all("Stats", persia_pb2.StatsRequest(), self.retry.timeout_s))]

    def shard_stats(self, shard: int) -> Dict[str, Any]:
        """:meth:`stats` of one shard."""
        return self._stats_of(shard, self._wait(self._call(shard, "Stats", persia_pb2.StatsRequest(), self.retry.timeout_s)))

    def _stats_of(self, shard: int, response: persia_pb2.StatsResponse) -> Dict[str, Any]:
        return {"shard_index": response.shard_index, "num_shards": response.num_shards, "address": self._channel_addresses[shard],
                "incarnation": response.incarnation, **json.loads(response.json)}

    def wait_healthy(
        self, timeout_s: float = 60.0, *, on_wait: Optional[WaitCallback] = None, report_every_s: float = 5.0,
    ) -> None:
        """Waits until every shard reports SERVING and is the shard its position says it is.

        Also records every shard's incarnation: from then on a shard that restarts refuses this client's
        lookups, updates and saves (:class:`ShardRestartedError`) until it is called again.

        Args:
            timeout_s: how long a shard may take to answer; then :class:`ShardUnavailableError`.
            on_wait: called as ``on_wait(ShardWait(...))`` every ``report_every_s`` seconds for each shard that
                has not answered yet (on the client's thread), so that a long wait is never silent.
            report_every_s: seconds between two reports on one shard.
        """
        if report_every_s <= 0:
            raise ValueError(f"report_every_s must be > 0, got {report_every_s}")
        self._wait(self._wait_healthy(timeout_s, on_wait, report_every_s))
        self.refresh_incarnations()

    def refresh_incarnations(self) -> List[str]:
        """Reads every shard's current incarnation and accepts it (after a restart has been dealt with)."""
        stats = self.stats()
        check_shard_order(self.addresses, [(entry["shard_index"], entry["num_shards"]) for entry in stats])
        self.incarnations = [entry["incarnation"] or None for entry in stats]
        return list(self.incarnations)

    async def _wait_healthy(self, timeout_s: float, on_wait: Optional[WaitCallback], report_every_s: float) -> None:
        start = time.monotonic()

        async def one(shard: int) -> None:
            last = "no answer yet"
            tries = 0
            next_report = report_every_s
            while True:
                tries += 1
                remaining = timeout_s - (time.monotonic() - start)
                try:
                    response = await self._health[shard].Check(
                        health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=max(0.05, min(2.0, remaining)),
                        metadata=self._metadata or None,
                    )
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                    last = f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
                except grpc.aio.AioRpcError as err:
                    last = f"{err.code().name}: {err.details()}"
                waited = time.monotonic() - start
                if waited + 0.1 > timeout_s:
                    raise ShardUnavailableError(shard, self.addresses[shard], tries, waited, last)
                if on_wait is not None and waited >= next_report:
                    next_report += report_every_s
                    on_wait(ShardWait(shard, self.addresses[shard], waited, timeout_s, last))
                await asyncio.sleep(0.1)

        await self._gather(one(shard) for shard in range(self.num_shards))


def check_shard_order(addresses: Sequence[str], identities: Sequence[Tuple[int, int]]) -> None:
    """Raises :class:`PSError` unless ``addresses[i]`` is shard ``i`` of ``len(addresses)`` for every ``i``.

    The message names every address that is out of place, what it is, and the list the shards ask for.
    """
    wrong = [(shard, address, index, count) for shard, (address, (index, count)) in enumerate(zip(addresses, identities))
             if (index, count) != (shard, len(addresses))]
    if not wrong:
        return
    listed = len(addresses)
    details = "; ".join(f"{address} is shard {index} of {count}, listed as shard {shard} of {listed}"
                        for shard, address, index, count in wrong)
    counts = sorted({count for _, count in identities})
    if counts != [listed]:
        advice = (f"the shards answering are part of a cluster of {' or '.join(map(str, counts))} shards, but "
                  f"{listed} address{'es are' if listed != 1 else ' is'} listed: list every shard of the cluster, once each")
    else:
        by_index = {index: address for address, (index, _) in zip(addresses, identities)}
        advice = ("pass the addresses in shard order: " + ", ".join(by_index[i] for i in range(listed))
                  if len(by_index) == listed else "an address is listed twice: list every shard of the cluster, once each")
    raise PSError(f"the parameter-server addresses do not match the shards: {details}. {advice} "
                  f"(listed: {', '.join(addresses)})")


def _folder(directory: Union[str, os.PathLike]) -> str:
    """``directory`` as the shards are sent it: a remote URL as it is, a path or ``file://`` URL made absolute."""
    directory = os.fspath(directory)
    return directory if remote_folder.is_remote(directory) else remote_folder.local_path(directory)
