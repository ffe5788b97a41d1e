"""Shards added and drained while a client trains: real shard processes, slots moving live (``client/scaling.py``),
the client's rows compared bit for bit with one store that never moved."""
import os
import threading
from pathlib import Path

import pytest
import torch

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.client import PSClient, RetryPolicy
from lightning_persia.remote_ps.client.errors import PSError
from lightning_persia.remote_ps.client.scaling import ScaleSettings, rescale, wait_drained
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.table_config import Adam, Adagrad, TableConfig

TABLES = [TableConfig("user", 8, optimizer=Adam(lr=0.05)), TableConfig("item", 4, optimizer=Adagrad(lr=0.1, rowwise=True))]
UNIVERSE = torch.arange(0, 5000) * 7919 - 11


class Trainer(threading.Thread):
    """A client's lookups and updates, one after the other, replayed on the model store as they are answered."""

    def __init__(self, client: PSClient, model: ShardStore, tables=TABLES) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.tables = client, model, tables
        self.step = 0
        self.error = None
        self.stop_at = 1 << 30  # the last step, once the test knows it

    def run(self) -> None:
        try:
            generator = torch.Generator().manual_seed(3)
            while self.step < self.stop_at:
                self.step += 1
                ids = {t.name: UNIVERSE[torch.randperm(UNIVERSE.numel(), generator=generator)[:400]] for t in self.tables}
                found = self.client.lookup(ids, train=True, wire_dtype="fp32")
                for name, table_ids in ids.items():
                    assert torch.equal(found[name], self.model.lookup(name, table_ids, train=True)), (self.step, name)
                grads = {t.name: torch.randn(400, t.dim, generator=generator) for t in self.tables}
                self.client.update({name: (ids[name], grads[name]) for name in ids}, wire_dtype="fp32")
                self.model.update_many([(name, ids[name], grads[name]) for name in ids])
        except BaseException as err:  # noqa: BLE001 - the test reports it
            self.error = err

    def wait_for(self, step: int) -> None:
        while self.step < step and self.is_alive():
            threading.Event().wait(0.01)


# one wave (the cluster's rows are far fewer than wave_rows), and waves of about 1,000 rows (about 5 slots at a time:
# the trainer's requests cross several map versions in each direction), paced from the start
@pytest.mark.parametrize("settings, waves", [(ScaleSettings(), 1), (ScaleSettings(wave_rows=1000, copy_share=0.5, unpaced_s=0), 4)])
def test_shards_added_and_drained_while_a_client_trains_lose_and_repeat_nothing(settings, waves):
    with LocalShards(2, overrides=["seed=5"]) as shards:
        client, admin = PSClient(shards.addresses), PSClient(shards.addresses)
        client.wait_healthy(60)
        client.configure(TABLES)
        model = ShardStore(0, 1, seed=5)
        for config in TABLES:
            model.configure(config)
        trainer = Trainer(client, model)
        trainer.start()
        trainer.wait_for(5)
        grown = rescale(admin, shards.grow(3), settings)
        during = trainer.step
        trainer.wait_for(during + 10)
        shrunk = rescale(admin, shards.addresses[:2], settings)
        wait_drained(admin, [2])
        shards.shrink(2)
        trainer.stop_at = trainer.step + 10
        trainer.join(300)
        assert trainer.error is None, repr(trainer.error)
        assert grown.waves >= waves and shrunk.waves >= waves
        assert grown.map_version == grown.waves and shrunk.map_version == grown.waves + shrunk.waves
        assert client.shard_map.version == shrunk.map_version and client.num_shards == 2
        for config in TABLES:
            found = client.lookup({config.name: UNIVERSE}, train=False, wire_dtype="fp32")[config.name]
            assert torch.equal(found, model.lookup(config.name, UNIVERSE, train=False)), config.name
        held = sum(entry["tables"]["user"]["rows"] for entry in client.stats())
        assert held == model.stats()["user"]["rows"]
        total = grown.rows_moved + shrunk.rows_moved
        assert grown.slots_moved in (1365, 1366) and shrunk.slots_moved == grown.slots_moved
        assert 0 < grown.rows_moved < 0.45 * sum(model.stats()[t.name]["rows"] for t in TABLES) and total > 0
        client.close()
        admin.close()


@pytest.mark.parametrize("bad", [{"wave_rows": 0}, {"copy_share": 0.0}, {"copy_share": 1.5}, {"max_rounds": -1},
                                 {"settle_rows": -1}, {"unpaced_s": -1.0}])
