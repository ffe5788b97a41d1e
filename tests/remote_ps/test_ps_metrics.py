"""Prometheus metrics of a shard process (``ps serve --metrics-port``), scraped over HTTP and parsed with
prometheus-client's own parser; a taken metrics port stops the shard before it serves anything."""
from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.client import PSClient, PSRequestError, RetryPolicy, ShardUnavailableError
from lightning_persia.remote_ps.client.scaling import rescale
from lightning_persia.remote_ps.metrics import ClientCallLog, ClientRpcMetrics
from lightning_persia.remote_ps.protocol import LISTENING_PREFIX, METRICS_PREFIX
from lightning_persia.remote_ps.table_config import SGD, TableConfig

TOKEN = "metrics-token"


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """``{(sample name, labels): value}`` of one scrape."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no sample {name}{labels}; samples named so: {[k for k in samples if k[0] == name]}"
    return samples[key]


def metrics_url(shards, index: int = 0) -> str:
    lines = [line for line in shards.output(index).splitlines() if line.startswith(METRICS_PREFIX + " ")]
    assert len(lines) == 1, shards.output(index)
    return lines[0].split(" ", 1)[1]


def test_a_shard_serves_its_rpc_table_and_process_figures(start_ps_cluster):
    shards = start_ps_cluster(1, extra_args=["--metrics-port", "0", "--token", TOKEN])
    url = metrics_url(shards)
    with PSClient(shards.addresses, token=TOKEN, retry=RetryPolicy(timeout_s=10, max_retries=0)) as client:
        client.wait_healthy(30)
        client.configure([TableConfig("m.small", dim=4, capacity=8, optimizer=SGD(lr=0.1)),
                          TableConfig("m.picky", dim=2, admit_probability=0.0)])
        client.lookup({"m.small": torch.arange(8)}, train=True)
        client.update({"m.small": (torch.arange(8), torch.ones(8, 4))})
        client.lookup({"m.small": torch.arange(100, 104)}, train=True)  # full: 4 rows evicted for them
        client.lookup({"m.picky": torch.arange(5)}, train=True)  # admitted with probability 0
        with pytest.raises(PSRequestError, match="NOT_FOUND"):
            client.lookup({"m.unknown": torch.arange(3)}, train=True)
        incarnation = client.stats()[0]["incarnation"]
    with PSClient(shards.addresses, token="wrong", retry=RetryPolicy(timeout_s=10, max_retries=0)) as intruder:
        with pytest.raises(PSRequestError, match="UNAUTHENTICATED"):
            intruder.lookup({"m.small": torch.arange(2)}, train=False)

    samples = scrape(url)
    rpc = dict(grpc_type="unary", grpc_service="persia.ParameterServer")
    assert value(samples, "grpc_server_started_total", **rpc, grpc_method="Lookup") == 5
    assert value(samples, "grpc_server_handled_total", **rpc, grpc_method="Lookup", grpc_code="OK") == 3
    assert value(samples, "grpc_server_handled_total", **rpc, grpc_method="Lookup", grpc_code="NOT_FOUND") == 1
    assert value(samples, "grpc_server_handled_total", **rpc, grpc_method="Lookup", grpc_code="UNAUTHENTICATED") == 1
    assert value(samples, "grpc_server_handled_total", **rpc, grpc_method="Update", grpc_code="OK") == 1
    assert value(samples, "grpc_server_handling_seconds_count", **rpc, grpc_method="Lookup") == 5
    assert value(samples, "grpc_server_handling_seconds_bucket", **rpc, grpc_method="Update", le="+Inf") == 1
    health = dict(grpc_type="unary", grpc_service="grpc.health.v1.Health", grpc_method="Check", grpc_code="OK")
    assert value(samples, "grpc_server_handled_total", **health) >= 1  # probes pass without the token

    assert value(samples, "persia_ps_table_rows", table="m.small") == 8
    assert value(samples, "persia_ps_table_capacity_rows", table="m.small") == 8
    assert value(samples, "persia_ps_table_inserted_rows_total", table="m.small") == 12
    assert value(samples, "persia_ps_table_evicted_rows_total", table="m.small") == 4
    assert value(samples, "persia_ps_table_update_rows_total", table="m.small") == 8
    assert value(samples, "persia_ps_table_bytes", table="m.small") > 8 * 4 * 4
    assert value(samples, "persia_ps_table_not_admitted_ids_total", table="m.picky") == 5
    assert value(samples, "persia_ps_table_rows", table="m.picky") == 0
    assert value(samples, "persia_ps_table_lock_wait_seconds_total", table="m.small") >= 0.0
    assert value(samples, "persia_ps_tables") == 2
    assert value(samples, "persia_ps_background_cpu_seconds_total", thread="demoter") == 0.0  # no disk table: no pass
    assert value(samples, "persia_ps_shard_info", shard_index="0", num_shards="1", incarnation=incarnation, restored_from="") == 1
    assert value(samples, "process_resident_memory_bytes") > 10 << 20

    again = scrape(url)  # read at scrape time: the next scrape sees the next call
    assert value(again, "grpc_server_handled_total", grpc_type="unary", grpc_service="persia.ParameterServer",
                 grpc_method="Lookup", grpc_code="OK") == 3
    assert value(again, "persia_ps_table_rows", table="m.small") == 8


def test_a_shard_with_a_write_ahead_log_reports_its_size_and_its_replay(start_ps_cluster, tmp_path):
    shards = start_ps_cluster(1, extra_args=["--metrics-port", "0"], overrides=["durability=log", f"wal_dir={tmp_path / 'wal'}"])
    with PSClient(shards.addresses, retry=RetryPolicy(timeout_s=10)) as client:
        client.wait_healthy(30)
        client.configure([TableConfig("m.logged", dim=4, optimizer=SGD(lr=0.1))])
        client.lookup({"m.logged": torch.arange(50)}, train=True)
        client.update({"m.logged": (torch.arange(50), torch.ones(50, 4))})
        replay = client.stats()[0]["server"]["wal"]["replay"]
    samples = scrape(metrics_url(shards))
    assert value(samples, "persia_ps_wal_bytes") >= value(samples, "persia_ps_wal_written_bytes_total") > 50 * 4 * 4
    assert value(samples, "persia_ps_wal_records_total") == 3  # the table, the lookup's admissions, the update
    assert value(samples, "persia_ps_wal_commits_total") >= 1
    # a first start has nothing to replay (a restarted shard's figures: tests/remote_ps/test_ps_wal.py)
    assert value(samples, "persia_ps_wal_replay_seconds") == replay["seconds"] == 0
    assert value(samples, "persia_ps_wal_replay_rows") == replay["rows"] == 0


def test_shards_report_a_live_move_slots_rows_and_bytes_each_way(start_ps_cluster):
    """2 → 3 shards with no request during the move: the rows the sources say they handed over are the rows the new
    shard says it took and holds, and each source's copy job read its moving rows (its total: their share of its rows)."""
    shards = start_ps_cluster(2, extra_args=["--metrics-port", "0"], overrides=["seed=5"])
    ids = torch.arange(0, 3000) * 7919 - 11
    with PSClient(shards.addresses, retry=RetryPolicy(timeout_s=10)) as client:
        client.wait_healthy(30)
        client.configure([TableConfig("m.moving", dim=4, optimizer=SGD(lr=0.1))])
        client.lookup({"m.moving": ids}, train=True)
        held = [entry["tables"]["m.moving"]["rows"] for entry in client.stats()]
        report = rescale(client, shards.grow(3))
        after = [client.shard_stats(shard)["tables"]["m.moving"]["rows"] for shard in range(3)]
    samples = [scrape(metrics_url(shards, shard)) for shard in range(3)]
    assert report.rows_moved == after[2] > 0 and report.changed_rows == 0
    assert [value(s, "persia_ps_shard_map_version") for s in samples] == [1, 1, 1]
    owned = [value(s, "persia_ps_slots_owned") for s in samples]
    assert sum(owned) == 4096 and owned[2] in (1365, 1366)
    out = [value(s, "persia_ps_moved_rows_total", direction="out") for s in samples]
    taken = [value(s, "persia_ps_moved_rows_total", direction="in") for s in samples]
    assert out[2] == taken[0] == taken[1] == 0 and out[0] + out[1] == taken[2] == after[2]
    assert [held[s] - out[s] for s in (0, 1)] == after[:2]
    sent_bytes = sum(value(s, "persia_ps_moved_bytes_total", direction="out") for s in samples[:2])
    assert sent_bytes == value(samples[2], "persia_ps_moved_bytes_total", direction="in") > after[2] * 4 * 4
    for shard in (0, 1):
        assert value(samples[shard], "persia_ps_handovers_total", outcome="finished") == 1
        assert value(samples[shard], "persia_ps_handovers_total", outcome="given_up") == 0
        assert value(samples[shard], "persia_ps_handover_running") == 0
        job = dict(job="hand-over", table="m.moving")
        assert value(samples[shard], "persia_ps_job_done_rows", **job) == out[shard]
        moving = len([slot for slot, (was, _) in ShardMap.uniform(2).moves(ShardMap.uniform(2).resized(3)).items() if was == shard])
        assert value(samples[shard], "persia_ps_job_total_rows", **job) == held[shard] * moving // 4096
        assert value(samples[shard], "persia_ps_job_running", **job) == 0


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_persia.cli", "ps", "serve", "--port", "0", "--shard-index", "0",
                           "--num-shards", "1", *args], capture_output=True, text=True, timeout=60)


