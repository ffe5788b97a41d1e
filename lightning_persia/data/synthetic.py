"""A synthetic click log with the Criteo schema, realistic skew and a known ground truth.

Rows are generated on the fly, vectorised, from a counter-based random generator (numpy's Philox, addressed by
(seed, split, row)): row ``i`` of a split is the same whatever the batch size, the rank count or the order of
generation. For each row:

* categorical feature ``f``: a rank drawn Zipf-like, ``P(k) ~ (k + 1) ** -zipf_alpha`` over ``cardinalities[f]``
  values (a discretised bounded Pareto, drawn by inverting its CDF), turned into a 32-bit "hex" value by a
  per-feature bijection; missing with a Criteo-like per-feature rate;
* dense feature ``j``: ``floor(exp(mu_j + sigma_j * z)) - 1`` with ``z ~ N(0, 1)`` (non-negative counts with a
  heavy tail, a few -1), missing with a Criteo-like rate;
* label: Bernoulli of the hidden ground-truth probability ``sigmoid(bias + first-order id effects + pairwise
  latent interactions + a logistic term over the transformed dense features)``; the effects are hashed from
  the (feature, id) pair, so nothing is stored per id and any cardinality costs nothing; the bias is
  calibrated for the requested positive rate (Criteo: about 25%).

The model's inputs are exactly the featurised batch (hashed ids, ``log1p`` dense), so the AUC of the true
probabilities (:meth:`SyntheticCriteo.ground_truth_auc`) is the ceiling any model can reach on that data.
:meth:`SyntheticCriteo.write_tsv` writes the same rows as Criteo TSV, so :class:`~lightning_persia.data.CriteoDataModule`
reads back the very batches this module generates.
"""
from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_persia.data._loader import batch_loader
from lightning_persia.data._sharding import process_rank
from lightning_persia.data.transform import TransformedFeatures
from lightning_persia.data.batch import CriteoBatch, hash_categorical, make_batch, transform_dense
from lightning_persia.data.criteo import (
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_NUM_DENSE,
    CRITEO_NUM_SPARSE,
    CRITEO_SPARSE_FEATURES,
    CriteoFeatures,
    tsv_transform,
)

#: Approximate share of missing values per categorical feature in Criteo Kaggle (C1..C26).
CRITEO_CATEGORICAL_MISSING_RATES: List[float] = [
    0.0, 0.0, 0.034, 0.034, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.034, 0.0,
    0.0, 0.0, 0.034, 0.0, 0.0, 0.44, 0.44, 0.034, 0.76, 0.0, 0.034, 0.44, 0.44,
]  # fmt: skip
#: Approximate share of missing values per dense feature in Criteo Kaggle (I1..I13).
CRITEO_DENSE_MISSING_RATES: List[float] = [
    0.45, 0.0, 0.21, 0.22, 0.026, 0.22, 0.043, 0.0005, 0.043, 0.45, 0.043, 0.77, 0.22,
]  # fmt: skip

SPLITS: Dict[str, int] = {"train": 0, "val": 1, "test": 2, "holdout": 3}
_CALIBRATION_SPLIT = 7
_CALIBRATION_ROWS = 1 << 16
_DRAWS_PER_ROW = 40  # uint64 draws reserved per row (10 Philox blocks of 4), each split into two 32-bit halves
# draw columns: [0, 26) Zipf (high half) and missing (low half) of each categorical feature,
# [26, 39) normal (high half) and missing (low half) of each dense feature, 39 the label (high half)
_D_CAT, _D_DENSE, _D_LABEL = 0, 26, 39
_SQRT12 = math.sqrt(12.0)
_BASE_SIGNAL = 0.6  # signal_scale=1 gives a ground-truth AUC of about 0.81 (Criteo models reach about 0.80)