def test_scale_settings_refuse_values_that_cannot_pace_a_move(bad):
    with pytest.raises(ValueError, match=f"scale settings need .*{next(iter(bad))}="):
        ScaleSettings(**bad)


def test_rescale_refuses_addresses_that_reorder_the_shards():
    with LocalShards(2, overrides=["seed=5"]) as shards:
        with PSClient(shards.addresses) as admin:
            admin.wait_healthy(60)
            with pytest.raises(PSError, match="must start with the cluster's"):
                rescale(admin, [shards.addresses[1], shards.addresses[0], "127.0.0.1:1"])
            assert admin.shard_map_of(0)[0].version == 0  # nothing began


def test_an_update_a_drained_shard_applied_but_never_answered_is_not_applied_again():
    """The re-sent update of a shard that is gone goes to the slots' new owners as "<client>@<shard>" with its seq; the
    exactly-once memory they took over answers it as a duplicate when the drained shard had applied it."""
    from lightning_persia.ops.keyed_ids import KeyedIds, RowLayout
    from lightning_persia.remote_ps.protocol import WIRE_DTYPE_ENUMS

    config = TableConfig("t", 4, optimizer=Adam(lr=0.1))
    with LocalShards(3, overrides=["seed=5"]) as shards:
        client, admin = PSClient(shards.addresses), PSClient(shards.addresses)
        client.wait_healthy(60)
        client.configure([config])
        model = ShardStore(0, 1, seed=5)
        model.configure(config)
        ids = UNIVERSE[:600]
        client.lookup({"t": ids}, train=True)
        model.lookup("t", ids, train=True)

        def prepared(grads):  # the Update calls a client makes, before it sends them
            keyed = KeyedIds(("t",), (ids.numel(),), ids)
            return client._update_calls(client.shard(keyed), grads, RowLayout(keyed.counts, [4]), WIRE_DTYPE_ENUMS["fp32"],
                                        "fp32", client.client_id)

        applied = prepared(torch.ones(ids.numel() * 4))
        unsent = prepared(torch.full((ids.numel() * 4,), 2.0))
        client._wait(client._update(applied))  # applied everywhere; say its answers were lost
        model.update("t", ids, torch.ones(ids.numel(), 4))
        rescale(admin, shards.addresses[:2])
        shards.shrink(2)  # shard 2 is gone before the client re-sends its part
        client._wait(client._update([(s, r) for s, r in applied if s == 2]))  # re-sent: a duplicate now
        client._wait(client._update(unsent))  # never sent before: applied once, partly re-routed
        model.update("t", ids, torch.full((ids.numel(), 4), 2.0))
        found = client.lookup({"t": ids}, train=False, wire_dtype="fp32")["t"]
        assert torch.equal(found, model.lookup("t", ids, train=False))
        client.close()
        admin.close()


def test_ps_scale_on_the_command_line_grows_and_drains(capsys):
    from lightning_persia.cli import main

    with LocalShards(1, overrides=["seed=5"]) as shards:
        with PSClient(shards.addresses) as client:
            client.wait_healthy(60)
            client.configure([TABLES[0]])
            before = client.lookup({"user": UNIVERSE}, train=True, wire_dtype="fp32")["user"]
            grown = shards.grow(2)
            assert main(["ps", "scale", "--addresses", shards.addresses[0], "--to", ",".join(grown)]) == 0
            assert "1 -> 2 shards (shard map version 1)" in capsys.readouterr().out
            assert torch.equal(client.lookup({"user": UNIVERSE}, train=False, wire_dtype="fp32")["user"], before)
            assert client.num_shards == 2 and [e["tables"]["user"]["rows"] > 0 for e in client.stats()] == [True, True]
            assert main(["ps", "scale", "--addresses", ",".join(grown), "--to", grown[0]]) == 0
            assert f"stop shards {grown[1]}" in capsys.readouterr().out
            shards.shrink(1)
            assert torch.equal(client.lookup({"user": UNIVERSE}, train=False, wire_dtype="fp32")["user"], before)
            assert main(["ps", "scale", "--addresses", grown[0], "--to", f"{grown[1]},{grown[0]}"]) == 1
            assert "must start with the cluster's" in capsys.readouterr().err


