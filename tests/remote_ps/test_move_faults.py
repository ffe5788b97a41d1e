"""Kills at each point of a live move of slots (``client/scaling.py``, ``remote_ps/move_settling.py``): real shard
processes with write-ahead logs, killed with SIGKILL. Each move either goes through or rolls back to the old map, every
acknowledged update is there (compared with one store that never moved and applied exactly the acknowledged ones), and
a later move succeeds."""
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.client import PSClient, RetryPolicy
from lightning_persia.remote_ps.client.errors import PSError
from lightning_persia.remote_ps.client.scaling import ScaleSettings, rescale
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.protocol import persia_pb2
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.table_config import SGD, Adam, TableConfig

CONFIG = TableConfig("t", 4, optimizer=Adam(lr=0.1))
UNIVERSE = torch.arange(0, 4000) * 7919 - 11


def logged_shards(tmp_path, deadline_s: float = 1.0) -> LocalShards:
    """Two shards that log every update, come back when killed, and settle a fenced move ``deadline_s`` after its
    coordinator's last step."""
    return LocalShards(2, overrides=["seed=5", "durability=log", f"wal_dir={tmp_path / 'wal'}",
                                     f"handover_deadline_s={deadline_s}"], restart=True)


class Acknowledged:
    """A client's updates, each applied to one store that never moved once the cluster acknowledged it."""

    def __init__(self, addresses) -> None:
        self.client = PSClient(addresses, retry=RetryPolicy(retry_for_s=60))
        self.client.wait_healthy(60)
        self.client.configure([CONFIG])
        self.model = ShardStore(0, 1, seed=5)
        self.model.configure(CONFIG)
        self._generator = torch.Generator().manual_seed(3)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            ids = UNIVERSE[torch.randperm(UNIVERSE.numel(), generator=self._generator)[:500]]
            grads = torch.randn(ids.numel(), 4, generator=self._generator)
            found = self.client.lookup({"t": ids}, train=True, wire_dtype="fp32")["t"]
            assert torch.equal(found, self.model.lookup("t", ids, train=True))
            self.client.update({"t": (ids, grads)}, wire_dtype="fp32")
            self.model.update("t", ids, grads)

    def check(self, shards: int) -> None:
        """Every acknowledged update is in the cluster, once, and no row is held twice."""
        found = self.client.lookup({"t": UNIVERSE}, train=False, wire_dtype="fp32")["t"]
        assert torch.equal(found, self.model.lookup("t", UNIVERSE, train=False))
        held = [entry["tables"]["t"]["rows"] for entry in self.client.stats()[:shards]]
        assert sum(held) == self.model.stats()["t"]["rows"], held

    def close(self) -> None:
        self.client.close()


def versions(admin: PSClient, shards) -> list[int]:
    return [admin.shard_map_of(s)[0].version for s in shards]


def settled(admin: PSClient, shards) -> dict[str, int]:
    """How many moves ``shards`` finished and rolled back without their coordinator."""
    counts = [admin.shard_stats(s)["server"]["moves_settled"] for s in shards]
    return {way: sum(count[way] for count in counts) for way in ("finished", "rolled_back")}


COORDINATOR = """
import sys, time
from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.client import scaling

stop_at, current, to = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
settings = scaling.ScaleSettings(wave_rows=int(sys.argv[4])) if len(sys.argv) > 4 else scaling.ScaleSettings()
seen = []

def at(step):  # stop_at: a step ("rows"), or its n-th time ("wave 2")
    seen.append(step)
    if stop_at in (step, f"{step} {seen.count(step)}"):
        stop()

def stop():
    print("STOPPED", flush=True)
    time.sleep(3600)

if stop_at == "a rows page":  # after the first page of rows reached the taker, before the others
    handover = PSClient.handover
    def handover_once(admin, shard, step, *args):
        page = handover(admin, shard, step, *args)
        if step == scaling.Step.ROWS and page.rows:
            stop()
        return page
    PSClient.handover = handover_once
with PSClient(current) as admin:
    scaling.rescale(admin, to, settings, on_step=at)
print("DONE", flush=True)
"""


