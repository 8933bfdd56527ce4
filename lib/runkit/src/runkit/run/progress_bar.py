"""Lightning's Rich progress bar, reading the logged values once per redraw, not every batch.

Lightning's ``RichProgressBar`` collects the progress-bar values after every training batch
(``trainer.progress_bar_metrics``: a walk over everything logged, and ``.item()`` of each tensor,
which on a GPU waits for the device), although it redraws the bar at most ``refresh_rate`` times
a second. On short steps that is a few percent of the step (the library's benchmarks measure
it), and a value logged with ``prog_bar=True`` at every step costs a device sync per
step. Here a training batch reads them only once a redraw interval has passed since the last
read, and between those batches does not touch the bar at all (Rich's task update and refresh
request: nothing is drawn in between anyway); the last batch of an epoch updates the count, and
the end of each training epoch and of each validation reads the values, so what the bar shows
once an epoch is over is final.

The first batch of every epoch also updates the count (not the values): Rich computes the
``it/s`` it shows from the count's samples since the task's last reset, and Lightning resets the
training task at each epoch start; without a sample near the start, an epoch shorter than a
redraw interval had one sample (its last batch) and the bar showed ``0.00it/s``.

Stopping the display (each stage's end) does not wait for Lightning's refresh thread, which
sleeps a whole redraw interval between checks: every fit, validate and test ended up to a second
(the default rate) later than its work, and up to a second per epoch with ``leave=True``.
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar as LightningRichProgressBar

from runkit import compat


class RichProgressBar(LightningRichProgressBar):
    """Drop-in for ``lightning.pytorch.callbacks.RichProgressBar`` (same arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._next_batch_read = 0.0  # time.monotonic() from which a batch reads the values again
        self._batch_read_due = True  # False only inside a training batch's end that skips it
        compat.skip_unused_batch_hooks(self)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        self._batch_read_due = now >= self._next_batch_read
        # the epoch's first and last batches always set the count: the rate's two ends
        ends = batch_idx == 0 or batch_idx + 1 == trainer.num_training_batches
        if not (self._batch_read_due or ends) and self.train_progress_bar_id is not None:
            # Nothing to redraw before the interval has passed: the count is set (absolutely)
            # at the next due batch and always at the epoch's first and last ones.
            self._batch_read_due = True
            return
        if self._batch_read_due and self.refresh_rate > 0:
            self._next_batch_read = now + 1.0 / self.refresh_rate
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            self._batch_read_due = True

    def _update_metrics(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # private: Lightning's one place that reads the values (batch ends, epoch ends)
        if self._batch_read_due:
            super()._update_metrics(trainer, pl_module)  # private: see above

    def _stop_progress(self) -> None:
        # private: Lightning's one place that stops the display (stage ends, exceptions)
        if self.progress is not None:
            compat.detach_refresh_thread(self.progress)
        super()._stop_progress()  # private: see above
