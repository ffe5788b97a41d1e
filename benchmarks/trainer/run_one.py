"""One benchmark configuration, in its own process (and, with 2 ranks, the DDP launcher of the second one).

``config`` (a JSON object on the command line) says everything: the model (``dlrm``, the default, or
``linear``), the mode (``local`` or ``persia``), ranks, staleness, sizes, the data cache, and where rank 0
writes its result JSON. ``test_batches: 0`` skips the evaluation after training (no AUC); ``loader_workers``: the
train DataLoader's worker processes (default 0); ``accelerator``: ``cpu`` (default) or ``gpu`` (the trainer, and
the local baseline's tables, on the first CUDA device).

``data`` says where the training batches come from, the same way for the local baseline and PersiaStrategy:

* ``memory`` (default): every batch of the run built before ``fit`` (in pinned memory on a GPU) and handed out
  by a ``DataLoader`` over the list, so that a step costs what training costs, not what making its batch costs;
* ``loader``: each batch built from the memory-mapped cache when the ``DataLoader`` asks for it (in its workers
  with ``loader_workers``, pinned on a GPU).
"""
from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from typing import Any, Dict, List

import torch


def _quiet() -> None:
    import logging

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_persia", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


class _StepClock:
    """Timestamps of every training step's end (rank 0), for samples/s over windows of steps.

    On a GPU a step's end on the host is not the end of its kernels: the device is synchronised at the edges of
    the windows (the end of the warm-up, then every ``window`` steps), and only there, so that a window's time
    is the device's and the steps inside it run as they would without the clock. The losses are read at the
    same edges (reading one is a synchronisation too).
    """

    def __init__(self, warmup: int, window: int, synchronize=None) -> None:
        import lightning as L

        clock = self

        class Callback(L.Callback):
            def on_train_start(self, trainer, module) -> None:
                clock.start = time.perf_counter()

            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
                count = len(clock.ends) + 1
                edge = count >= warmup and (count - warmup) % window == 0
                if edge and synchronize is not None:
                    synchronize()
                clock.ends.append(time.perf_counter())
                if (edge or synchronize is None) and isinstance(outputs, dict) and "loss" in outputs:
                    clock.losses.append(float(outputs["loss"]))

        self.start = 0.0
        self.ends: List[float] = []
        self.losses: List[float] = []
        self.callback = Callback()

    def windows(self, warmup: int, window: int, global_batch: int) -> List[float]:
        """samples/s of each full window of ``window`` steps after the first ``warmup`` steps."""
        ends = self.ends
        rates = []
        first = warmup  # ends[warmup - 1] is the end of the last warm-up step
        while first + window <= len(ends) and first >= 1:
            seconds = ends[first + window - 1] - ends[first - 1]
            rates.append(window * global_batch / seconds)
            first += window
        return rates


