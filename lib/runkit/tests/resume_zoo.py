"""A user's own data module and stops at chosen points, copied into the resume tests' runs."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer
from torch.utils.data import DataLoader, Dataset

from tinyapp.data import DigitsDataModule


class Jittered(Dataset):
    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        self.inputs, self.labels = inputs, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i] + 0.3 * torch.rand(self.inputs[i].shape), self.labels[i]


class UserDigits(LightningDataModule):
    def __init__(self, batch_size: int = 128, num_workers: int = 2) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers

    def setup(self, stage: str | None = None) -> None:
        digits = DigitsDataModule()
        digits.setup()
        self.train_set = Jittered(*_tensors(digits.train_set))
        self.val_set = Jittered(*_tensors(digits.val_set))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


def _tensors(subset: Any) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, labels = subset.dataset.tensors
    index = torch.as_tensor(subset.indices)
    return inputs[index], labels[index]


class StopIn(Callback):
    """SIGTERM at ``batch`` of ``phase`` (train, validation) in ``epoch``, once, unless resuming."""

    def __init__(self, phase: str, epoch: int, batch: int = 1) -> None:
        self.phase, self.epoch, self.batch, self.done = phase, epoch, batch, False

    def _maybe(self, trainer: Trainer, phase: str, batch_idx: int) -> None:
        if self.done or phase != self.phase or trainer.ckpt_path is not None:
            return
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch):
            self.done = True
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self._maybe(trainer, "train", args[-1])

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int, *args: Any
    ) -> None:
        self._maybe(trainer, "validation", batch_idx)


class KillRank(Callback):
    """``kill -9`` of global rank ``rank`` at ``batch`` of ``epoch``, in torchrun's first attempt."""

    def __init__(self, rank: int, epoch: int, batch: int) -> None:
        self.at = (rank, epoch, batch)

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, index: int) -> None:
        here = (trainer.global_rank, trainer.current_epoch, index)
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and here == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