def scaled_cardinalities(scale: float = 0.1, base: Optional[List[int]] = None, min_cardinality: int = 64) -> List[int]:
    """``ceil(c * scale)`` of each Criteo Kaggle cardinality, never below ``min(c, min_cardinality)``."""
    if scale <= 0:
        raise ValueError(f"cardinality scale must be > 0, got {scale}")
    base = CRITEO_KAGGLE_CARDINALITIES if base is None else base
    return [max(min(c, min_cardinality), math.ceil(c * scale)) for c in base]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser, a bijection of [0, 2**32), on uint64 arrays."""
    m = np.uint64(0xFFFFFFFF)
    x = x & m
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x85EBCA6B)) & m
    x = x ^ (x >> np.uint64(13))
    x = (x * np.uint64(0xC2B2AE35)) & m
    return x ^ (x >> np.uint64(16))


def _unit_hi(raw: np.ndarray) -> np.ndarray:
    """High 32 bits of uint64 draws -> float64 uniforms in (0, 1)."""
    return ((raw >> np.uint64(32)).astype(np.float64) + 0.5) * (1.0 / (1 << 32))


def _unit_lo(raw: np.ndarray) -> np.ndarray:
    """Low 32 bits of uint64 draws -> float64 uniforms in (0, 1)."""
    return ((raw & np.uint64(0xFFFFFFFF)).astype(np.float64) + 0.5) * (1.0 / (1 << 32))


def binary_auc(scores: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor) -> float:
    """ROC AUC (Mann-Whitney, ties counted half) of ``scores`` against 0/1 ``labels``."""
    scores = np.asarray(scores, dtype=np.float64).ravel()
    labels = np.asarray(labels).ravel() > 0.5
    num_pos = int(labels.sum())
    num_neg = labels.size - num_pos
    if num_pos == 0 or num_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # average 1-based rank of each run of tied scores
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    run_rank = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(run_rank, ends - starts)
    return float((ranks[labels].sum() - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


@dataclass
class SyntheticRows:
    """Raw rows as a Criteo file holds them, plus the hidden truth.

    ``cat_values`` are the 32-bit categorical values (``[n, 26]``, meaningless where ``cat_missing``),
    ``dense_values`` the integer dense values (``[n, 13]``, 0 where ``dense_missing``), ``labels`` 0/1 int64
    and ``probabilities`` the ground-truth click probabilities.
    """

    labels: np.ndarray
    dense_values: np.ndarray
    dense_missing: np.ndarray
    cat_values: np.ndarray
    cat_missing: np.ndarray
    probabilities: np.ndarray
    ids: Optional[torch.Tensor] = None  # featurised: hashed ids [n, 26] int64
    dense: Optional[torch.Tensor] = None  # featurised: transformed dense [n, 13] float32

    def __len__(self) -> int:
        return self.labels.shape[0]


class SyntheticCriteo(CriteoFeatures):
    """The generator: a Criteo-shaped, Zipf-skewed click log with a hidden logistic ground truth.

    Args:
        seed: everything (data and ground truth) is a pure function of the seed.
        cardinalities: distinct values per categorical feature (26 numbers); default
            :func:`scaled_cardinalities` of ``cardinality_scale``.
        cardinality_scale: scale of the Criteo Kaggle cardinalities when ``cardinalities`` is not given
            (0.1 gives about 3.4 million ids in all).
        zipf_alpha: Zipf exponent of the id frequencies (Criteo's are roughly 1.05-1.2).
        positive_rate: share of positive labels the bias is calibrated for.
        latent_dim: dimension of the hidden latent vectors of the pairwise interactions.
        num_interactions: number of feature pairs that interact in the ground truth.
        signal_scale: multiplies every ground-truth term but the bias (larger: easier task, higher ceiling).
    """

    def __init__(
        self,
        seed: int = 0,
        cardinalities: Optional[List[int]] = None,
        cardinality_scale: float = 0.1,
        zipf_alpha: float = 1.1,
        positive_rate: float = 0.25,
        latent_dim: int = 4,
        num_interactions: int = 12,
        signal_scale: float = 1.0,
    ) -> None:
        if cardinalities is None:
            cardinalities = scaled_cardinalities(cardinality_scale)
        if len(cardinalities) != CRITEO_NUM_SPARSE or min(cardinalities) < 1 or max(cardinalities) > 1 << 32:
            raise ValueError(f"need {CRITEO_NUM_SPARSE} cardinalities in [1, 2**32], got {cardinalities}")
        if zipf_alpha <= 0:
            raise ValueError(f"zipf_alpha must be > 0, got {zipf_alpha}")
        if not 0 < positive_rate < 1:
            raise ValueError(f"positive_rate must be in (0, 1), got {positive_rate}")
        if not 1 <= latent_dim <= 4:
            raise ValueError(f"latent_dim must be in 1..4, got {latent_dim}")
        if not 0 <= num_interactions <= CRITEO_NUM_SPARSE * (CRITEO_NUM_SPARSE - 1) // 2:
            raise ValueError(f"num_interactions must be in 0..325, got {num_interactions}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.seed = int(seed)
        self.cardinalities = [int(c) for c in cardinalities]
        self.zipf_alpha = float(zipf_alpha)
        self.positive_rate = float(positive_rate)
        self.latent_dim = latent_dim

        rng = np.random.Generator(np.random.Philox(key=(self.seed << 8) | 0xA5))
        cards = np.asarray(self.cardinalities, dtype=np.float64)
        self._max_rank = (cards - 1).astype(np.uint64)
        self._zipf_log_n1 = np.log(cards + 1.0)
        self._zipf_span = (cards + 1.0) ** (1.0 - self.zipf_alpha) - 1.0
        self._zipf_inv_e = 1.0 / (1.0 - self.zipf_alpha) if self.zipf_alpha != 1.0 else 0.0
        self._cat_missing_rate = np.asarray(CRITEO_CATEGORICAL_MISSING_RATES)
        self._dense_missing_rate = np.asarray(CRITEO_DENSE_MISSING_RATES)
        self._hex_salt = rng.integers(0, 1 << 32, size=CRITEO_NUM_SPARSE, dtype=np.uint64)
        self._effect_salt = np.uint64(int(rng.integers(0, 1 << 63)))
        self._dense_mu = rng.uniform(0.0, 4.0, size=CRITEO_NUM_DENSE)
        self._dense_sigma = rng.uniform(0.6, 1.8, size=CRITEO_NUM_DENSE)
        # ground truth: per-feature strength of the first-order id effects, interacting pairs, dense weights
        signal_scale *= _BASE_SIGNAL
        self._w_first = signal_scale * rng.uniform(0.05, 0.5, size=CRITEO_NUM_SPARSE)
        pairs = set()
        while len(pairs) < num_interactions:
            f, g = sorted(rng.choice(CRITEO_NUM_SPARSE, size=2, replace=False).tolist())
            pairs.add((f, g))
        self._pairs = np.asarray(sorted(pairs), dtype=np.int64).reshape(-1, 2)
        self._w_pair = signal_scale * rng.uniform(0.3, 0.7, size=len(self._pairs))
        self._w_dense = signal_scale * rng.normal(0.0, 0.3, size=CRITEO_NUM_DENSE)
        self._w_dense_pair = signal_scale * 0.3
        # hashed effects: u = (k + 0.5) / 4096 for a 12-bit k, mapped to (u - 0.5) * sqrt(12) (unit variance)
        self._unit_scale = _SQRT12 / 4096.0
        self._first_offset = float(self._w_first.sum()) * (0.5 * _SQRT12 - 0.5 * self._unit_scale)
        self._pair_features = np.unique(self._pairs)
        self._pair_index = np.searchsorted(self._pair_features, self._pairs)
        # standardisation of the dense features and bias, from a calibration sample
        self._dense_mean = np.zeros(CRITEO_NUM_DENSE)
        self._dense_std = np.ones(CRITEO_NUM_DENSE)
        self.bias = 0.0
        cat_values, cat_missing, dense_values, dense_missing, _ = self._features(_CALIBRATION_SPLIT, 0, _CALIBRATION_ROWS)
        ids = hash_categorical(torch.from_numpy(cat_values), torch.from_numpy(cat_missing)).numpy()
        dense = transform_dense(torch.from_numpy(dense_values), torch.from_numpy(dense_missing)).double().numpy()
        self._dense_mean = dense.mean(0)
        self._dense_std = dense.std(0) + 1e-6
        self.bias = self._calibrate(self._logits(ids, dense), self.positive_rate)

    # ---------------------------------------------------------------- generation
    def _draws(self, split: int, start: int, count: int) -> np.ndarray:
        bitgen = np.random.Philox(key=(self.seed << 8) | split, counter=start * (_DRAWS_PER_ROW // 4))
        return bitgen.random_raw(count * _DRAWS_PER_ROW).reshape(count, _DRAWS_PER_ROW)

    def _features(self, split: int, start: int, count: int):
        draws = self._draws(split, start, count)
        # Zipf-like ranks: inverse CDF of a bounded Pareto on [1, N + 1), floored
        cat_draws = draws[:, _D_CAT : _D_CAT + CRITEO_NUM_SPARSE]
        u = _unit_hi(cat_draws)
        if abs(self.zipf_alpha - 1.0) < 1e-9:
            x = np.exp(u * self._zipf_log_n1)
        else:
            x = (1.0 + u * self._zipf_span) ** self._zipf_inv_e
        ranks = np.minimum(x.astype(np.uint64) - np.uint64(1), self._max_rank)  # floor(x) - 1, x >= 1
        cat_values = _fmix32(ranks + self._hex_salt).astype(np.int64)
        cat_missing = _unit_lo(cat_draws) < self._cat_missing_rate
        dense_draws = draws[:, _D_DENSE : _D_DENSE + CRITEO_NUM_DENSE]
        z = torch.special.ndtri(torch.from_numpy(_unit_hi(dense_draws))).numpy()
        dense_values = np.exp(np.minimum(self._dense_mu + self._dense_sigma * z, 21.0)).astype(np.int64) - 1
        dense_missing = _unit_lo(dense_draws) < self._dense_missing_rate
        dense_values[dense_missing] = 0
        label_u = _unit_hi(draws[:, _D_LABEL])
        return cat_values, cat_missing, dense_values, dense_missing, label_u

    def _logits(self, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
        """Ground-truth logits of featurised rows: ``[n, 26]`` int64 ids, ``[n, 13]`` transformed dense."""
        h = _splitmix64(ids.view(np.uint64) ^ self._effect_salt)
        # 12-bit slices of the hash: a first-order effect and up to 4 latent coordinates, each of unit variance
        first = (h & np.uint64(0xFFF)).astype(np.float64)
        logit = (first @ self._w_first) * self._unit_scale - self._first_offset
        hp = h[:, self._pair_features]
        latent = [(((hp >> np.uint64(12 * (i + 1))) & np.uint64(0xFFF)).astype(np.float64) + 0.5) * self._unit_scale - 0.5 * _SQRT12
                  for i in range(self.latent_dim)]  # fmt: skip
        f, g = self._pair_index[:, 0], self._pair_index[:, 1]
        dots = sum(c[:, f] * c[:, g] for c in latent) / math.sqrt(self.latent_dim)  # [n, P]
        dense = (dense - self._dense_mean) / self._dense_std
        return self.bias + logit + dots @ self._w_pair + dense @ self._w_dense + self._w_dense_pair * dense[:, 0] * dense[:, 1]

    @staticmethod
    def _calibrate(logits: np.ndarray, target: float) -> float:
        lo, hi = -30.0, 30.0
        for _ in range(60):
            mid = (lo + hi) / 2
            rate = float(np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))))
            lo, hi = (mid, hi) if rate < target else (lo, mid)
        return (lo + hi) / 2

    def rows(self, split: str, start: int, count: int) -> SyntheticRows:
        """Rows ``[start, start + count)`` of ``split`` (``train``, ``val``, ``test`` or ``holdout``)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
        if start < 0 or count < 0:
            raise ValueError("start and count must be >= 0")
        cat_values, cat_missing, dense_values, dense_missing, label_u = self._features(SPLITS[split], start, count)
        ids = hash_categorical(torch.from_numpy(cat_values), torch.from_numpy(cat_missing))
        dense = transform_dense(torch.from_numpy(dense_values), torch.from_numpy(dense_missing))
        probabilities = 1.0 / (1.0 + np.exp(-self._logits(ids.numpy(), dense.double().numpy())))
        labels = (label_u < probabilities).astype(np.int64)
        return SyntheticRows(labels, dense_values, dense_missing, cat_values, cat_missing, probabilities, ids, dense)

    def batch(self, split: str, index: int, batch_size: int) -> CriteoBatch:
        """Batch ``index`` of ``split``: rows ``[index * batch_size, (index + 1) * batch_size)``, featurised."""
        return self.to_batch(self.rows(split, index * batch_size, batch_size))

    @staticmethod
    def to_batch(rows: SyntheticRows) -> CriteoBatch:
        """Featurise raw rows exactly as :class:`~lightning_persia.data.CriteoDataModule` does."""
        ids, dense = rows.ids, rows.dense
        if ids is None or dense is None:
            ids = hash_categorical(torch.from_numpy(rows.cat_values), torch.from_numpy(rows.cat_missing))
            dense = transform_dense(torch.from_numpy(rows.dense_values), torch.from_numpy(rows.dense_missing))
        return make_batch(ids, dense, torch.from_numpy(rows.labels), CRITEO_SPARSE_FEATURES)

    def ground_truth_auc(self, split: str = "holdout", num_rows: int = 1 << 18, start: int = 0) -> float:
        """AUC of the true probabilities against the sampled labels of rows ``[start, start + num_rows)``.

        No model can beat it on those rows in expectation: it is the ceiling for "model AUC vs ceiling".
        """
        probabilities, labels = [], []
        for chunk_start in range(start, start + num_rows, 1 << 16):
            rows = self.rows(split, chunk_start, min(1 << 16, start + num_rows - chunk_start))
            probabilities.append(rows.probabilities)
            labels.append(rows.labels)
        return binary_auc(np.concatenate(probabilities), np.concatenate(labels))

    def write_tsv(self, path: str, num_rows: int, gz: Optional[bool] = None, split: str = "train", start: int = 0) -> str:
        """Write rows ``[start, start + num_rows)`` of ``split`` as a Criteo TSV file; returns ``path``.

        Categorical values are written as 8 lower-case hex digits, missing values as empty fields. ``gz``
        (default: ``path`` ends with ``.gz``) compresses with gzip.
        """
        gz = path.endswith(".gz") if gz is None else gz
        opener = gzip.open if gz else open
        with opener(path, "wt", encoding="ascii", newline="\n") as out:
            for chunk_start in range(start, start + num_rows, 1 << 15):
                rows = self.rows(split, chunk_start, min(1 << 15, start + num_rows - chunk_start))
                out.write(_format_rows(rows))
        return path


def _format_rows(rows: SyntheticRows) -> str:
    labels = rows.labels.astype(str)
    dense = np.where(rows.dense_missing, "", rows.dense_values.astype(str))
    hexes = np.char.zfill(np.char.mod("%x", rows.cat_values), 8)
    cats = np.where(rows.cat_missing, "", hexes)
    table = np.concatenate([labels[:, None], dense, cats], axis=1).tolist()
    return "".join("\t".join(row) + "\n" for row in table)


class SyntheticCriteoDataset(Dataset):
    """The ``num_batches`` generated batches of one split: item ``i`` is batch ``i`` (generated when asked for).

    A DataLoader over it takes ``batch_size=None`` (each item is a batch already); a ``DistributedSampler``
    deals the batches to the ranks, and the DataLoader to its workers (see
    :meth:`SyntheticCriteoDataModule.dataloader`).
    """

    def __init__(self, generator: SyntheticCriteo, split: str, num_batches: int, batch_size: int) -> None:
        super().__init__()
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        if num_batches < 0 or batch_size < 1:
            raise ValueError("num_batches must be >= 0 and batch_size >= 1")
        self.generator, self.split = generator, split
        self.num_batches, self.batch_size = num_batches, batch_size

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> CriteoBatch:
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} of {self.num_batches}")
        return self.generator.batch(self.split, index, self.batch_size)


