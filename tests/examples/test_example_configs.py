"""Every example config.yaml is a valid LightningCLI config: it parses, instantiates and runs a step."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from lightning_persia.cli import lightning_cli
from lightning_persia.data import CRITEO_SPARSE_FEATURES, SyntheticCriteoDataModule
from lightning_persia.data.synthetic import scaled_cardinalities
from lightning_persia.serving import CriteoRequestDecoder

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


@pytest.mark.parametrize("name", ["dlrm", "deepfm", "adult_income"])
def test_config_runs_a_few_steps(name, tmp_path, caplog):
    config = os.path.join(_EXAMPLES, name, "config.yaml")
    small = []
    if name != "adult_income":  # keep the tables and the stream small; ids stay below the tables' sizes
        small = [
            "--model.init_args.num_embeddings=" + str(scaled_cardinalities(0.01)),
            "--data.init_args.cardinality_scale=0.01",
            "--data.init_args.num_train_batches=2",
            "--data.init_args.num_val_batches=1",
            "--data.init_args.batch_size=256",
        ]
    cli = lightning_cli(
        [
            "fit",
            "--config",
            config,
            *small,
            "--trainer.max_steps=2",
            "--trainer.devices=1",  # in-process: the DDP launcher would re-run pytest
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    assert cli.trainer.global_step == 2
    assert "val_auc" in cli.trainer.callback_metrics
    assert type(cli.trainer.strategy).__name__ == "PersiaStrategy"
    assert not any(p.is_meta for p in cli.model.parameters())
    # the start-up announcement, and the result as the last word of fit (examples.common.PrintAUC)
    assert re.search(r"PersiaStrategy: embedded parameter server \(shards started here\): shard 0 at 127\.0\.0\.1:\d+, "
                     r"shard 1 at 127\.0\.0\.1:\d+ \(shard map version 0\)", caplog.text)
    assert re.search(r"PersiaStrategy: \d+ tables on the shards \(\w+\.\w+.*\); 0 kept on the trainers \(none\)", caplog.text)
    assert re.search(r"end of fit: val_auc 0\.\d{4}( vs ground-truth ceiling 0\.\d{4})? \(step 2\)$", caplog.records[-1].getMessage())
    cli.trainer.strategy.close()


@pytest.mark.parametrize("name, metric", [("dlrm", "val_auc"), ("deepfm", "val_auc"), ("adult_income", "test AUC")])
def test_config_quotes_the_figure_of_the_examples_readme(name, metric):
    with open(os.path.join(_EXAMPLES, name, "config.yaml")) as f:
        quoted = re.search(rf"^# Measured .*?{metric} (0\.\d+)", f.read(), re.M | re.S).group(1)
    with open(os.path.join(_EXAMPLES, "README.md")) as f:
        row = next(line for line in f if line.startswith(f"| `lightning-persia fit --config examples/{name}/config.yaml` |"))
    assert f"{metric} **{quoted}**" in row


def test_the_dlrm_online_config_publishes_versions(tmp_path):
    """examples/dlrm/serving.yaml + online.yaml: a version every N steps (here 1, on small tables)."""
    configs = [os.path.join(_EXAMPLES, "dlrm", name) for name in ("config.yaml", "serving.yaml", "online.yaml")]
    cli = lightning_cli(
        [
            "fit",
            *(arg for config in configs for arg in ("--config", config)),
            "--model.init_args.num_embeddings=" + str(scaled_cardinalities(0.01)),
            "--data.init_args.cardinality_scale=0.01",
            "--data.init_args.num_train_batches=2",
            "--data.init_args.num_val_batches=1",
            "--data.init_args.batch_size=256",
            "--trainer.max_steps=2",
            "--trainer.devices=1",
            "--trainer.val_check_interval=2",
            f"--trainer.callbacks.dirpath={tmp_path / 'deltas'}",
            "--trainer.callbacks.every_n_train_steps=1",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    assert sorted(p.name for p in (tmp_path / "deltas").iterdir()) == ["v00000002", "v00000003"]
    cli.trainer.strategy.close()


@pytest.mark.parametrize("name", ["criteo_binary", "parquet"])
def test_the_dlrm_data_configs_read_their_files(name, tmp_path, caplog):
    """examples/dlrm/<name>.yaml over config.yaml: the DLRM example takes the batches of files in that layout."""
    from tests.data.click_files import nvtabular_table, synthetic_rows, torchrec_days, write_nvtabular_output

    if name == "criteo_binary":  # as TorchRec's preprocessing writes them: vocabulary ids
        train, val = torchrec_days(tmp_path, [512, 256])
    else:  # as TorchRec's NVTabular pipeline leaves them: directories of parts, its column names
        train = write_nvtabular_output(tmp_path / "train", nvtabular_table(synthetic_rows(512)), row_group_size=128)
        val = write_nvtabular_output(tmp_path / "validation", nvtabular_table(synthetic_rows(256, start=512)), row_group_size=64)
    cli = lightning_cli(
        [
            "fit",
            "--config", os.path.join(_EXAMPLES, "dlrm", "config.yaml"),
            "--config", os.path.join(_EXAMPLES, "dlrm", f"{name}.yaml"),
            "--model.init_args.num_embeddings=" + str(scaled_cardinalities(0.01)),
            f"--data.init_args.train_files=[{train}]",
            f"--data.init_args.val_files=[{val}]",
            "--data.init_args.batch_size=128",
            "--data.init_args.num_workers=1",
            "--trainer.max_steps=4",
            "--trainer.devices=1",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    assert type(cli.datamodule).__name__ == {"criteo_binary": "CriteoBinaryDataModule", "parquet": "ParquetDataModule"}[name]
    assert cli.trainer.global_step == 4
    assert re.search(r"end of fit: val_auc 0\.\d{4} \(step 4\)$", caplog.records[-1].getMessage())
    assert cli.datamodule.transform.raw_features == tuple(cli.model.sparse_feature_names)  # vocabulary ids: ids raw
    if name == "criteo_binary":  # the last day's second half is the test set, as TorchRec's
        assert sum(b.batch_size for b in cli.datamodule.test_dataloader()) == 128
    cli.trainer.strategy.close()


def test_the_dlrm_dcn_multi_hot_config_trains_on_mlperf_days(tmp_path, caplog):
    """examples/dlrm/dcn_multi_hot.yaml on days in MLPerf's multi-hot layout (ids below MLPerf's table sizes, bags of
    1 to 100 ids): the 9 tables of at most 1,000 rows kept on the trainer read the raw ids directly, the bags are
    pooled, validation runs at a fraction of the epoch and test on the last day's second half."""
    from examples.dlrm.model import MLPERF_NUM_EMBEDDINGS
    from tests.data.click_files import MLPERF_MULTI_HOT_SIZES, torchrec_days, write_multi_hot_day

    (tmp_path / "multi_hot").mkdir()
    days = [write_multi_hot_day(str(tmp_path / "multi_hot" / f"day_{d}"), prefix, MLPERF_MULTI_HOT_SIZES,
                                [min(n, 2000) for n in MLPERF_NUM_EMBEDDINGS], seed=d)
            for d, prefix in enumerate(torchrec_days(tmp_path, [1024, 512]))]
    cli = lightning_cli(
        [
            "fit",
            "--config", os.path.join(_EXAMPLES, "dlrm", "dcn_multi_hot.yaml"),
            f"--data.init_args.train_files=[{days[0]}]",
            f"--data.init_args.val_files=[{days[1]}]",
            "--data.init_args.batch_size=128",
            "--data.init_args.num_workers=0",
            "--trainer.devices=1",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    assert cli.trainer.global_step == 8  # 1024 rows in batches of 128, one epoch
    assert cli.trainer.num_val_batches == [2] and cli.trainer.val_check_batch == 2  # 0.25 of 8 batches
    assert re.search(r"PersiaStrategy: 17 tables on the shards .*; 9 kept on the trainers", caplog.text)
    kept = cli.model.dlrm.sparse_arch.embedding_bag_collection.data_parallel
    assert kept.raw_features == tuple(f for f, n in zip(cli.model.sparse_feature_names, MLPERF_NUM_EMBEDDINGS) if n <= 1000)
    (result,) = cli.trainer.test(cli.model, datamodule=cli.datamodule)
    assert 0.0 <= result["test_auc"] <= 1.0 and cli.trainer.num_test_batches == [2]
    cli.trainer.strategy.close()


def test_the_dlrm_request_is_a_validation_row_as_the_files_hold_it_and_decodes_to_the_model_s_inputs():
    with open(os.path.join(_EXAMPLES, "dlrm", "request.json")) as f:
        body = json.load(f)
    assert "transformed" not in body and all(v is None or isinstance(v, str) for v in body["sparse"].values())
    data = SyntheticCriteoDataModule(seed=0, cardinality_scale=0.1, zipf_alpha=1.1)  # the example config's data
    decoder = CriteoRequestDecoder(CRITEO_SPARSE_FEATURES, 13, data.transform)
    decoded = decoder.collate([decoder.decode(body)])
    row = data.generator.batch("val", 0, 1)
    assert torch.equal(decoded.sparse_features.values(), row.sparse_features.values())
    torch.testing.assert_close(decoded.dense_features, row.dense_features)
