"""The zoo's data: a plain LightningDataModule, no ArrayDataModule, in three batch kinds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, TensorDataset


@dataclass
class Points:
    """A batch as a dataclass: Lightning moves its tensors to the device field by field."""

    x: torch.Tensor
    y: torch.Tensor


def _as_points(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> Points:
    return Points(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))


def _as_dict(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"x": torch.stack([r[0] for r in rows]), "y": torch.stack([r[1] for r in rows])}


class PointsData(LightningDataModule):
    """``y = x @ w + noise``, split 70/15/15 with a fixed seed; batches as ``tuple``, ``dict``
    or ``dataclass``. ``outputs``: what a model's ``setup()`` reads to size its head."""

    outputs = 1

    def __init__(
        self,
        samples: int = 640,
        in_features: int = 8,
        batch_size: int = 32,
        batch_kind: str = "tuple",
        seed: int = 0,
    ) -> None:
        super().__init__()
        if batch_kind not in ("tuple", "dict", "dataclass"):
            raise ValueError(f"batch_kind={batch_kind!r}; give tuple, dict or dataclass")
        self.samples, self.in_features, self.batch_size = samples, in_features, batch_size
        self.batch_kind, self.seed = batch_kind, seed
        self.splits: dict[str, Dataset] = {}

    def setup(self, stage: str) -> None:
        if self.splits:
            return
        generator = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.samples, self.in_features, generator=generator)
        w = torch.randn(self.in_features, generator=generator)
        y = x @ w + 0.1 * torch.randn(self.samples, generator=generator)
        cut_a, cut_b = int(0.7 * self.samples), int(0.85 * self.samples)
        self.splits = {
            "train": TensorDataset(x[:cut_a], y[:cut_a]),
            "val": TensorDataset(x[cut_a:cut_b], y[cut_a:cut_b]),
            "test": TensorDataset(x[cut_b:], y[cut_b:]),
        }

    def _loader(self, split: str) -> DataLoader:
        collate: Any = {"tuple": None, "dict": _as_dict, "dataclass": _as_points}[self.batch_kind]
        return DataLoader(
            self.splits[split],
            batch_size=self.batch_size,
            shuffle=split == "train",
            collate_fn=collate,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")


class TwoValidationSets(PointsData):
    """:class:`PointsData` with two validation loaders (the validation split, then the test one)."""

    def val_dataloader(self) -> list[DataLoader]:  # type: ignore[override]
        return [self._loader("val"), self._loader("test")]
