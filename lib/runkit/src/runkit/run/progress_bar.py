"""Lightning's Rich progress bar, reading the logged values once per redraw, not every batch
(each read is a device sync); stopping the display does not wait out the refresh thread."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar as LightningRichProgressBar

from runkit import compat


class RichProgressBar(LightningRichProgressBar):
    """Drop-in for ``lightning.pytorch.callbacks.RichProgressBar`` (same arguments)."""

    def __init__(self, refresh_rate: int = 100, leave: bool = False, **kwargs: Any) -> None:
        super().__init__(refresh_rate, leave, **kwargs)
        self.leave = leave  # each epoch's bar kept: Lightning stops the display at each epoch
        self._next_read = 0.0  # time.monotonic() from which a batch reads the values again
        self._read = True  # False only inside a training batch's end that skips the read
        self._shown: dict[str, Any] | None = None

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        self._read = now >= self._next_read
        if self._read and self.refresh_rate > 0:
            self._next_read = now + 1.0 / self.refresh_rate
        # between due batches nothing to redraw: the next due batch or the last sets the count
        ends = batch_idx == 0 or batch_idx + 1 == trainer.num_training_batches
        if self._read or ends or self.train_progress_bar_id is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._read = True

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        if self._read or self._shown is None:  # else the values shown last
            self._shown = super().get_metrics(trainer, pl_module)
        return self._shown

    # Where Lightning stops the display (and joins its refresh thread): the thread let go first.
    def _let_go(self) -> None:
        if self.progress is not None:
            compat.detach_refresh_thread(self.progress)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.train_progress_bar_id is not None and self.leave:
            self._let_go()
        super().on_train_epoch_start(trainer, pl_module)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._let_go()
        super().teardown(trainer, pl_module, stage)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, err: BaseException
    ) -> None:
        self._let_go()
        super().on_exception(trainer, pl_module, err)
