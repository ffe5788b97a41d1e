"""The servicer's handling of requests that race a live move, on one in-process shard."""
import threading

import grpc
import pytest
import torch

from lightning_persia.ops import wire
from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.config import PSConfig
from lightning_persia.remote_ps.protocol import persia_pb2 as pb
from lightning_persia.remote_ps.servicer import PSServicer
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.wal.changes import Change, TableChange
from lightning_persia.remote_ps.table_config import SGD, Constant, TableConfig


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code


class _Context:
    """What the servicer asks of a gRPC context: no metadata in, a refusal out as an exception."""

    def invocation_metadata(self):
        return ()

    def set_trailing_metadata(self, metadata) -> None:
        pass

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Refused(code, details)


def _update(table: str, ids: torch.Tensor, grads: torch.Tensor, map_version: int) -> pb.UpdateRequest:
    return pb.UpdateRequest(client_id="trainer", seq=1, map_version=map_version, packed_dtype=pb.FP32,
                            packed=pb.PackedIds(tables=[table], counts=[ids.numel()], ids=wire.encode_ids(ids)),
                            packed_grads=wire.encode_rows(grads, "fp32"))


def _moving_to_shard_0(old: ShardMap, new: ShardMap) -> torch.Tensor:
    """An id that ``old`` gives another shard and ``new`` gives shard 0."""
    ids = torch.arange(100_000)
    picked = ids[(old.shard_of(ids) != 0) & (new.shard_of(ids) == 0)]
    assert picked.numel(), "the drain gives shard 0 no slot"
    return picked[:1]


def _rows_handed_over(config: TableConfig, ids: torch.Tensor, to_map: ShardMap, value: float) -> dict[str, torch.Tensor]:
    """The rows of ``ids`` (their weights set to ``value``) as the shard that owns them hands them over."""
    owner = ShardStore(int(ShardMap.uniform(3).shard_of(ids)[0]), 3, seed=7)
    owner.configure(config)
    owner.lookup_many([(config.name, ids)], True)
    owner.update_many([(config.name, ids, torch.full((ids.numel(), config.dim), -value))])
    pages = [rows for _, _, rows in owner.begin_handover(to_map) if rows]
    owner.abort_handover()
    assert len(pages) == 1 and torch.equal(pages[0]["ids"], ids), pages
    return pages[0]


def test_an_update_routed_by_a_map_the_shard_has_not_adopted_waits_for_it_and_lands_after_the_last_change():
    """A drain has two takers, which adopt the new map one after the other. A trainer that heard the map from the
    first may reach the second before it adopted, while a last change of its rows is still on the way: the update
    must wait for the adoption, and apply on top of that change (not be refused as a disagreement, nor be
    overwritten by the change)."""
    config = TableConfig("t", 2, optimizer=SGD(lr=1.0), init=Constant(0.0))
    store = ShardStore(0, 3, seed=7)
    store.configure(config)
    old = store.shard_map
    two = old.resized(2)
    moving = _moving_to_shard_0(old, two)
    servicer = PSServicer(store, PSConfig())
    outcome: dict = {}

    def send() -> None:
        try:
            outcome["response"] = servicer.Update(_update("t", moving, torch.ones(1, 2), two.version), _Context())
        except Exception as err:  # noqa: BLE001 - the test reports it
            outcome["error"] = err

    sender = threading.Thread(target=send)
    sender.start()
    sender.join(0.5)
    assert sender.is_alive(), f"the update did not wait for the adoption: {outcome}"
    last_change = _rows_handed_over(config, moving, two, value=5.0)
    store.take_changes([config], [Change([TableChange("t", 0, rows=last_change)])], two)
    store.adopt_map(two)
    sender.join(30)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["response"].rows_applied == 1 and outcome["response"].map_version == two.version
    assert torch.equal(store.lookup_many([("t", moving)], False)[0], torch.full((1, 2), 4.0))


def test_a_request_routed_by_a_map_never_adopted_is_refused_as_retryable_after_the_wait(monkeypatch):
    monkeypatch.setattr("lightning_persia.remote_ps.servicer.HANDOVER_WAIT_S", 0.2)
    store = ShardStore(0, 3, seed=7)
    store.configure(TableConfig("t", 2, optimizer=SGD(lr=1.0)))
    two = store.shard_map.resized(2)
    moving = _moving_to_shard_0(store.shard_map, two)
    with pytest.raises(_Refused, match="routed by shard map version 1, which this shard has not adopted yet") as refused:
        PSServicer(store, PSConfig()).Update(_update("t", moving, torch.ones(1, 2), two.version), _Context())
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE  # the client retries it
