"""Users' callbacks that CLI tests add (``+callbacks.pause._target_=user_callbacks.Pause``)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer


class Pause(Callback):
    """Hold at the first batch end of ``at``: train (from ``epoch``), sanity, test, predict."""

    def __init__(self, at: str, marker: str, epoch: int = 0) -> None:
        self.at, self.marker, self.epoch, self.done = at, Path(marker), epoch, False

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.at == "train" and trainer.ckpt_path is None and trainer.current_epoch >= self.epoch:
            self._pause(trainer)

    def on_validation_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.at == "sanity" and trainer.sanity_checking:
            self._pause(trainer)

    def on_test_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.at == "test":
            self._pause(trainer)

    def on_predict_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.at == "predict":
            self._pause(trainer)

    def _pause(self, trainer: Trainer) -> None:
        if self.done or not trainer.is_global_zero:
            return
        self.done = True
        hold(self.marker, str(trainer.global_step))


def hold(marker: Path, text: str) -> None:
    """Write ``marker`` (phase, then ``text``); wait for ``<marker>.release`` (300 s at most)."""
    from runkit.safety import signals

    marker.write_text(f"{signals.request.phase}\n{text}")
    release, deadline = Path(f"{marker}.release"), time.time() + 300
    while not release.exists() and time.time() < deadline:
        time.sleep(0.05)


class HoldSave(Callback):  # holds, once, the save a stop signal asked for, before it is written
    def __init__(self, marker: str) -> None:
        self.marker, self.done = Path(marker), False

    def on_save_checkpoint(self, trainer: Trainer, *args: Any) -> None:
        from runkit.safety import signals

        if self.done or signals.request.received is None or not trainer.is_global_zero:
            return
        self.done = True
        hold(self.marker, f"saving after signal {signals.request.received}")


class FailAtStart(Callback):  # raises on every rank at train start with learning rate ``lr``
    def __init__(self, lr: float) -> None:
        self.lr = lr

    def on_train_start(self, trainer: Trainer, *args: Any) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        if math.isclose(lr, self.lr):
            raise ValueError(f"user callback: refusing lr={lr}")


class PauseAtLr(Pause):  # Pause in the sweep job whose learning rate is ``lr`` only
    def __init__(self, at: str, marker: str, lr: float, epoch: int = 0) -> None:
        super().__init__(at, marker, epoch)
        self.lr = lr

    def _pause(self, trainer: Trainer) -> None:
        group = trainer.optimizers[0].param_groups[0]  # initial_lr once a scheduler has stepped
        if math.isclose(group.get("initial_lr", group["lr"]), self.lr):
            super()._pause(trainer)
