"""A LightningDataModule for any data set that fits in memory as two tensors: inputs and labels.

To train on your own data, subclass :class:`ArrayDataModule` and implement :meth:`load_arrays`
(read a CSV, a ``.pt`` file, a folder of images...); splitting, batching and the loaders are done
here. lib/runkit/docs/own-model-and-data.md shows a worked example with a CSV file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import (
    DataLoader,
    Dataset,
    RandomSampler,
    TensorDataset,
    default_collate,
    random_split,
)

from runkit.errors import RunError


class ArrayDataModule(LightningDataModule):
    """Split ``(inputs, labels)`` once into train/val/test and serve them as DataLoaders.

    The split is drawn from its own seeded generator, so changing the training ``seed`` never
    leaks test samples into training. ``batch_size`` is per process: under DDP each of N processes
    takes ``batch_size`` samples per step, so a step sees ``N * batch_size`` samples in all.
    """

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
        if not isinstance(batch_size, int) or batch_size < 1:
            raise RunError(f"data.batch_size={batch_size!r} is invalid; expected an integer >= 1")
        for name, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not 0 < fraction < 1:
                raise RunError(f"data.{name}={fraction!r} is invalid; expected 0 < value < 1")
        if val_fraction + test_fraction >= 1:
            raise RunError(
                f"data.val_fraction + data.test_fraction = {val_fraction + test_fraction} "
                "leaves nothing to train on; expected a sum below 1"
            )
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.num_workers = _resolve_workers(num_workers)
        if pin_memory != "auto" and not isinstance(pin_memory, bool):
            raise RunError(
                f"data.pin_memory={pin_memory!r} is invalid; expected true, false or auto"
            )
        self.pin_memory = pin_memory
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def load_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return all inputs (float, first dim = samples) and integer class labels."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_arrays()")

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        inputs, labels = self.load_arrays()
        dataset = BatchedTensorDataset(inputs, labels)
        n_val = round(len(dataset) * self.val_fraction)
        n_test = round(len(dataset) * self.test_fraction)
        n_train = len(dataset) - n_val - n_test
        generator = torch.Generator().manual_seed(self.split_seed)
        self.train_set, self.val_set, self.test_set = random_split(
            dataset, [n_train, n_val, n_test], generator=generator
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)

    def _loader(self, dataset: Dataset | None, shuffle: bool = False) -> DataLoader:
        if dataset is None:
            raise RuntimeError("setup() must run before the loaders are requested")
        options: dict[str, Any] = dict(
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            pin_memory=self._pin(),
            persistent_workers=self.num_workers > 0,
            collate_fn=collate_rows,
        )
        if not shuffle:
            return DataLoader(dataset, sampler=self._evaluation_sampler(dataset), **options)
        # The seed pl.seed_everything set (Lightning's DistributedSampler reads the same variable).
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        return DataLoader(dataset, sampler=EpochShuffle(dataset, seed), **options)

    def _evaluation_sampler(self, dataset: Dataset) -> UnrepeatedDistributedSampler | None:
        """Under DDP, each process takes every N-th sample and none twice, so every validation
        and test sample counts exactly once. Lightning's default sampler would pad the split to a
        multiple of N by repeating samples; the metrics gather the uneven shards themselves."""
        kwargs = getattr(self.trainer, "distributed_sampler_kwargs", None)
        if not kwargs or kwargs.get("num_replicas", 1) < 2:
            return None  # one process (or strategy=dp): the plain sequential order
        return UnrepeatedDistributedSampler(dataset, shuffle=False, **kwargs)

    def _pin(self) -> bool:
        """``auto``: pin only when the batches go to a CUDA device, where pinned pages let the
        copy run asynchronously (Lightning copies with ``non_blocking``); a CPU run gains nothing,
        and pinning would start a CUDA context on a GPU machine training on the CPU."""
        if self.pin_memory != "auto":
            return bool(self.pin_memory)
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        return getattr(device, "type", None) == "cuda"


class Rows(Sequence):
    """The samples of a batch, held as one stacked tensor per field (what
    :class:`BatchedTensorDataset` hands the DataLoader).

    :func:`collate_rows` passes the stacked tensors on as they are. It is also a sequence of
    ``(input, label)`` samples, so ``default_collate`` (a DataLoader built by hand over
    ``train_set``) still gets what it expects, one sample at a time.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i: Any) -> Any:
        return tuple(tensor[i] for tensor in self.tensors)


class BatchedTensorDataset(TensorDataset):
    """A ``TensorDataset`` that serves a whole batch with one indexing operation per tensor.

    A DataLoader asks a map-style dataset for ``__getitems__(indices)`` before falling back to
    one ``__getitem__`` per sample and stacking them (``random_split``'s ``Subset`` passes the
    call through). Per sample, a batch of 4,096 rows of 1,024 floats took ~30 ms on a laptop-class
    CPU core, longer than a GPU step; one index takes ~2 ms. Same samples, same order.
    """

    def __getitems__(self, indices: list[int]) -> Rows:
        index = torch.as_tensor(indices, dtype=torch.long)
        return Rows(tuple(tensor[index] for tensor in self.tensors))


def collate_rows(batch: Any) -> Any:
    """The DataLoader's collate step: a batch already stacked passes through (as the list
    ``default_collate`` makes of ``(input, label)`` samples); anything else is collated as usual."""
    if isinstance(batch, Rows):
        return list(batch.tensors)
    return default_collate(batch)


class EpochShuffle(RandomSampler):
    """A new order every epoch that depends only on ``(seed, epoch)``, not on any global RNG.

    So the order of epoch 7 is the same whether a run got there in one go or was resumed from a
    checkpoint (:class:`runkit.safety.resume.ResumeState` makes any sampler do the same, by seeding
    the generators per epoch; this one needs no seeding). Lightning calls :meth:`set_epoch` before each epoch; under DDP it replaces this
    sampler with a ``DistributedSampler``, which orders by ``(seed, epoch)`` in the same spirit.
    """

    def __init__(self, data_source: Sized, seed: int = 0) -> None:
        super().__init__(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


def _resolve_workers(num_workers: int | str) -> int:
    """``auto``: in-memory tensors need no worker processes (they only add start-up and IPC cost)."""
    if num_workers == "auto":
        return 0
    if isinstance(num_workers, int) and num_workers >= 0:
        return min(num_workers, os.cpu_count() or 1)
    raise RunError(f"data.num_workers={num_workers!r} is invalid; expected an integer >= 0 or auto")