def test_sightings_of_ids_not_admitted_yet_move_with_their_slots():
    """A table that admits an id at its third sighting: ids seen twice before a grow are admitted at their first
    sighting on their new shard. Each source's sightings (683 slots of 4 KB) fill more than a page of 2 MB (a quarter
    of the messages' limit): they come in two pages."""
    config = TableConfig("seen", 4, admit_after=3)
    with LocalShards(2, overrides=["seed=5", "max_message_mb=8"]) as shards, PSClient(shards.addresses) as client:
        client.wait_healthy(60)
        client.configure([config])
        for _ in range(2):
            client.lookup({"seen": UNIVERSE}, train=True)
        assert sum(entry["tables"]["seen"]["rows"] for entry in client.stats()) == 0
        rescale(client, shards.grow(3))
        moved = UNIVERSE[ShardMap.uniform(2).resized(3).shard_of(UNIVERSE) == 2]
        client.lookup({"seen": moved}, train=True)
        assert client.shard_stats(2)["tables"]["seen"]["rows"] == moved.numel() > 0


def test_a_shard_started_with_join_past_the_shard_count_takes_slots_from_a_running_cluster():
    import subprocess
    import time

    from lightning_persia.remote_ps.launcher import read_listening_address, serve_command, stop_processes

    with LocalShards(2, overrides=["seed=5"]) as shards:
        joining = subprocess.Popen(serve_command(2, 2, extra_args=["--join"], overrides=["seed=5"]), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, bufsize=1)
        try:
            lines = []
            address = read_listening_address(joining, lines, time.monotonic() + 120, "joining-shard-output")
            assert address is not None, "\n".join(lines)
            with PSClient(shards.addresses) as client:
                client.wait_healthy(60)
                client.configure([TABLES[0]])
                before = client.lookup({"user": UNIVERSE}, train=True, wire_dtype="fp32")["user"]
                report = rescale(client, [*shards.addresses, address])
                assert (report.from_shards, report.to_shards) == (2, 3)
                assert torch.equal(client.lookup({"user": UNIVERSE}, train=False, wire_dtype="fp32")["user"], before)
                assert client.shard_stats(2)["tables"]["user"]["rows"] > 0
        finally:
            stop_processes([joining], 15)


def test_a_taker_killed_during_a_move_leaves_the_old_map_and_every_row(tmp_path):
    """The new shard dies while rows stream to it: the move is given up on every shard that answers, the cluster keeps
    its map, and the client's rows are all there."""
    import os
    import signal

    config = TableConfig("t", 4, optimizer=Adam(lr=0.1))
    with LocalShards(2, overrides=["seed=5"]) as shards:
        client, admin = PSClient(shards.addresses), PSClient(shards.addresses, retry=RetryPolicy(timeout_s=5, max_retries=1))
        client.wait_healthy(60)
        client.configure([config])
        ids = UNIVERSE
        client.lookup({"t": ids}, train=True)
        client.update({"t": (ids, torch.ones(ids.numel(), 4))})
        before = client.lookup({"t": ids}, train=False, wire_dtype="fp32")["t"]
        grown = shards.grow(3)
        os.kill(shards.processes[2].pid, signal.SIGKILL)
        with pytest.raises(PSError):
            rescale(admin, grown)
        assert [admin.shard_map_of(s)[0].version for s in (0, 1)] == [0, 0]
        client.update({"t": (ids, torch.ones(ids.numel(), 4))})  # the sources serve their slots, unfenced
        after = client.lookup({"t": ids}, train=False, wire_dtype="fp32")["t"]
        assert client.shard_map.version == 0 and not torch.equal(after, before)
        assert sum(admin.shard_stats(s)["tables"]["t"]["rows"] for s in (0, 1)) == ids.numel()
        client.save(str(tmp_path / "after"))  # the move's consistent point was let go: a save takes its own
        client.close()
        admin.close()


def test_a_source_killed_during_a_move_comes_back_from_its_log_under_the_old_map(tmp_path):
    """A shard giving slots away dies in the middle of the move: its launcher restarts it and it replays its log, the
    move is given up everywhere, and the cluster serves every acknowledged row under the old map."""
    import os
    import signal

    config = TableConfig("t", 4, optimizer=Adam(lr=0.1))
    with LocalShards(2, overrides=["seed=5", "durability=log", f"wal_dir={tmp_path / 'wal'}"], restart=True) as shards:
        client = PSClient(shards.addresses, retry=RetryPolicy(retry_for_s=60))
        admin = PSClient(shards.addresses, retry=RetryPolicy(timeout_s=5, max_retries=2))
        client.wait_healthy(60)
        client.configure([config])
        client.lookup({"t": UNIVERSE}, train=True)
        client.update({"t": (UNIVERSE, torch.ones(UNIVERSE.numel(), 4))})
        before = client.lookup({"t": UNIVERSE}, train=False, wire_dtype="fp32")["t"]
        grown = shards.grow(3)
        admin.handover(0, 1, admin.shard_map_of(0)[0].resized(3), grown)  # BEGIN on shard 0 by hand: the move is under way
        os.kill(shards.processes[0].pid, signal.SIGKILL)
        with pytest.raises(PSError):
            rescale(admin, grown)  # shard 0 is down, then back with no move under way: the move fails
        admin.wait_healthy(120)  # shard 0 replayed its log
        assert [admin.shard_map_of(s)[0].version for s in (0, 1)] == [0, 0]
        assert torch.equal(client.lookup({"t": UNIVERSE}, train=False, wire_dtype="fp32")["t"], before)
        report = rescale(admin, grown)  # the move, tried again, completes
        assert report.to_shards == 3 and report.rows_moved > 0
        assert torch.equal(client.lookup({"t": UNIVERSE}, train=False, wire_dtype="fp32")["t"], before)
        client.close()
        admin.close()


