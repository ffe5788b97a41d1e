"""``train_bench.py --grow``: DLRM training while the embedding tables grow to 100M+ rows (PERSIA's "stable as the
model grows").

The data are Criteo-Terabyte-shaped: 26 tables with the cardinalities of the Criteo 1TB click logs as DLRM's
reference run caps them (40M ids), so the largest tables hold tens of millions of ids; every id is drawn from a
(truncated, continuous) power law of exponent ``--grow-zipf`` over its table, so most ids of a batch are hot ones
already stored and a long tail keeps adding new rows, as in click logs. Batches are generated on the fly (a few
ms each), in one trainer rank with the embedded shards. Every ``--window`` steps a line gives the window's
samples/s, the rows the shards hold and their resident memory; training stops once the shards hold
``--grow-rows`` rows in all. The figure of merit is the last windows' samples/s over the first ones' (medians of
``_EDGE`` windows each, since one window on shared cores swings with the other work), and the same for the CPU
seconds the trainer and its shards spend per 1,000 samples (which the other work on the cores barely moves).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Dict, Iterator, List

import torch
from torch.utils.data import IterableDataset

CRITEO_TB_CARDINALITIES = [
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10,
    2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
]


class GrowingCriteo(IterableDataset):
    """Endless Criteo-shaped batches with power-law ids over ``cardinalities`` (batch ``i`` depends on ``seed``, ``i``)."""

    def __init__(self, cardinalities: List[int], batch_size: int, exponent: float, seed: int = 0) -> None:
        from lightning_persia.data import CRITEO_NUM_DENSE, CRITEO_SPARSE_FEATURES

        self.sizes = torch.tensor(cardinalities, dtype=torch.float64)
        self.features = list(CRITEO_SPARSE_FEATURES)
        self.dense = CRITEO_NUM_DENSE
        self.batch_size, self.exponent, self.seed = batch_size, exponent, seed
        self._weights = torch.randn(self.dense, generator=torch.Generator().manual_seed(seed))

    def __iter__(self) -> Iterator[Any]:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        from lightning_persia.data import CriteoBatch

        step = 0
        while True:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            u = torch.rand(len(self.features), self.batch_size, generator=generator, dtype=torch.float64)
            a = 1.0 - self.exponent
            ranks = (((self.sizes.unsqueeze(1) ** a - 1.0) * u + 1.0) ** (1.0 / a)).long() - 1
            ids = torch.minimum(ranks.clamp(min=0), self.sizes.long().unsqueeze(1) - 1)
            dense = torch.randn(self.batch_size, self.dense, generator=generator)
            labels = (torch.rand(self.batch_size, generator=generator) < torch.sigmoid(dense @ self._weights)).float()
            sparse = KeyedJaggedTensor(keys=self.features, values=ids.reshape(-1),
                                       lengths=torch.ones(len(self.features) * self.batch_size, dtype=torch.int32))
            yield CriteoBatch(sparse_features=sparse, dense_features=dense, labels=labels)
            step += 1


_EDGE = 5  # windows at each end whose median is compared


def _shard_pids() -> List[str]:
    """This process's shard children (the embedded PS)."""
    pids = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            children = f.read().split()
        for pid in children:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"serve" in f.read():
                        pids.append(pid)
            except OSError:
                continue
    return pids


