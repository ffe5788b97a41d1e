"""A move's rows go from its sources straight to its takers (``remote_ps/handover_delivery.py``): the coordinator hears
counts alone, each taker is sent only the rows the new map gives it, and a page a taker did not take is sent again."""
import os
import sys
import threading

import pytest
import torch

from lightning_persia.remote_ps.client import PSClient, RetryPolicy
from lightning_persia.remote_ps.client.errors import PSError
from lightning_persia.remote_ps.client.scaling import ScaleSettings, Step, rescale
from lightning_persia.remote_ps.config import load_ps_config
from lightning_persia.remote_ps.server import Endpoint, ShardServer
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.table_config import Adam, TableConfig

CONFIG = TableConfig("t", 4, optimizer=Adam(lr=0.1))
IDS = torch.arange(0, 6000) * 7919 - 11


class Cluster:
    """Shards served in this process, ``count`` of them at first; ``grow`` adds empty ones. With ``token``, a shard
    answers only calls that carry it."""

    def __init__(self, count: int, token=None, overrides=()) -> None:
        self.servers = []
        self._token, self._overrides = token, list(overrides)
        for shard in range(count):
            self._serve(ShardStore(shard, count, seed=5))

    def _serve(self, store: ShardStore) -> None:
        server = ShardServer(store, load_ps_config(None, self._overrides), Endpoint(token=self._token))
        server.start()
        self.servers.append(server)

    @property
    def addresses(self) -> list[str]:
        return [server.address for server in self.servers]

    def grow(self, count: int) -> list[str]:
        for shard in range(len(self.servers), count):
            self._serve(ShardStore(shard, count, seed=5))
        return self.addresses

    def taken(self, shard: int) -> list[torch.Tensor]:
        """Records the ids of every row and removal sent to ``shard`` (before it keeps its part); returns the list."""
        store, seen = self.servers[shard].servicer.store, []
        take = store.take_changes

        def recorded(configs, changes, to_map):
            seen.extend(part.rows["ids"] for change in changes for part in change.tables if part.rows)
            seen.extend(part.removed for change in changes for part in change.tables)
            return take(configs, changes, to_map)
        store.take_changes = recorded
        return seen

    def close(self) -> None:
        for server in self.servers:
            server.stop(0)


@pytest.fixture
def trained():
    """Two shards holding every row of IDS, written once; and their values."""
    cluster = Cluster(2)
    client = PSClient(cluster.addresses)
    client.configure([CONFIG])
    client.lookup({"t": IDS}, train=True)
    client.update({"t": (IDS, torch.ones(IDS.numel(), 4))})
    yield cluster, client, client.lookup({"t": IDS}, train=False, wire_dtype="fp32")["t"]
    client.close()
    cluster.close()


def test_the_coordinator_hears_counts_alone_while_the_taker_ends_with_every_row(trained):
    cluster, client, before = trained
    grown = cluster.grow(3)
    answers = []
    with PSClient(grown) as admin:
        handover = admin.handover

        def heard(shard, step, *args):
            answer = handover(shard, step, *args)
            answers.append((step, answer))
            return answer
        admin.handover = heard
        report = rescale(admin, grown)
        held = [admin.shard_stats(shard)["tables"]["t"]["rows"] for shard in range(3)]
    pages = [answer for step, answer in answers if step in (Step.ROWS, Step.CHANGES, Step.SIGHTINGS)]
    assert pages and report.rows_moved == sum(answer.rows for step, answer in answers if step == Step.ROWS) > 0
    assert not any(answer.records or answer.tables_json or answer.sightings or answer.applied_json for answer in pages)
    assert held[2] == report.rows_moved and sum(held) == IDS.numel()
    assert torch.equal(client.lookup({"t": IDS}, train=False, wire_dtype="fp32")["t"], before)


def test_a_drained_shards_takers_are_each_sent_only_their_own_rows():
    cluster = Cluster(3)
    client = PSClient(cluster.addresses)
    client.configure([CONFIG])
    client.lookup({"t": IDS}, train=True)
    before = client.lookup({"t": IDS}, train=False, wire_dtype="fp32")["t"]
    drained = int((client.shard_map.shard_of(IDS) == 2).sum())
    sent = {shard: cluster.taken(shard) for shard in (0, 1)}
    with PSClient(cluster.addresses) as admin:
        shrunk = rescale(admin, cluster.addresses[:2])
    for shard, ids in sent.items():
        ids = torch.cat(ids)
        assert ids.numel() and bool((shrunk_map(client).shard_of(ids) == shard).all()), shard
    assert sum(torch.cat(ids).numel() for ids in sent.values()) == drained == shrunk.rows_moved
    assert torch.equal(client.lookup({"t": IDS}, train=False, wire_dtype="fp32")["t"], before)
    client.close()
    cluster.close()


def shrunk_map(client: PSClient):
    client.lookup({"t": IDS[:1]}, train=False)  # hears the map moved and fetches it
    return client.shard_map


