"""The zoo's data: a plain LightningDataModule, batches as ``tuple``, ``dict`` or ``dataclass``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, TensorDataset


@dataclass
class Points:  # Lightning moves its tensors to the device field by field
    x: torch.Tensor
    y: torch.Tensor


class PointsData(LightningDataModule):
    """``y = x @ w + noise``, split 70/15/15."""

    outputs = 1  # what a model's setup() reads to size its head

    def __init__(self, samples: int = 640, in_features: int = 8, batch_size: int = 32,
                 batch_kind: str = "tuple", seed: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.samples, self.in_features, self.batch_size = samples, in_features, batch_size
        self.batch_kind, self.seed = batch_kind, seed
        self.splits: dict[str, Dataset] = {}

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.samples, self.in_features, generator=generator)
        y = x @ torch.randn(self.in_features, generator=generator)
        y = y + 0.1 * torch.randn(self.samples, generator=generator)
        a, b = int(0.7 * self.samples), int(0.85 * self.samples)
        self.splits = {"train": TensorDataset(x[:a], y[:a]), "val": TensorDataset(x[a:b], y[a:b]),
                       "test": TensorDataset(x[b:], y[b:])}  # fmt: skip

    def _collate(self, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> object:
        x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        kind = self.batch_kind
        return (x, y) if kind == "tuple" else {"x": x, "y": y} if kind == "dict" else Points(x, y)

    def _loader(self, split: str) -> DataLoader:
        return DataLoader(self.splits[split], batch_size=self.batch_size,
                          shuffle=split == "train", collate_fn=self._collate)  # fmt: skip

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")


class TwoValidationSets(PointsData):  # the validation split, then the test one
    def val_dataloader(self) -> list[DataLoader]:  # type: ignore[override]
        return [self._loader("val"), self._loader("test")]