@pytest.mark.parametrize("saved", [False, pytest.param(True, marks=pytest.mark.scenario)], ids=["log", "saved-then-log"])  # the second: CI's scenario step
def test_shards_restarted_after_a_move_still_tell_a_client_where_the_new_shards_are(tmp_path, saved):
    """Both first shards die after a 2 → 3 move and come back from their logs (after a save, whose segment keeps the
    map only in its OPEN record): they still answer GetShardMap with the three addresses, so a client that was given
    the first two shards only finds every row."""
    import os
    import signal

    config = TableConfig("t", 4, optimizer=Adam(lr=0.1))
    with LocalShards(2, overrides=["seed=5", "durability=log", f"wal_dir={tmp_path / 'wal'}"], restart=True) as shards:
        with PSClient(shards.addresses, retry=RetryPolicy(retry_for_s=60)) as client:
            client.wait_healthy(60)
            client.configure([config])
            client.lookup({"t": UNIVERSE}, train=True)
            client.update({"t": (UNIVERSE, torch.ones(UNIVERSE.numel(), 4))})
            grown = shards.grow(3)
            rescale(client, grown)
            before = client.lookup({"t": UNIVERSE}, train=False, wire_dtype="fp32")["t"]
            if saved:
                client.save(str(tmp_path / "checkpoint"))
            for shard in (0, 1):
                os.kill(shards.processes[shard].pid, signal.SIGKILL)
            client.wait_healthy(120)
            assert [client.shard_map_of(shard) for shard in (0, 1)] == [(client.shard_map, grown)] * 2
        with PSClient(grown[:2], retry=RetryPolicy(retry_for_s=60)) as late:
            assert torch.equal(late.lookup({"t": UNIVERSE}, train=False, wire_dtype="fp32")["t"], before)
            assert late.num_shards == 3


def _nice_values(pid: int) -> list[int]:
    """The nice value of each thread of process ``pid`` (``/proc/<pid>/task/<tid>/stat``'s 19th field)."""
    values = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            values.append(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return values


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads each shard thread's nice value from "
                    "/proc/<pid>/task, which only Linux has; elsewhere no thread has a nice value of its own, and a move "
                    "runs at the shard's priority")
def test_a_moves_giving_and_taking_shards_work_on_threads_below_their_requests_priority():
    with LocalShards(2, overrides=["seed=5", "move_nice=7"]) as shards, PSClient(shards.addresses) as client:
        client.wait_healthy(60)
        client.configure(TABLES)
        client.lookup({t.name: UNIVERSE for t in TABLES}, train=True)
        client.update({t.name: (UNIVERSE, torch.ones(UNIVERSE.numel(), t.dim)) for t in TABLES}, wire_dtype="fp32")
        before = client.lookup({t.name: UNIVERSE for t in TABLES}, train=False, wire_dtype="fp32")
        bases = {process.pid: os.getpriority(os.PRIO_PROCESS, process.pid) for process in shards.processes}
        assert all(base + 7 not in _nice_values(pid) for pid, base in bases.items())  # no move yet: no such thread
        grown = shards.grow(3)
        with PSClient(grown) as admin:
            assert rescale(admin, grown).rows_moved > 0
        for process in shards.processes:  # the two giving shards and the new one that took their slots
            base = os.getpriority(os.PRIO_PROCESS, process.pid)  # the process's main thread: its requests' priority
            assert min(19, base + 7) in _nice_values(process.pid), process.pid
        found = client.lookup({t.name: UNIVERSE for t in TABLES}, train=False, wire_dtype="fp32")
        assert all(torch.equal(found[t.name], before[t.name]) for t in TABLES)  # the rows moved on those threads, whole
