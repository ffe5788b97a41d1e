"""DataLoaders that fit the trainer they feed: batches made in worker processes, pinned when it trains on a GPU."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from lightning.pytorch import LightningDataModule, Trainer
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_persia.data._batching import BatchStream
from lightning_persia.data.transform import TransformedFeatures

SPLITS = ("train", "val", "test")
MAX_AUTO_WORKERS = 8


def auto_workers(trainer: Optional[Trainer]) -> int:
    """DataLoader workers per rank when none are asked for: half of the rank's share of the cores, less one (the
    training process and the embedded shards use the rest), at most :data:`MAX_AUTO_WORKERS`: 0 on 2 cores, 3 on
    8, 7 on 16 (one rank per machine)."""
    ranks_here = trainer.num_devices if trainer is not None else 1
    return max(0, min(MAX_AUTO_WORKERS, (os.cpu_count() or 1) // ranks_here // 2 - 1))


def on_gpu(trainer: Optional[Trainer]) -> bool:
    """Whether ``trainer`` trains on a CUDA device (where pinned batches reach it asynchronously)."""
    return trainer is not None and trainer.strategy.root_device.type == "cuda"


def batch_loader(
    dataset: Dataset, num_workers: Optional[int], pin_memory: Optional[bool], trainer: Optional[Trainer],
    sampler: Optional[Sampler] = None,
) -> DataLoader:
    """A loader of a dataset whose items are whole batches: ``num_workers`` processes make them (kept across epochs;
    ``None``: :func:`auto_workers`), pinned when ``pin_memory``, or, when it is ``None``, when ``trainer`` is on a GPU."""
    num_workers = auto_workers(trainer) if num_workers is None else num_workers
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    return DataLoader(
        dataset,
        batch_size=None,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=on_gpu(trainer) if pin_memory is None else pin_memory,
        persistent_workers=num_workers > 0,
    )


class SplitDataModule(TransformedFeatures, LightningDataModule):
    """A data module of streaming datasets, one per split (:meth:`make_dataset`), each read by this rank's share.

    Args:
        num_workers: DataLoader worker processes per rank; ``None``: :func:`auto_workers`.
        pin_memory: pin batches in host memory; ``None``: when the trainer runs on a GPU.
    """

    def __init__(self, num_workers: Optional[int] = None, pin_memory: Optional[bool] = None) -> None:
        super().__init__()
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.datasets: Dict[str, Any] = {}

    def make_dataset(self, split: str) -> Optional[Dataset]:  # pragma: no cover - abstract
        """The dataset of ``split`` (``train``, ``val`` or ``test``), or ``None`` when the split has no data."""
        raise NotImplementedError

    def dataset(self, split: str) -> Optional[Dataset]:
        """The dataset of ``split``, built once, told this trainer's rank and world size."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if split not in self.datasets:
            self.datasets[split] = self.make_dataset(split)
        dataset = self.datasets[split]
        if dataset is not None and self.trainer is not None:
            dataset.rank, dataset.world_size = self.trainer.global_rank, self.trainer.world_size
        return dataset

    def _loader(self, split: str) -> Any:
        dataset = self.dataset(split)
        if dataset is None:
            return []
        loader = batch_loader(dataset, self.num_workers, self.pin_memory, self.trainer)
        if isinstance(dataset, BatchStream):
            dataset.num_workers = loader.num_workers
        return loader

    def train_dataloader(self) -> DataLoader:
        if self.dataset("train") is None:
            raise ValueError(f"{type(self).__name__} has no training files")
        return self._loader("train")

    def val_dataloader(self) -> Any:
        return self._loader("val")

    def test_dataloader(self) -> Any:
        return self._loader("test")


class FileSplitDataModule(SplitDataModule):
    """A :class:`SplitDataModule` whose splits are lists of files, read in batches of one size for training and
    another for evaluation; :meth:`read_files` makes the dataset of one list. The file data modules declare their own
    arguments and pass these on (``**kwargs``), so that their help and YAML configs list these too.

    Args:
        train_files: the training files (patterns allowed), read in order.
        val_files: the validation files; none means no validation loop.
        test_files: the test files; none means ``trainer.test`` has nothing to run.
        batch_size: rows per training batch.
        eval_batch_size: rows per validation/test batch (default: ``batch_size``).
        drop_last: drop the last incomplete training batch of a pass.
        num_workers: DataLoader worker processes per rank, each reading its share; ``None``: half the rank's share
            of the cores less one, at most 8 (0 on 2 cores).
        pin_memory: pin batches in host memory; ``None``: when the trainer runs on a GPU.
    """

    def __init__(
        self, train_files: List[str], val_files: Optional[List[str]] = None, test_files: Optional[List[str]] = None,
        batch_size: int = 4096, eval_batch_size: Optional[int] = None, drop_last: bool = False,
        num_workers: Optional[int] = None, pin_memory: Optional[bool] = None,
    ) -> None:
        super().__init__(num_workers=num_workers, pin_memory=pin_memory)
        self.files = {"train": list(train_files), "val": list(val_files or []), "test": list(test_files or [])}
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.drop_last = drop_last

    def read_files(self, files: List[str], batch_size: int, drop_last: bool) -> Dataset:  # pragma: no cover - abstract
        """The dataset of ``files`` in batches of ``batch_size`` rows."""
        raise NotImplementedError

    def make_dataset(self, split: str) -> Optional[Dataset]:
        if not self.files[split]:
            return None
        train = split == "train"
        return self.read_files(self.files[split], self.batch_size if train else self.eval_batch_size, self.drop_last and train)