class SyntheticCriteoDataModule(CriteoFeatures, TransformedFeatures, LightningDataModule):
    """Synthetic Criteo-shaped batches generated on the fly (see :class:`SyntheticCriteo`).

    ``num_*_batches`` are global counts, dealt round-robin to the ranks. The same seed gives the same data.

    Args:
        num_train_batches: training batches per epoch (the same batches every epoch).
        num_val_batches: validation batches.
        num_test_batches: test batches.
        batch_size: rows per batch.
        num_workers: DataLoader worker processes per rank, each generating its share of the batches (0: the
            training process generates them, which bounds a fast trainer); ``None``: half the rank's share of the
            cores less one, at most 8 (0 on 2 cores).
        pin_memory: pin batches in host memory; ``None``: when the trainer runs on a GPU.
        **generator: :class:`SyntheticCriteo`'s: ``seed`` (of the data and of the hidden ground truth),
            ``cardinalities`` or ``cardinality_scale``, ``zipf_alpha``, ``positive_rate``, ``signal_scale``
            (larger: higher AUC ceiling), ``latent_dim``, ``num_interactions``.
    """

    def __init__(
        self,
        num_train_batches: int = 1000,
        num_val_batches: int = 50,
        num_test_batches: int = 50,
        batch_size: int = 4096,
        num_workers: Optional[int] = None,
        pin_memory: Optional[bool] = None,
        **generator: Any,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.generator = SyntheticCriteo(**generator)
        self.num_batches = {"train": num_train_batches, "val": num_val_batches, "test": num_test_batches}
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        #: what the batches are made of: the generated values featurised as the TSV reader does (hashed, log1p)
        self.transform = tsv_transform("hash")

    @property
    def cardinalities(self) -> List[int]:
        return list(self.generator.cardinalities)

    def dataset(self, split: str) -> SyntheticCriteoDataset:
        """Every batch of ``split``."""
        return SyntheticCriteoDataset(self.generator, split, self.num_batches[split], self.batch_size)

    def dataloader(self, split: str, rank: Optional[int] = None, world_size: Optional[int] = None) -> DataLoader:
        """Rank ``r`` of ``w``'s batches of ``split``: ``r, r + w, r + 2w, ...``, ``ceil(num_batches / w)`` of them,
        so that every rank runs as many steps (when ``w`` does not divide ``num_batches``, the last ranks
        repeat the first batches). ``rank`` and ``world_size`` default to the trainer's, else to
        ``torch.distributed``'s, else to one process.
        """
        if (rank is None or world_size is None) and self.trainer is not None:
            rank, world_size = self.trainer.global_rank, self.trainer.world_size
        rank, world_size = process_rank(rank, world_size)
        dataset = self.dataset(split)
        # A DistributedSampler of its own: Lightning keeps it, and the data is this module's to deal.
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        return batch_loader(dataset, self.num_workers, self.pin_memory, self.trainer, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self.dataloader("train")

    def val_dataloader(self) -> DataLoader:
        return self.dataloader("val")

    def test_dataloader(self) -> DataLoader:
        return self.dataloader("test")

    def ground_truth_auc(self, split: str = "val") -> float:
        """AUC of the true probabilities on the very rows of ``split`` that the data loaders yield (one rank)."""
        return self.generator.ground_truth_auc(split, num_rows=self.num_batches[split] * self.batch_size)

    def write_tsv(self, path: str, num_rows: int, gz: Optional[bool] = None, split: str = "train") -> str:
        """Write the first ``num_rows`` rows of ``split`` as a Criteo TSV file (see :meth:`SyntheticCriteo.write_tsv`)."""
        return self.generator.write_tsv(path, num_rows, gz=gz, split=split)
