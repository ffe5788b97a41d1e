"""Prometheus metrics of the trainer ranks (``PersiaStrategy(metrics=MetricsEndpoint(port=P))``): two ranks (a subprocess of
run_toy.py) serve on P and P + 1, and each one's scrape, parsed with prometheus-client's parser, holds its
embedding figures and its parameter-server calls by status code."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lightning_persia import MetricsEndpoint, PersiaStrategy
from lightning_persia.remote_ps.metrics import MetricsPortError
from toy import ToyRecommender, loader, make_batches

SCRIPT = Path(__file__).with_name("run_toy.py")
STEPS = 8


def _two_free_ports() -> int:
    """A port P with P + 1 free too (each rank serves on P + its local rank)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.scenario  # half a minute of processes or more: CI's scenario step (`make scenarios`), not `make test`
def test_each_rank_serves_its_embedding_and_ps_call_figures_on_its_own_port(tmp_path):
    port = _two_free_ports()
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--devices", "2", "--shards", "2",
                             "--steps", str(STEPS), "--staleness", "2", "--metrics-port", str(port)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        state = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert state["metrics_url"] == f"http://127.0.0.1:{port + rank}/metrics"
        samples = _samples(state["metrics_text"])
        assert samples[("persia_trainer_info", frozenset({"global_rank": str(rank), "local_rank": str(rank), "node_rank": "0"}.items()))] == 1
        assert samples[("persia_trainer_steps_total", frozenset())] == STEPS
        assert samples[("persia_trainer_lookup_wait_seconds_count", frozenset())] == STEPS
        assert samples[("persia_trainer_embedding_lag_steps_count", frozenset())] == STEPS
        assert samples[("persia_trainer_embedding_lag_steps_bucket", frozenset({"le": "2.0"}.items()))] == STEPS  # staleness 2
        assert samples[("persia_trainer_embedding_lag_at_answer_steps_count", frozenset())] == STEPS
        # the acknowledgements only grow between a lookup going out and its answer
        assert samples[("persia_trainer_embedding_lag_at_answer_steps_sum", frozenset())] <= samples[("persia_trainer_embedding_lag_steps_sum", frozenset())]
        assert samples[("persia_trainer_rows_fetched_total", frozenset())] > 0
        assert samples[("persia_trainer_wire_bytes_total", frozenset())] >= 4 * 4 * samples[("persia_trainer_rows_fetched_total", frozenset())]
        assert samples[("persia_trainer_rollbacks_total", frozenset())] == 0
        assert samples[("process_resident_memory_bytes", frozenset())] > 0
        ps = dict(grpc_type="unary", grpc_service="persia.ParameterServer")
        # one Lookup per shard and step (the rows of both tables travel together), and the unknown table's refusal
        assert samples[("grpc_client_handled_total", frozenset(dict(ps, grpc_method="Lookup", grpc_code="OK").items()))] >= 2 * STEPS
        # rank 0 alone pushes the ranks' merged update of each step
        updates = samples.get(("grpc_client_handled_total", frozenset(dict(ps, grpc_method="Update", grpc_code="OK").items())), 0)
        assert updates >= STEPS if rank == 0 else updates == 0
        assert samples[("grpc_client_handled_total", frozenset(dict(ps, grpc_method="Lookup", grpc_code="NOT_FOUND").items()))] >= 1
        assert samples[("grpc_client_handling_seconds_count", frozenset(dict(ps, grpc_method="Lookup").items()))] >= 2 * STEPS + 1


def test_a_metrics_port_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"MetricsEndpoint: port must be in \[0, 65535\], got 70000"):
        PersiaStrategy(metrics=MetricsEndpoint(port=70000))


def test_a_taken_metrics_port_fails_the_trainer_at_start_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        strategy = PersiaStrategy(metrics=MetricsEndpoint(port=port))
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, strategy=strategy, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False)
        with pytest.raises(MetricsPortError, match=rf"cannot serve trainer metrics \(metrics\.port, rank 0\) on 127\.0\.0\.1:{port}: "
                           "Address already in use"):
            trainer.fit(ToyRecommender(), loader(make_batches(1)))
    assert strategy.client is None  # failed before it connected (nor started shards)
