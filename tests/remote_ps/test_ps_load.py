"""Load and exactness: 4 client processes x 2 shards push known SGD gradients, two of them through a proxy
that resets connections; the final rows equal the analytic sum exactly (no update lost, none applied twice).
The longer run is ``tools/ps_soak.py``."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lightning_persia.testing import hammer
from lightning_persia.remote_ps.table_config import SGD, Constant, TableConfig

CLIENTS, STEPS = 4, 120
TABLES = ["load_a", "load_b"]


@pytest.mark.scenario  # minutes of processes: CI's scenario step (`make scenarios`), not `make test`
def test_four_clients_two_shards_exact_sum_with_dropped_connections(ps_cluster, make_client):
    client = make_client(ps_cluster.addresses)
    client.configure([TableConfig(t, hammer.DIM, optimizer=SGD(lr=1.0), init=Constant(0.0)) for t in TABLES])
    everything = torch.arange(hammer.NUM_IDS)
    client.lookup({t: everything for t in TABLES}, train=True)
    duplicates_before = sum(s["server"].get("dedup_duplicates", 0) for s in client.stats())

    processes = []
    for index in range(CLIENTS):
        drop = 0.02 if index >= 2 else 0.0  # clients 2 and 3 talk through connection-resetting proxies
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "lightning_persia.testing.hammer", "--addresses", ",".join(ps_cluster.addresses),
             "--client", str(index), "--steps", str(STEPS), "--tables", ",".join(TABLES),
             "--drop-probability", str(drop), "--seed", str(index)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for process in processes:
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["dropped_connections"] > 0 for r in results[2:]), results
    assert all(r["connections"] > 1 for r in results[2:]), results  # they reconnected and went on

    expected = hammer.expected_rows(range(CLIENTS), STEPS)
    got = client.lookup({t: everything for t in TABLES}, train=False, wire_dtype="fp32")
    for table in TABLES:
        assert torch.equal(got[table], expected), f"{table}: max error {(got[table] - expected).abs().max()}"
    stats = client.stats()
    assert sum(s["tables"][TABLES[0]]["rows"] for s in stats) == hammer.NUM_IDS
    duplicates = sum(s["server"]["dedup_duplicates"] for s in stats) - duplicates_before
    print(f"clients {results}; retried updates answered as duplicates: {duplicates}")