def kill_coordinator_at(step: str, current, to, wave_rows: int = ScaleSettings.wave_rows) -> None:
    """Runs ``ps scale``'s coordinator in a process of its own and SIGKILLs it at ``step``."""
    process = subprocess.Popen([sys.executable, "-c", COORDINATOR, step, ",".join(current), ",".join(to), str(wave_rows)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.strip() == "STOPPED", (line, process.stderr.read() if process.poll() is not None else "")
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(30)


@pytest.mark.parametrize("step", ["rows", pytest.param("a rows page", marks=pytest.mark.scenario)])  # the second: CI's scenario step
def test_a_coordinator_killed_before_the_fence_leaves_the_old_map_and_a_rerun_completes(tmp_path, step):
    """Killed after BEGIN ("rows": before any page) or while rows stream: the sources keep serving their slots
    unfenced; the next `ps scale` gives the move up (the taker drops its part) and runs it to the end."""
    with logged_shards(tmp_path) as shards:
        acked = Acknowledged(shards.addresses)
        acked.train(3)
        grown = shards.grow(3)
        kill_coordinator_at(step, shards.addresses[:2], grown)
        acked.train(3)  # nothing is fenced: the old owners take the writes
        with PSClient(grown, retry=RetryPolicy(timeout_s=30)) as admin:
            assert versions(admin, range(3)) == [0, 0, 0]
            report = rescale(admin, grown)
            assert report.map_version == 1 and report.rows_moved > 0
            assert versions(admin, range(3)) == [1, 1, 1]
            assert settled(admin, range(2)) == {"finished": 0, "rolled_back": 2}  # the rerun's SETTLE gave it up
        acked.train(3)
        acked.check(3)
        acked.close()


def test_a_coordinator_killed_after_the_fence_rolls_back_on_its_own(tmp_path):
    """The sources fenced their slots and the coordinator died: after handover_deadline_s each asks the first taker,
    which never adopted the map, and serves its slots again; a write that waited on the fence goes through."""
    with logged_shards(tmp_path) as shards:
        acked = Acknowledged(shards.addresses)
        acked.train(3)
        grown = shards.grow(3)
        kill_coordinator_at("last changes", shards.addresses[:2], grown)
        acked.train(3)  # the moving slots' writes wait for the fence's end, then go to their old owners
        with PSClient(grown, retry=RetryPolicy(timeout_s=30)) as admin:
            assert versions(admin, range(3)) == [0, 0, 0]
            assert settled(admin, range(2)) == {"finished": 0, "rolled_back": 2}
            acked.check(2)
            assert rescale(admin, grown).map_version == 1  # the move again, to the same map: it goes through now
        acked.train(3)
        acked.check(3)
        acked.close()


def test_a_coordinator_killed_between_waves_leaves_the_waves_done_and_a_rerun_moves_the_rest(tmp_path):
    """Waves of about 100 rows: the coordinator dies once the first wave went through. The cluster serves under that
    wave's map (nothing is fenced or under way), and the next `ps scale` goes on from it to the even map of 3 shards."""
    waves = ScaleSettings(wave_rows=100)
    with logged_shards(tmp_path) as shards:
        acked = Acknowledged(shards.addresses)
        acked.train(3)
        grown = shards.grow(3)
        kill_coordinator_at("wave 2", shards.addresses[:2], grown, waves.wave_rows)
        acked.train(3)  # routed by the first wave's map
        with PSClient(grown, retry=RetryPolicy(timeout_s=30)) as admin:
            assert versions(admin, range(3)) == [1, 1, 1]
            first = admin.shard_map_of(2)[0]
            moving = len(ShardMap.uniform(2).moves(ShardMap.uniform(2).resized(3)))
            assert 0 < len(first.slots_of(2)) < moving
            acked.check(3)
            report = rescale(admin, grown, waves)
            assert report.waves > 1 and report.map_version == 1 + report.waves
            assert len(first.slots_of(2)) + report.slots_moved == moving  # the rest only
            final = admin.shard_map_of(0)[0]
            assert set(first.slots_of(2)) <= set(final.slots_of(2))  # no slot moved twice: all went to shard 2
            assert all(now in (was, 2) for was, now in zip(ShardMap.uniform(2).owners, final.owners))
            assert {len(final.slots_of(s)) for s in range(3)} <= {4096 // 3, 4096 // 3 + 1}  # even
            assert settled(admin, range(3)) == {"finished": 0, "rolled_back": 0}  # the kill left nothing under way
        acked.train(3)
        acked.check(3)
        acked.close()


@pytest.mark.scenario  # a variant of a test `make test` runs: CI's scenario step (`make scenarios`)
def test_a_rerun_right_after_a_coordinator_killed_after_the_fence_of_a_drain_settles_and_drains(tmp_path):
    """The next `ps scale` comes before the deadline: it settles the move (the source rolls it back, and its takers
    refuse it) and then lets the takers take part in the move again, which goes through in that one run."""
    with logged_shards(tmp_path, deadline_s=60) as shards:
        acked = Acknowledged(shards.addresses)
        grown = shards.grow(3)
        with PSClient(grown, retry=RetryPolicy(timeout_s=30)) as admin:
            rescale(admin, grown)
            acked.train(3)
            kill_coordinator_at("last changes", grown, grown[:2])
            assert rescale(admin, grown[:2]).map_version == 2
            assert settled(admin, [2]) == {"finished": 0, "rolled_back": 1}
        shards.shrink(2)
        acked.train(3)
        acked.check(2)
        acked.close()


def test_a_coordinator_killed_between_the_takers_and_the_sources_adoption_completes_on_its_own(tmp_path):
    """The first taker adopted the map (the move's point of no return) and the coordinator died before the sources
    finished: they find out from the taker and finish; the cluster is on the new map and drains again later."""
    with logged_shards(tmp_path) as shards:
        acked = Acknowledged(shards.addresses)
        acked.train(3)
        grown = shards.grow(3)
        kill_coordinator_at("finish", shards.addresses[:2], grown)
        acked.train(3)  # the moving slots' writes wait, hear the map moved, and go to shard 2
        with PSClient(grown, retry=RetryPolicy(timeout_s=30)) as admin:
            assert versions(admin, range(3)) == [1, 1, 1]
            assert settled(admin, range(2)) == {"finished": 2, "rolled_back": 0}
            acked.check(3)
            assert rescale(admin, grown[:2]).map_version == 2
        shards.shrink(2)
        acked.train(3)
        acked.check(2)
        acked.close()


def test_a_taker_killed_after_it_adopted_the_map_comes_back_on_it(tmp_path):
    with logged_shards(tmp_path) as shards:
        acked = Acknowledged(shards.addresses)
        acked.train(3)
        grown = shards.grow(3)
        with PSClient(grown, retry=RetryPolicy(timeout_s=30)) as admin:
            kill = lambda step: step == "finish" and os.kill(shards.processes[2].pid, signal.SIGKILL)  # noqa: E731
            assert rescale(admin, grown, on_step=kill).map_version == 1
            acked.train(3)  # shard 2's writes wait for its restart, which replays the map from its log
            assert versions(admin, range(3)) == [1, 1, 1]
            acked.check(3)
            assert rescale(admin, grown[:2]).map_version == 2
        shards.shrink(2)
        acked.check(2)
        acked.close()


def test_a_taker_killed_before_it_adopted_the_map_is_waited_for_and_the_move_goes_through(tmp_path):
    """The taker dies before the last changes reach it: it comes back from its log with what it took, the
    coordinator's calls wait for it (their retries outlast a restart), and the move goes through. (The fenced sources
    wait longer than the restart before they ask the taker: asked earlier, it would roll the move back.)"""
    with logged_shards(tmp_path, deadline_s=60) as shards:
        acked = Acknowledged(shards.addresses)
        acked.train(3)
        grown = shards.grow(3)
        with PSClient(grown, retry=RetryPolicy(timeout_s=30, retry_for_s=60)) as admin:
            kill = lambda step: step == "last changes" and os.kill(shards.processes[2].pid, signal.SIGKILL)  # noqa: E731
            assert rescale(admin, grown, on_step=kill).map_version == 1
            assert versions(admin, range(3)) == [1, 1, 1]
        acked.train(3)
        acked.check(3)
        acked.close()


def test_a_source_killed_after_the_fence_comes_back_fenced_and_rolls_the_move_back(tmp_path):
    """Shard 0 dies fenced, before the last changes left it: the coordinator gives the move up; shard 0 replays its
    fence from the log, asks the first taker, hears the move rolled back, and serves its slots; a rerun completes."""
    with logged_shards(tmp_path) as shards:
        acked = Acknowledged(shards.addresses)
        acked.train(3)
        grown = shards.grow(3)
        with PSClient(grown, retry=RetryPolicy(timeout_s=30)) as admin:
            kill = lambda step: step == "last changes" and os.kill(shards.processes[0].pid, signal.SIGKILL)  # noqa: E731
            with pytest.raises(PSError):
                rescale(admin, grown, on_step=kill)
            acked.client.wait_healthy(120)  # shard 0 is back
            acked.train(3)
            assert versions(admin, range(3)) == [0, 0, 0]
            acked.check(2)
            assert rescale(admin, grown).map_version == 1
        acked.train(3)
        acked.check(3)
        acked.close()


@pytest.mark.scenario  # shard processes killed and restarted: CI's scenario step; tests/remote_ps/store/test_given_up_moves.py keeps the log's record in make test
def test_a_taker_restarted_after_a_source_gave_the_move_up_still_refuses_a_late_adoption(tmp_path):
    """A source settling a move without its coordinator asks the first taker (ABORT with the map), which from then on
    never adopts that map. The refusal is in the taker's log: killed and restarted, it still refuses the adoption a
    coordinator slower than handover_deadline_s would ask for. A rerun (SETTLE first) goes through."""
    with logged_shards(tmp_path) as shards:
        acked = Acknowledged(shards.addresses)
        acked.train(3)
        grown = shards.grow(3)
        three = ShardMap.uniform(2).resized(3)
        with PSClient(grown, retry=RetryPolicy(timeout_s=30, retry_for_s=60)) as admin:
            assert admin.handover(2, persia_pb2.HandoverStep.ABORT, three).map_version == 0
            os.kill(shards.processes[2].pid, signal.SIGKILL)
            with pytest.raises(PSError, match="rolled back on this shard"):  # once restarted (the call retries)
                admin.adopt(2, three, grown)
            assert versions(admin, range(3)) == [0, 0, 0]
            assert rescale(admin, grown).map_version == 1
        acked.train(3)
        acked.check(3)
        acked.close()


TRAINER = """
import sys, torch
from lightning_persia.remote_ps.client import PSClient
with PSClient(sys.argv[1].split(",")) as client:
    ids = torch.arange(0, 2000) * 7919 - 11
    for step in range(1, 1 << 30):
        client.update({"s": (ids, torch.ones(ids.numel(), 4))}, wire_dtype="fp32")
        print(step, flush=True)
"""


def test_a_trainer_killed_during_a_move_does_not_stop_it(tmp_path):
    """A trainer dies while the rows move: the move completes, and each row holds every update the trainer heard
    acknowledged (SGD, lr 1, gradient 1: the row went down by that count, or one more for the update in flight)."""
    config = TableConfig("s", 4, optimizer=SGD(lr=1.0))
    ids = torch.arange(0, 2000) * 7919 - 11
    with logged_shards(tmp_path) as shards:
        with PSClient(shards.addresses) as client:
            client.wait_healthy(60)
            client.configure([config])
            first = client.lookup({"s": ids}, train=True, wire_dtype="fp32")["s"]
            trainer = subprocess.Popen([sys.executable, "-c", TRAINER, ",".join(shards.addresses)], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
            acknowledged = []
            reader = threading.Thread(target=lambda: acknowledged.extend(int(line) for line in trainer.stdout), daemon=True)
            reader.start()
            while len(acknowledged) < 3:
                assert trainer.poll() is None, trainer.stderr.read()
                threading.Event().wait(0.05)
            grown = shards.grow(3)
            kill = lambda step: step == "changes" and os.kill(trainer.pid, signal.SIGKILL)  # noqa: E731
            assert rescale(client, grown, on_step=kill).map_version == 1
            trainer.wait(30)
            reader.join(30)
            heard = acknowledged[-1]
            assert heard >= 3
            steps = torch.round((first - client.lookup({"s": ids}, train=False, wire_dtype="fp32")["s"])[:, 0])
            assert set(steps.tolist()) <= {float(heard), float(heard + 1)}, (heard, set(steps.tolist()))
            assert rescale(client, grown[:2]).map_version == 2
            assert torch.equal(torch.round(first - client.lookup({"s": ids}, train=False, wire_dtype="fp32")["s"])[:, 0],
                               steps)