def _shards_rss(pids: List[str]) -> int:
    """Resident memory of the shard processes ``pids``."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total


def _cpu_s(pids: List[str]) -> float:
    """CPU seconds (user + system) this process and the processes ``pids`` have used so far."""
    total = 0.0
    for pid in ["self", *pids]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError):
            continue
    return total


def _edge_ratio(windows: List[Dict[str, float]], key: str) -> tuple[float, float]:
    """Median of ``key`` over the first and over the last :data:`_EDGE` windows."""
    edge = max(1, min(_EDGE, len(windows) // 2))
    return (statistics.median(w[key] for w in windows[:edge]), statistics.median(w[key] for w in windows[-edge:]))


def run_grow(args: Any) -> int:
    """Trains until the shards hold ``args.grow_rows`` rows; prints a line per window and a summary."""
    import lightning as L

    from lightning_persia import Adagrad, PersiaStrategy, PSSettings, TableSettings
    from lightning_persia.strategy.interception import TableOverride
    from benchmarks.trainer.models import build_model

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    batch, window, target = args.grow_batch_size, args.window or 20, int(args.grow_rows)
    model = build_model(CRITEO_TB_CARDINALITIES, dim=args.dim, seed=args.seed, dense_lr=args.dense_lr)
    overrides, ps_config, tier = {}, None, None
    if args.grow_storage == "disk":  # every table keeps --grow-memory-rows rows a shard in memory, the rest on disk
        tier = tempfile.mkdtemp(prefix="grow-tier-", dir=args.grow_disk_dir)
        ps_config = os.path.join(tier, "ps.yaml")
        with open(ps_config, "w") as f:
            f.write(f"disk_dir: {tier}\n")
        overrides = {config.name: TableOverride(storage="disk", capacity=int(args.grow_memory_rows))
                     for config in model.ebc.embedding_bag_configs()}
    strategy = PersiaStrategy(
        ps=PSSettings(num_local_shards=args.shards, seed=args.seed, timeout_s=300.0, config=ps_config),
        staleness=(args.staleness or [4])[0], wire_dtype=args.wire_dtype,
        tables=TableSettings(optimizer=Adagrad(lr=args.emb_lr, eps=1e-8, rowwise=True), storage_dtype=args.storage_dtype),
        log_embedding_metrics=False, table_overrides=overrides,
    )
    windows: List[Dict[str, float]] = []

    class Watch(L.Callback):
        def __init__(self) -> None:
            self.started = 0.0
            self.cpu = 0.0
            self.pids: List[str] = []

        def on_train_batch_end(self, trainer, module, outputs, batch_, batch_idx) -> None:
            step = batch_idx + 1
            if step == 1:
                self.pids = _shard_pids()
                self.started, self.cpu = time.perf_counter(), _cpu_s(self.pids)
                return
            if (step - 1) % window:
                return
            now, cpu = time.perf_counter(), _cpu_s(self.pids)
            stats = strategy.client.stats()
            disk_rows = sum(t.get("disk_rows", 0) for s in stats for t in s["tables"].values())
            rows = sum(t["rows"] for s in stats for t in s["tables"].values()) + disk_rows
            entry = {"step": step, "samples_per_s": window * batch / (now - self.started), "ps_rows": rows, "ps_disk_rows": disk_rows,
                     "cpu_s_per_1k_samples": (cpu - self.cpu) * 1000 / (window * batch),
                     "ps_rss_bytes": _shards_rss(self.pids), "load_average": os.getloadavg()[0]}
            windows.append(entry)
            print(f"  step {step:>6}  {entry['samples_per_s']:>9,.0f} samples/s  {entry['cpu_s_per_1k_samples']:6.3f} CPU s "
                  f"per 1k samples  {rows:>13,} rows on the shards ({disk_rows:,} on disk)  shards' RSS {entry['ps_rss_bytes'] / 1e9:5.2f} GB  "
                  f"load {entry['load_average']:.1f}", flush=True)
            self.started, self.cpu = now, cpu
            if rows >= target:
                trainer.should_stop = True

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=args.grow_max_steps, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[Watch()],
    )
    data = GrowingCriteo(CRITEO_TB_CARDINALITIES, batch, args.grow_zipf, seed=args.seed)
    print(f"grow: DLRM dim {args.dim}, batch {batch}, Criteo-Terabyte cardinalities ({sum(CRITEO_TB_CARDINALITIES):,} ids, "
          f"Zipf {args.grow_zipf}), {args.shards} embedded shards, storage {args.storage_dtype} "
          f"{'in memory' if tier is None else f'on disk past {int(args.grow_memory_rows):,} rows a table a shard'}, "
          f"until {target:,} rows; load average {os.getloadavg()[0]:.1f}", flush=True)
    try:
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    finally:
        strategy.close()
        if tier is not None:
            shutil.rmtree(tier, ignore_errors=True)
    if not windows:
        print("grow: no full window ran")
        return 1
    last = windows[-1]
    first_rate, last_rate = _edge_ratio(windows, "samples_per_s")
    first_cpu, last_cpu = _edge_ratio(windows, "cpu_s_per_1k_samples")
    summary = {"grow_storage": args.grow_storage, "grow_disk_rows": last["ps_disk_rows"], "grow_first_samples_per_s": first_rate, "grow_last_samples_per_s": last_rate,
               "grow_last_vs_first": last_rate / first_rate, "grow_cpu_last_vs_first": last_cpu / first_cpu,
               "grow_ps_rows": last["ps_rows"], "grow_steps": last["step"], "windows": windows,
               "load_average_after": os.getloadavg()[0]}
    print(f"grow: the last {_EDGE} windows ran at {last_rate:,.0f} samples/s (median) with {last['ps_rows']:,} rows on the "
          f"shards, the first {_EDGE} at {first_rate:,.0f}: {summary['grow_last_vs_first']:.2f}x; CPU per sample "
          f"{last_cpu:.3f} vs {first_cpu:.3f} s per 1k samples: {summary['grow_cpu_last_vs_first']:.2f}x; "
          f"load average {summary['load_average_after']:.1f}")
    if args.json:
        print(json.dumps(summary))
    return 0