class _Rescales:
    """Moves the embedded shards to ``{step: shard count}`` after those steps, training on during each move (a move
    waits for the one before it; the end of fit for the last). ``reports``: what each move did."""

    def __init__(self, plan: Dict[int, int]) -> None:
        import lightning as L

        rescales = self

        class Callback(L.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
                if trainer.global_step in plan:
                    rescales.settle()
                    rescales.moving = trainer.strategy.scale_shards(plan[trainer.global_step], wait=False)

            def on_train_end(self, trainer, module) -> None:
                rescales.settle()

        self.reports: List[Dict[str, Any]] = []
        self.moving = None
        self.callback = Callback()

    def settle(self) -> None:
        if self.moving is not None:
            report = self.moving.result()
            self.reports.append({"to_shards": report.to_shards, "rows_moved": report.rows_moved,
                                 "seconds": report.seconds, "fenced_seconds": report.fenced_seconds})
            self.moving = None


def run(config: Dict[str, Any]) -> None:
    _quiet()
    threads = config.get("torch_threads")
    if threads:
        torch.set_num_threads(int(threads))
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_persia import Adagrad, EmbeddingWorkerSettings, PersiaStrategy, PSSettings, TableSettings
    from benchmarks.trainer.data import RankSlices
    from benchmarks.trainer.models import build_model, make_local_fused
    from benchmarks.trainer.probe import CpuMeter, StepProbe, device_name

    world = int(config["world"])
    batch = int(config["batch_size"])
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # one node: local rank == global rank
    accelerator = config.get("accelerator", "cpu")
    gpu = accelerator == "gpu"
    if gpu and not torch.cuda.is_available():
        raise RuntimeError("--accelerator gpu: torch sees no CUDA device on this machine")
    setup_start = time.perf_counter()

    model = build_model(config["cardinalities"], dim=config["dim"], seed=config["seed"], dense_lr=config["dense_lr"],
                        kind=config.get("model", "dlrm"))
    if config["mode"] == "local":
        if world != 1:
            raise ValueError("the local baseline runs on one rank (its tables are not sharded across ranks)")
        make_local_fused(model, lr=config["emb_lr"], eps=config["emb_eps"], ps_seed=config["ps_seed"],
                         device=torch.device("cuda", rank) if gpu else torch.device("cpu"))
        strategy: Any = "auto"
    else:
        ps_config = None
        if config.get("durability"):  # the embedded shards' write-ahead log level (in a folder of the cluster's own)
            ps_config = config["out"] + ".ps.yaml"
            with open(ps_config, "w") as f:
                f.write(f"durability: {config['durability']}\n")
        strategy = PersiaStrategy(
            ps=PSSettings(addresses=config.get("ps_addresses"), num_local_shards=config["shards"], seed=config["ps_seed"],
                          config=ps_config, token=config.get("ps_token"), timeout_s=120.0),
            staleness=config["staleness"],
            tables=TableSettings(optimizer=Adagrad(lr=config["emb_lr"], eps=config["emb_eps"], rowwise=True),
                                 storage_dtype=config.get("storage_dtype", "fp32")),
            wire_dtype=config["wire_dtype"],
            data_parallel_max_rows=config.get("data_parallel_max_rows", 0),
            merge_rank_gradients=config.get("merge_rank_gradients", True),
            embedding_workers=EmbeddingWorkerSettings(count=config["embedding_workers"]) if config.get("embedding_workers") is not None else None,
        )

    import benchmarks.trainer.probe as probe_module

    probe_module.SHARD_PIDS[:] = config.get("shard_pids", [])
    clock = _StepClock(config["warmup"], config["window"], torch.cuda.synchronize if gpu else None)
    cpu = CpuMeter(config["warmup"])
    callbacks = [clock.callback, cpu]
    scaling = None
    if config.get("scale_at"):
        scaling = _Rescales({int(step): int(shards) for step, shards in config["scale_at"].items()})
        callbacks.append(scaling.callback)
    probe = None
    if config.get("profile"):
        probe = StepProbe(warmup=config["warmup"], steps=config["steps"], trace=config.get("trace"))
        callbacks.append(probe)

    trainer = L.Trainer(
        accelerator=accelerator,
        devices=world,
        strategy=strategy,
        max_steps=config["steps"],
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # RankSlices deals the data to the ranks itself
        num_sanity_val_steps=0,
        inference_mode=False,  # FBGEMM's CPU TBE has no inference-mode kernel; no_grad evaluation everywhere
        limit_val_batches=0,
        callbacks=callbacks,
    )
    # A few batches more than the steps when the data has them: the prefetcher still runs at the last step (its
    # thread's CPU is then counted as its own by the profile).
    available = len(RankSlices(config["data_path"], "train", batch, None, rank, world))
    train: Any = RankSlices(config["data_path"], "train", batch, min(available, config["steps"] + 16), rank, world)
    workers = int(config.get("loader_workers", 0))
    data = config.get("data", "memory")
    if data == "memory":
        train = [train[i].pin_memory() if gpu else train[i] for i in range(len(train))]
    elif data != "loader":
        raise ValueError(f"data must be 'memory' or 'loader', got {data!r}")
    loader = DataLoader(train, batch_size=None, shuffle=False, num_workers=workers, persistent_workers=workers > 0,
                        pin_memory=gpu and data == "loader")
    fit_start = time.perf_counter()
    trainer.fit(model, train_dataloaders=loader)
    fit_s = time.perf_counter() - fit_start
    test_start = time.perf_counter()
    metrics = [{}]
    if config["test_batches"]:
        test = RankSlices(config["data_path"], "test", batch, config["test_batches"], rank, world)
        metrics = trainer.test(model, dataloaders=DataLoader(test, batch_size=None, shuffle=False), verbose=False)
    test_s = time.perf_counter() - test_start
    wal = None
    if isinstance(strategy, PersiaStrategy):
        if config.get("durability") and trainer.global_rank == 0:
            logs = [shard["server"]["wal"] for shard in strategy.client.stats()]
            wal = {key: sum(log.get(key, 0) for log in logs) for key in ("bytes_written", "records", "commits")}
        strategy.close()
    if trainer.global_rank != 0:
        return

    rates = clock.windows(config["warmup"], config["window"], batch)
    result = {
        "name": config["name"],
        "samples_per_s": statistics.median(rates) if rates else None,
        "window_samples_per_s": rates,
        "auc": float(metrics[0]["test_auc"]) if "test_auc" in metrics[0] else None,
        "test_loss": float(metrics[0]["test_loss"]) if "test_loss" in metrics[0] else None,
        "final_train_loss": statistics.mean(clock.losses[-10:]) if clock.losses else None,
        "steps": len(clock.ends),
        "samples": len(clock.ends) * batch,
        "fit_s": fit_s,
        "test_s": test_s,
        "setup_s": fit_start - setup_start,
        "first_step_s": (clock.ends[0] - clock.start) if clock.ends else None,
        "torch_threads": torch.get_num_threads(),
        "device": device_name(accelerator),
        "data": data,
        "durability": config.get("durability"),
        "wal": wal,
        **cpu.summary(),
    }
    if scaling is not None:
        result["rescales"] = scaling.reports
    if probe is not None:
        result["profile"] = probe.summary(skip=config["warmup"])
    tmp = config["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, config["out"])

