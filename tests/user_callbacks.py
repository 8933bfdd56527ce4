"""Callbacks a user could write, which CLI tests add (``+callbacks.pause._target_=user_callbacks.Pause``).

Not part of the project: the tests put this directory on ``PYTHONPATH``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer


class Pause(Callback):
    """Hold the run at a known point, so a test can send a signal there.

    At the first batch end of the phase named by ``at`` (``train``, ``test``) write ``marker``
    and wait until the test creates ``<marker>.release``. A resumed fit does not pause.
    """

    def __init__(self, at: str, marker: str) -> None:
        self.at, self.marker, self.done = at, Path(marker), False

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.at == "train" and trainer.ckpt_path is None:
            self._pause(trainer)

    def on_test_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.at == "test":
            self._pause(trainer)

    def _pause(self, trainer: Trainer) -> None:
        if self.done or not trainer.is_global_zero:
            return
        self.done = True
        self.marker.write_text(str(trainer.global_step))
        release, deadline = Path(f"{self.marker}.release"), time.time() + 300
        while not release.exists() and time.time() < deadline:
            time.sleep(0.05)


class FailAtStart(Callback):
    """Raise on every rank when training starts with learning rate ``lr``: a job of a sweep that
    fails after its DDP workers started."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def on_train_start(self, trainer: Trainer, *args: Any) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        if math.isclose(lr, self.lr):
            raise ValueError(f"user callback: refusing lr={lr}")
