"""A LightningDataModule for a data set in memory as two tensors: subclass it, implement
:meth:`ArrayDataModule.load_arrays` (own-model-and-data.md has an example)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, cast

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, RandomSampler, TensorDataset, default_collate, random_split

from runkit.errors import RunError


class ArrayDataModule(LightningDataModule):
    """Split once by ``split_seed`` (the training seed never moves samples between splits)."""

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
        num_workers: int | str = 0,
        pin_memory: bool | str = "auto",
    ) -> None:
        super().__init__()
        for key, value, ok, expected in (
            ("batch_size", batch_size, isinstance(batch_size, int) and batch_size >= 1,
             "an integer >= 1"),
            ("val_fraction", val_fraction, 0 < val_fraction < 1, "0 < value < 1"),
            ("test_fraction", test_fraction, 0 < test_fraction < 1, "0 < value < 1"),
            ("num_workers", num_workers, num_workers == "auto"
             or (isinstance(num_workers, int) and num_workers >= 0), ">= 0 or auto"),
            ("pin_memory", pin_memory, pin_memory == "auto" or isinstance(pin_memory, bool),
             "true, false, auto"),
        ):  # fmt: skip
            if not ok:
                raise RunError(f"data.{key}={value!r} is invalid; expected {expected}")
        if val_fraction + test_fraction >= 1:
            raise RunError(
                f"data.val_fraction + data.test_fraction = {val_fraction + test_fraction} "
                "leaves nothing to train on; expected a sum below 1"
            )
        self.batch_size, self.split_seed, self.pin_memory = batch_size, split_seed, pin_memory
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.num_workers = (
            0 if num_workers == "auto" else min(int(num_workers), os.cpu_count() or 1)
        )
        self.train_set = self.val_set = self.test_set = cast(Any, None)

    def load_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return all inputs (float, first dim = samples) and integer class labels."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_arrays()")

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        dataset = BatchedTensorDataset(*self.load_arrays())
        n_val, n_test = (round(len(dataset) * f) for f in (self.val_fraction, self.test_fraction))
        sizes = [len(dataset) - n_val - n_test, n_val, n_test]
        generator = torch.Generator().manual_seed(self.split_seed)
        self.train_set, self.val_set, self.test_set = random_split(dataset, sizes, generator)

    def train_dataloader(self) -> DataLoader:
        # seeded as pl.seed_everything set it (as Lightning's DistributedSampler, which DDP uses)
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        return self._loader(self.train_set, EpochShuffle(self.train_set, seed))

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)

    predict_dataloader = test_dataloader

    def _loader(self, dataset: Any, sampler: Any = None) -> DataLoader:
        kwargs = getattr(self.trainer, "distributed_sampler_kwargs", None)
        if sampler is None and kwargs and kwargs.get("num_replicas", 1) > 1:
            # Under DDP every evaluation sample once (Lightning's sampler would pad by repeating).
            sampler = UnrepeatedDistributedSampler(dataset, shuffle=False, **kwargs)
        # pin_memory auto: only for a CUDA device (on the CPU it would start a CUDA context)
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        cuda = getattr(device, "type", None) == "cuda"
        return DataLoader(
            dataset,
            sampler=sampler,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            pin_memory=cuda if self.pin_memory == "auto" else bool(self.pin_memory),
            persistent_workers=self.num_workers > 0,
            collate_fn=collate_rows,
        )


class BatchedTensorDataset(TensorDataset):
    """Serves a whole batch (``__getitems__``) with one indexing operation per tensor; the batch is
    itself such a data set, so a loader with the default collation still gets its samples."""

    def __getitems__(self, indices: list[int]) -> BatchedTensorDataset:
        index = torch.as_tensor(indices, dtype=torch.long)
        return BatchedTensorDataset(*(tensor[index] for tensor in self.tensors))


def collate_rows(batch: Any) -> Any:
    return list(batch.tensors) if isinstance(batch, TensorDataset) else default_collate(batch)


class EpochShuffle(RandomSampler):
    """An order per epoch from ``(seed, epoch)`` only: a resumed run sees the same order."""

    def __init__(self, data_source: Any, seed: int = 0) -> None:
        super().__init__(data_source)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()
