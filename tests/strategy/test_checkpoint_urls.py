"""Checkpoints through fsspec URLs: ``ModelCheckpoint(dirpath="memory://...")`` keeps the tables beside the ``.ckpt``
with no path in common between trainer and shards, resumes from there; ``load_from_checkpoint`` says where the tables are.

The shards here run in this process (``ShardServer``), so that they and the trainer see the same ``memory://``
file system, as shards on other hosts and a trainer see the same object store."""
from __future__ import annotations

from typing import Iterator, Optional

import fsspec
import lightning as L
import pytest
import torch

from lightning_persia import SGD, PersiaStrategy, PSSettings, RecoveryConfig
from lightning_persia.remote_ps.client import PSClient, PSRequestError
from lightning_persia.remote_ps.config import load_ps_config
from lightning_persia.remote_ps.server import ShardServer
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.table_config import TableConfig
from lightning_persia.strategy.ps_checkpoint import TABLES_ELSEWHERE_KEY
from toy import INIT, SEED, ToyRecommender, loader, make_batches


@pytest.fixture
def memory_fs() -> Iterator[fsspec.AbstractFileSystem]:
    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/ckpts"):
        fs.rm("/ckpts", recursive=True)


def _shards(count: int, overrides: tuple[str, ...] = ()) -> list[ShardServer]:
    servers = [ShardServer(ShardStore(i, count, seed=SEED), load_ps_config(None, list(overrides))) for i in range(count)]
    for server in servers:
        server.start()
    return servers


def _fit(servers: list[ShardServer], steps: int, ckpt_path: Optional[str] = None, **trainer_kwargs) -> None:
    strategy = PersiaStrategy(ps=PSSettings(addresses=[s.address for s in servers], timeout_s=30), embedding_optimizer=SGD(lr=0.5),
                              embedding_init=INIT, wire_dtype="fp32", recovery=RecoveryConfig(enabled=False))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, strategy=strategy, **trainer_kwargs)
    try:
        trainer.fit(ToyRecommender(device="meta"), loader(make_batches(8)), ckpt_path=ckpt_path)
    finally:
        strategy.close()


def _rows(servers: list[ShardServer]) -> torch.Tensor:
    with PSClient([s.address for s in servers]) as client:
        return client.lookup({"ebc.t0": torch.arange(40)}, train=False)["ebc.t0"]


def test_a_memory_url_checkpoint_holds_the_tables_and_a_run_resumes_from_it_on_other_shards(memory_fs):
    first = _shards(2)
    try:
        saving = L.pytorch.callbacks.ModelCheckpoint(dirpath="memory://ckpts", every_n_train_steps=2, save_top_k=1)
        _fit(first, steps=4, callbacks=[saving])
        trained = _rows(first)
    finally:
        for server in first:
            server.stop(0)
    ckpts = [p for p in memory_fs.ls("/ckpts", detail=False) if p.endswith(".ckpt")]
    assert ckpts == ["/ckpts/epoch=0-step=4.ckpt"]  # save_top_k=1: the step-2 .ckpt and its tables were removed
    (save,) = memory_fs.ls("/ckpts/epoch=0-step=4.ckpt.ps", detail=False)
    assert sorted(p.rsplit("/", 1)[1] for p in memory_fs.ls(save, detail=False)) == ["COMMITTED", "shard-00000-of-00002", "shard-00001-of-00002"]

    # Another shard count, nothing on disk in common with the first run. One shard: in-process shards reading the
    # same memory:// file at once would share its read position (memory:// hands every reader one buffer).
    second = _shards(1)
    try:
        # max_steps reached at the checkpoint's step: the run loads the checkpoint and trains nothing more
        _fit(second, steps=4, ckpt_path="memory://ckpts/epoch=0-step=4.ckpt", enable_checkpointing=False)
        torch.testing.assert_close(_rows(second), trained, rtol=0, atol=0)
    finally:
        for server in second:
            server.stop(0)


def test_load_from_checkpoint_names_where_the_tables_are(memory_fs):
    servers = _shards(1)
    try:
        _fit(servers, steps=2, callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath="memory://ckpts", every_n_train_steps=2)])
    finally:
        servers[0].stop(0)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*lightning_persia.serving.Predictor"):
        ToyRecommender.load_from_checkpoint("memory://ckpts/epoch=0-step=2.ckpt")
    with fsspec.open("memory://ckpts/epoch=0-step=2.ckpt", "rb") as f:
        state = torch.load(f, weights_only=True)["state_dict"]
    assert TABLES_ELSEWHERE_KEY in state and not any(k.startswith("ebc.") for k in state)


def test_a_shard_s_checkpoint_root_confines_urls_and_a_missing_folder_is_named(memory_fs, tmp_path):
    path_rooted, url_rooted = _shards(1, (f"checkpoint_root={tmp_path}",)) + _shards(1, ("checkpoint_root=memory://ckpts/allowed",))
    try:
        with PSClient([path_rooted.address]) as client:
            client.configure([TableConfig("t", 2)])
            with pytest.raises(PSRequestError, match="outside this shard's checkpoint_root"):
                client.save("memory://ckpts/x")  # a path root allows no URL
        with PSClient([url_rooted.address]) as client:
            client.configure([TableConfig("t", 2)])
            client.save("memory://ckpts/allowed/run")
            assert memory_fs.exists("/ckpts/allowed/run/shard-00000-of-00001/manifest.json")
            client.load("memory://ckpts/allowed/run")
            for outside in ("memory://ckpts/other", "memory://ckpts/allowed/../other", "memory://ckpts/allowed/.."):
                with pytest.raises(PSRequestError, match="outside this shard's checkpoint_root"):
                    client.save(outside)
            with pytest.raises(PSRequestError, match="no checkpoint folder at memory://ckpts/allowed/missing"):
                client.load("memory://ckpts/allowed/missing")
    finally:
        path_rooted.stop(0)
        url_rooted.stop(0)