def test_a_taken_metrics_port_stops_the_shard_before_it_serves():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve("--metrics-port", str(port))
    assert result.returncode == 2
    assert f"cannot serve shard 0 metrics (--metrics-port) on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "the port is taken" in result.stderr
    assert LISTENING_PREFIX not in result.stdout and METRICS_PREFIX not in result.stdout  # never half-started


@pytest.mark.parametrize("port", ["-1", "65536"])
def test_a_metrics_port_out_of_range_is_refused(port):
    result = _serve("--metrics-port", port)
    assert result.returncode == 2 and f"metrics_port must be in [0, 65535], got {port}" in result.stderr


def test_the_client_interceptor_counts_calls_and_leaves_errors_as_they_are(start_ps_cluster):
    registry = CollectorRegistry()
    interceptor = ClientRpcMetrics(registry)
    shards = start_ps_cluster(1)
    with PSClient(shards.addresses, interceptors=[interceptor], retry=RetryPolicy(timeout_s=10, max_retries=0)) as client:
        client.wait_healthy(30)
        client.configure([TableConfig("c.t", dim=2)])
        assert client.lookup({"c.t": torch.arange(3)}, train=True)["c.t"].shape == (3, 2)
        with pytest.raises(PSRequestError, match="NOT_FOUND"):
            client.lookup({"c.missing": torch.arange(3)}, train=True)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{closed.getsockname()[1]}"
    with PSClient([gone], interceptors=[interceptor], retry=RetryPolicy(timeout_s=2, max_retries=1, backoff_s=0.01)) as client:
        with pytest.raises(ShardUnavailableError, match=f"shard 0 at {gone} did not answer after 2 tries"):
            client.lookup({"c.t": torch.arange(3)}, train=False)
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(generate_latest(registry).decode()) for s in family.samples}
    rpc = dict(grpc_type="unary", grpc_service="persia.ParameterServer", grpc_method="Lookup")
    assert samples[("grpc_client_handled_total", frozenset(dict(rpc, grpc_code="OK").items()))] == 1
    assert samples[("grpc_client_handled_total", frozenset(dict(rpc, grpc_code="NOT_FOUND").items()))] == 1
    assert samples[("grpc_client_handled_total", frozenset(dict(rpc, grpc_code="UNAVAILABLE").items()))] == 2
    assert samples[("grpc_client_handling_seconds_count", frozenset(rpc.items()))] == 4


