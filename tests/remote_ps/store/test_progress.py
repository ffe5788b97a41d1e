"""Long jobs of a shard say how far they are: save, load and re-shard log rows, rate and time left, and expose them."""
from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lightning_persia.remote_ps.config import PSConfig
from lightning_persia.remote_ps.metrics import shard_registry
from lightning_persia.remote_ps.servicer import PSServicer
from lightning_persia.remote_ps.store import checkpoint
from lightning_persia.remote_ps.store.progress import Progress
from lightning_persia.remote_ps.store.shard_store import ShardStore
from lightning_persia.remote_ps.table_config import SGD, TableConfig


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_job_logs_rows_rate_and_time_left_at_each_interval(caplog):
    clock = _Clock()
    progress = Progress("shard 1/4", interval_s=10.0, clock=clock)
    job = progress.begin("load", "user", total_rows=10_000)
    with caplog.at_level(logging.INFO, logger="lightning_persia.ps"):
        for _ in range(5):  # 1,000 rows every 2.5 s: a line at 10 s, none before
            clock.now += 2.5
            job.advance(1_000)
        clock.now += 15.0
        job.advance(4_000)
        job.finish()
    assert [r.getMessage() for r in caplog.records] == [
        "shard 1/4: load of table 'user': 4,000 of 10,000 rows (40%), 400 rows/s, about 15 s left",
        "shard 1/4: load of table 'user': 9,000 of 10,000 rows (90%), 327 rows/s, about 3 s left",
        "shard 1/4: load of table 'user' done: 9,000 rows in 28 s (327 rows/s)",
    ]
    (figures,) = progress.figures()
    assert (figures.job, figures.table, figures.done_rows, figures.total_rows, figures.finished) == ("load", "user", 9_000, 10_000, True)
    assert figures.seconds_left == 0.0


def test_a_short_job_logs_nothing(caplog):
    clock = _Clock()
    job = Progress("shard 0/1", interval_s=10.0, clock=clock).begin("save", "t", total_rows=None)
    with caplog.at_level(logging.INFO, logger="lightning_persia.ps"):
        clock.now += 9.0
        job.advance(5)
        job.finish()
    assert caplog.records == []
    with pytest.raises(ValueError, match="unknown job 'copy'"):
        Progress().begin("copy", "t", 1)


def _store(shard_index: int, num_shards: int) -> ShardStore:
    store = ShardStore(shard_index, num_shards)
    store.progress = Progress(f"shard {shard_index}/{num_shards}", interval_s=0.0)  # a line per block
    return store


def test_save_load_and_reshard_follow_each_table_block_by_block(tmp_path, small_chunks, monkeypatch, caplog):
    monkeypatch.setattr(checkpoint, "BLOCK_ROWS", 1000)
    source = _store(0, 1)
    source.configure(TableConfig("emb", dim=4, optimizer=SGD(lr=0.1)))
    source.lookup("emb", torch.arange(5000), train=True)
    with caplog.at_level(logging.INFO, logger="lightning_persia.ps"):
        source.save(str(tmp_path / "ckpt"))
        same = _store(0, 1)
        same.load(str(tmp_path / "ckpt"))
        halves = [_store(i, 2) for i in range(2)]
        for half in halves:
            half.load(str(tmp_path / "ckpt"))
    (saved,) = source.progress.figures()
    assert (saved.job, saved.done_rows, saved.total_rows, saved.finished) == ("save", 5000, 5000, True)
    (loaded,) = same.progress.figures()
    assert (loaded.job, loaded.done_rows, loaded.total_rows) == ("load", 5000, 5000)
    for half in halves:  # each reads every row of the checkpoint and keeps its own
        (resharded,) = half.progress.figures()
        assert (resharded.job, resharded.done_rows, resharded.total_rows) == ("re-shard", 5000, 5000)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("shard 0/1: save of table 'emb': " in line for line in lines) == 5  # chunks of 1,024 rows
    assert "shard 0/1: load of table 'emb': 1,000 of 5,000 rows (20%)" in "\n".join(lines)
    assert sum("shard 1/2: re-shard of table 'emb': " in line for line in lines) == 5  # blocks of 1,000 rows


def test_the_jobs_are_prometheus_gauges(tmp_path):
    store = ShardStore(0, 1)
    store.configure(TableConfig("emb", dim=4, optimizer=SGD(lr=0.1)))
    store.lookup("emb", torch.arange(300), train=True)
    store.save(str(tmp_path / "ckpt"))
    text = generate_latest(shard_registry(PSServicer(store, PSConfig()))).decode()
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    key = frozenset({"job": "save", "table": "emb"}.items())
    assert samples[("persia_ps_job_done_rows", key)] == 300
    assert samples[("persia_ps_job_total_rows", key)] == 300
    assert samples[("persia_ps_job_running", key)] == 0
    assert samples[("persia_ps_job_seconds_left", key)] == 0
    assert samples[("persia_ps_job_rows_per_second", key)] > 0
