"""A table's requests go before the demoter's steps: the gate counts them, and the demoter waits a bounded time."""
import threading

import pytest
import torch

from lightning_persia.remote_ps.store.demoter import Demoter
from lightning_persia.remote_ps.store.request_gate import RequestGate, all_inside
from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.table_config import Adagrad, TableConfig


def test_a_gate_with_no_request_is_quiet_at_once():
    gate = RequestGate()
    assert gate.wait_quiet(0.0) and gate.waited_s == 0.0 and gate.inside == 0


def test_a_wait_is_bounded_while_a_request_stays():
    gate = RequestGate()
    with gate.request():
        assert gate.inside == 1
        assert not gate.wait_quiet(0.02)
    assert gate.waited_s >= 0.02 and gate.inside == 0


def test_a_waiting_step_goes_on_when_the_last_request_leaves():
    gate = RequestGate()
    entered, results = threading.Event(), []
    leave = threading.Event()

    def request():
        with all_inside([gate, gate]):  # one request in a table twice (lookup_together's fallback) counts twice
            entered.set()
            leave.wait(10)

    holder = threading.Thread(target=request)
    holder.start()
    entered.wait(10)
    waiter = threading.Thread(target=lambda: results.append(gate.wait_quiet(30)))
    waiter.start()
    assert gate.inside == 2 and not results
    leave.set()
    waiter.join(30)
    holder.join(30)
    assert results == [True] and gate.inside == 0


def test_a_request_that_fails_leaves_the_gate():
    gate = RequestGate()
    with pytest.raises(RuntimeError):
        with gate.request():
            raise RuntimeError("the request failed")
    assert gate.inside == 0 and gate.wait_quiet(0.0)


def _disk_table(tmp_path, capacity=1600):
    config = TableConfig("t", 4, optimizer=Adagrad(rowwise=True), capacity=capacity, storage="disk", storage_dtype="fp16")
    return Table(config, seed=0, disk_dir=str(tmp_path / "tier"))


def test_a_lookup_and_an_update_count_as_requests_while_they_hold_the_table(tmp_path, disk_tier_kernels):
    table = _disk_table(tmp_path)
    seen = []
    journal = lambda changes: seen.append(table.requests.wait_quiet(0.0))  # noqa: E731 - called with the lock held
    table.lookup(torch.arange(10), train=True, journal=journal)
    table.update(torch.arange(10), torch.ones(10, 4), journal=journal)
    Table.lookup_together([(table, torch.arange(20))], train=True, dtype=torch.float32, journal=journal)
    assert seen == [False, False, False]  # each one was inside when its journal heard of it
    assert table.requests.wait_quiet(0.0)  # and none is after


def test_the_demoter_still_demotes_while_a_request_never_leaves(tmp_path, disk_tier_kernels):
    table = _disk_table(tmp_path)
    table.lookup(torch.arange(1600), train=True)
    with table.requests.request():  # the table never quiet: each step waits its bounded time, then goes on
        demoted = Demoter(lambda: [table]).run_once()
        assert table.requests.waited_s > 0
    assert demoted > 0 and table.stats()["disk_rows"] == demoted
