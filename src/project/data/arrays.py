"""A LightningDataModule for any data set that fits in memory as two tensors: inputs and labels.

To train on your own data, subclass :class:`ArrayDataModule` and implement :meth:`load_arrays`
(read a CSV, a ``.pt`` file, a folder of images...); splitting, batching and the loaders are done
here. README.md shows a worked example with a CSV file.
"""

from __future__ import annotations

import os

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, TensorDataset, random_split

from project.errors import ProjectError


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
            raise ProjectError(
                f"data.batch_size={batch_size!r} is invalid; expected an integer >= 1"
            )
        for name, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not 0 < fraction < 1:
                raise ProjectError(f"data.{name}={fraction!r} is invalid; expected 0 < value < 1")
        if val_fraction + test_fraction >= 1:
            raise ProjectError(
                f"data.val_fraction + data.test_fraction = {val_fraction + test_fraction} "
                "leaves nothing to train on; expected a sum below 1"
            )
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.num_workers = _resolve_workers(num_workers)
        self.pin_memory = torch.cuda.is_available() if pin_memory == "auto" else bool(pin_memory)
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
        dataset = TensorDataset(inputs, labels)
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
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )


def _resolve_workers(num_workers: int | str) -> int:
    """``auto``: in-memory tensors need no worker processes (they only add start-up and IPC cost)."""
    if num_workers == "auto":
        return 0
    if isinstance(num_workers, int) and num_workers >= 0:
        return min(num_workers, os.cpu_count() or 1)
    raise ProjectError(
        f"data.num_workers={num_workers!r} is invalid; expected an integer >= 0 or auto"
    )
