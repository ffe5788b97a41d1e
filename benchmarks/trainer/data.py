"""Pre-generated synthetic Criteo batches for the training benchmark, shared by every configuration of a run.

Generating a 4096-row batch of :class:`~lightning_persia.data.SyntheticCriteo` costs about 100 ms of CPU on
this machine: generated on the fly it would compete with the very work being measured. So the rows are
generated once, written to a cache file (``torch.save``; reused by later invocations with the same
settings), and memory-mapped by every trainer process.

A benchmark batch is *global*: batch ``i`` is rows ``[i * B, (i + 1) * B)`` of the split, and rank ``r`` of
``w`` trains on the slice ``[r * B / w, (r + 1) * B / w)`` of it, so 1 and 2 ranks see the same samples in
the same order and step for step the same global batch.

Ids are stored already reduced modulo their table's size (the hashing trick, done by the data pipeline as
in the usual Criteo preprocessing), so the model's own ``table_ids`` reduction changes nothing and the
KeyedJaggedTensor the embedding module receives holds the very ids of the batch: what PersiaStrategy's
prefetcher plans its lookups from. (A model that changes the ids inside its forward defeats the prefetch:
every step then waits for a lookup issued by the forward itself.)
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import Dataset

from lightning_persia.data import CRITEO_SPARSE_FEATURES, CriteoBatch, SyntheticCriteo, binary_auc, make_batch

_CHUNK_ROWS = 1 << 16


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning_persia" / "train_bench"


def data_key(settings: dict) -> str:
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def prepare(
    cache_dir: Path,
    *,
    seed: int,
    batch_size: int,
    train_batches: int,
    test_batches: int,
    cardinality_scale: float,
    zipf_alpha: float,
    log=print,
) -> dict:
    """Generates (or finds) the cached rows; returns ``{path, cardinalities, ground_truth_auc, ...}``."""
    settings = dict(seed=seed, batch_size=batch_size, train_batches=train_batches, test_batches=test_batches,
                    cardinality_scale=cardinality_scale, zipf_alpha=zipf_alpha, version=2)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"criteo-{data_key(settings)}.pt"
    meta_path = path.with_suffix(".json")
    if path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        meta["path"] = str(path)
        meta["generated_s"] = 0.0
        return meta
    generator = SyntheticCriteo(seed=seed, cardinality_scale=cardinality_scale, zipf_alpha=zipf_alpha)
    cardinalities = torch.tensor(generator.cardinalities, dtype=torch.int64)
    start = time.perf_counter()
    tensors = {}
    ceiling = None
    for split, batches in (("train", train_batches), ("test", test_batches)):
        rows = batches * batch_size
        log(f"  generating {rows:,} {split} rows of synthetic Criteo data (once; cached in {cache_dir}) ...")
        ids, dense, labels, probabilities = [], [], [], []
        for first in range(0, rows, _CHUNK_ROWS):
            chunk = generator.rows(split, first, min(_CHUNK_ROWS, rows - first))
            ids.append(torch.remainder(chunk.ids, cardinalities))  # the hashing trick, done by the data
            dense.append(chunk.dense)
            labels.append(torch.from_numpy(chunk.labels).to(torch.float32))
            probabilities.append(torch.from_numpy(chunk.probabilities))
        tensors[f"{split}_ids"] = torch.cat(ids)
        tensors[f"{split}_dense"] = torch.cat(dense)
        tensors[f"{split}_labels"] = torch.cat(labels)
        if split == "test":
            ceiling = binary_auc(torch.cat(probabilities), tensors["test_labels"])
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(tensors, tmp)
    os.replace(tmp, path)
    meta = dict(settings=settings, cardinalities=generator.cardinalities, ground_truth_auc=ceiling,
                positive_rate=float(tensors["train_labels"].mean()))
    meta_path.write_text(json.dumps(meta))
    meta["path"] = str(path)
    meta["generated_s"] = time.perf_counter() - start
    return meta


class RankSlices(Dataset):
    """Global batch ``i`` of a split, this rank's slice of it, as a :class:`CriteoBatch` (``DataLoader(batch_size=None)``)."""

    def __init__(self, path: str, split: str, batch_size: int, num_batches: Optional[int] = None, rank: int = 0, world_size: int = 1) -> None:
        if batch_size % world_size:
            raise ValueError(f"global batch {batch_size} is not divisible by {world_size} ranks")
        data = torch.load(path, mmap=True, weights_only=True)
        self.ids, self.dense, self.labels = data[f"{split}_ids"], data[f"{split}_dense"], data[f"{split}_labels"]
        available = self.labels.shape[0] // batch_size
        self.num_batches = available if num_batches is None else num_batches
        if self.num_batches > available:
            raise ValueError(f"{split}: {self.num_batches} batches asked for, the cache holds {available}")
        self.batch_size = batch_size
        self.local = batch_size // world_size
        self.rank = rank

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> CriteoBatch:
        if not 0 <= index < self.num_batches:
            raise IndexError(index)
        start = index * self.batch_size + self.rank * self.local
        end = start + self.local
        return make_batch(self.ids[start:end], self.dense[start:end], self.labels[start:end], CRITEO_SPARSE_FEATURES)