def test_calls_logged_in_another_client_count_where_they_are_recorded(start_ps_cluster):
    """An embedding worker's client logs its calls (ClientCallLog); its trainer counts them (ClientRpcMetrics.record)."""
    log = ClientCallLog()
    shards = start_ps_cluster(1)
    with PSClient(shards.addresses, interceptors=[log]) as client:
        client.wait_healthy(30)
        client.configure([TableConfig("c.t", dim=2)])
        client.lookup({"c.t": torch.arange(3)}, train=True)
        with pytest.raises(PSRequestError, match="NOT_FOUND"):
            client.lookup({"c.missing": torch.arange(3)}, train=True)
    calls = log.drain()
    assert log.drain() == []
    lookups = [(method, code) for method, code, seconds in calls if method.endswith("/Lookup") and seconds >= 0]
    assert lookups == [("/persia.ParameterServer/Lookup", "OK"), ("/persia.ParameterServer/Lookup", "NOT_FOUND")]
    registry = CollectorRegistry()
    ClientRpcMetrics(registry).record(calls)
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(generate_latest(registry).decode()) for s in family.samples}
    rpc = dict(grpc_type="unary", grpc_service="persia.ParameterServer", grpc_method="Lookup")
    assert samples[("grpc_client_handled_total", frozenset(dict(rpc, grpc_code="OK").items()))] == 1
    assert samples[("grpc_client_handled_total", frozenset(dict(rpc, grpc_code="NOT_FOUND").items()))] == 1
