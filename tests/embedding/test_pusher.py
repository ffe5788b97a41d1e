"""The gradient pusher when the run stops with updates still in flight."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from lightning_persia.embedding.pipeline import EmbeddingPipeline
from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.table_config import SGD
from lightning_persia.strategy.interception import TableDefaults, intercept
from lightning_persia.testing.chaos_proxy import ChaosProxy


def test_closing_the_client_under_an_update_in_flight_fails_the_window_without_a_stray_traceback(ps_cluster, caplog):
    proxies = [ChaosProxy(address) for address in ps_cluster.addresses]
    client = PSClient([p.address for p in proxies])
    model = nn.Module()
    model.closing_pusher_table = nn.Embedding(50, 4)
    twins = intercept(model, ["Embedding"], [], TableDefaults(optimizer=SGD(lr=0.1)))
    client.configure([t.config for twin in twins for t in twin.remote_tables])
    pipeline = EmbeddingPipeline(client, staleness=2, wire_dtype="fp32", device=torch.device("cpu"), timeout_s=10)
    for twin in twins:
        pipeline.register(twin.planner)
        twin.row_source = pipeline
    ids = torch.arange(20)
    try:
        pipeline.begin_step(ids)
        model.closing_pusher_table(ids).sum().backward()
        for proxy in proxies:
            proxy.delay_s = 1.0  # the update below is still on its way when the client closes
        pipeline.finish_step(scale=1.0)
        with caplog.at_level(logging.DEBUG):
            client.close()  # what the strategy does when the run fails (a malformed data line, Ctrl-C, ...)
            # the pusher's thread either had the update in flight (cancelled) or not yet sent (refused by the closed client)
            closed = "embedding update of step 0 (was cancelled: the connection to the parameter server was closed|failed: this PSClient is closed)"
            with pytest.raises(RuntimeError, match=closed):
                pipeline.wait_for_pushed()
        # concurrent.futures logs an exception raised by a done-callback, with its traceback, at ERROR
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    finally:
        client.close()
        for proxy in proxies:
            proxy.close()