def test_a_page_a_taker_did_not_take_is_sent_again_before_any_other(trained):
    """The taker is down when the first page is due: the source's step fails (UNAVAILABLE, naming the taker) and
    keeps the page; once the taker serves, the step called again sends it that page, then the next ones."""
    cluster, client, before = trained
    grown = cluster.grow(3)
    taker = cluster.servers[2]
    taker.stop(0)
    with PSClient(grown, retry=RetryPolicy(timeout_s=5, max_retries=0)) as admin:
        to_map = admin.shard_map_of(0)[0].resized(3)
        admin.handover(0, Step.BEGIN, to_map, grown)
        with pytest.raises(PSError, match=f"taker shard 2 \\({grown[2]}\\) did not take the page: UNAVAILABLE"):
            admin.handover(0, Step.ROWS)
        with pytest.raises(PSError, match="the page of handover step ROWS did not reach every taker yet"):
            admin.handover(0, Step.CHANGES)
        port = int(grown[2].rsplit(":", 1)[1])
        cluster.servers[2] = ShardServer(ShardStore(2, 3, seed=5), load_ps_config(None, []), Endpoint(port=port))
        cluster.servers[2].start()
        admin.retry = RetryPolicy(timeout_s=5, max_retries=20, max_backoff_s=0.5)
        rows = 0
        while True:
            page = admin.handover(0, Step.ROWS)
            rows += page.rows
            if page.done:
                break
        moving = int(((client.shard_map.shard_of(IDS) == 0) & (to_map.shard_of(IDS) == 2)).sum())
        assert rows == moving > 0
        assert admin.shard_stats(2)["tables"]["t"]["rows"] == moving
        admin.handover(0, Step.ABORT, to_map)
        admin.handover(2, Step.ABORT, to_map)
    assert torch.equal(client.lookup({"t": IDS}, train=False, wire_dtype="fp32")["t"], before)


def test_a_cluster_with_a_token_moves_its_rows_from_shard_to_shard():
    """The source calls the taker with the cluster's token (a taker answers no call without it)."""
    cluster = Cluster(2, token="the-cluster's")
    client = PSClient(cluster.addresses, token="the-cluster's")
    client.configure([CONFIG])
    client.lookup({"t": IDS}, train=True)
    before = client.lookup({"t": IDS}, train=False, wire_dtype="fp32")["t"]
    grown = cluster.grow(3)
    with PSClient(grown, token="the-cluster's") as admin:
        assert rescale(admin, grown).rows_moved == admin.shard_stats(2)["tables"]["t"]["rows"] > 0
    assert torch.equal(client.lookup({"t": IDS}, train=False, wire_dtype="fp32")["t"], before)
    client.close()
    cluster.close()


def test_a_move_is_given_up_when_a_source_answers_with_the_page_itself(trained):
    """A shard of an older version answers a step with the page's rows and sends the takers nothing: the coordinator
    gives the move up rather than let it go through without them."""
    cluster, client, before = trained
    grown = cluster.grow(3)
    with PSClient(grown) as admin:
        handover = admin.handover

        def older(shard, step, *args):
            answer = handover(shard, step, *args)
            if step == Step.ROWS:
                answer.records.append(b"a page's rows")
            return answer
        admin.handover = older
        with pytest.raises(PSError, match="shard 0 answered ROWS with the page's content instead of sending it"):
            rescale(admin, grown)
        assert [admin.shard_map_of(shard)[0].version for shard in range(3)] == [0, 0, 0]
    assert torch.equal(client.lookup({"t": IDS}, train=False, wire_dtype="fp32")["t"], before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="only Linux gives a thread a nice value of its own: elsewhere a move runs as it did before move_nice, at the shard's priority (move_thread.py), so there is no lower one to check")
def test_a_moves_pages_are_given_and_taken_below_the_requests_priority_but_the_fenced_ones():
    """The rows and the unfenced rounds, given and taken, and the sources' drop run on the shards' move threads at
    ``PSConfig.move_nice``; the fenced round, which requests for the slots wait for, on the calls' own threads."""
    cluster = Cluster(2, overrides=["move_nice=19"])
    client = PSClient(cluster.addresses)
    client.configure([CONFIG])
    client.lookup({"t": IDS}, train=True)
    before = client.lookup({"t": IDS}, train=False, wire_dtype="fp32")["t"]
    grown = cluster.grow(3)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen = []

    def where(what, call):
        def recorded(*args, **kwargs):
            seen.append((what, threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
            return call(*args, **kwargs)
        return recorded
    taker = cluster.servers[2].servicer.store
    taker.take_changes = where("taken", taker.take_changes)
    for server in cluster.servers[:2]:
        store = server.servicer.store
        store.handover_changes = where("round", store.handover_changes)
        store.finish_handover = where("drop", store.finish_handover)

    def written_at(step):  # a write between the last unfenced round and the fence travels in the fenced round
        if step == "fence":
            client.update({"t": (IDS, torch.ones(IDS.numel(), 4))})
    with PSClient(grown) as admin:
        rescale(admin, grown, ScaleSettings(max_rounds=1), on_step=written_at)
    moved = {(what, name.startswith(("ps-give", "ps-take")), nice) for what, name, nice in seen}
    low = min(19, base + 19)
    assert ("taken", True, low) in moved and ("taken", False, base) in moved  # rows; the fenced round's changes
    assert ("round", True, low) in moved and ("round", False, base) in moved  # unfenced; fenced
    assert ("drop", True, low) in moved and not any(what == "drop" and not on for what, on, _ in moved)
    # the write went with the fenced round, once: Adam's step at a constant gradient is lr
    assert torch.allclose(client.lookup({"t": IDS}, train=False, wire_dtype="fp32")["t"], before - 0.1, atol=1e-4)
    client.close()
    cluster.close()
