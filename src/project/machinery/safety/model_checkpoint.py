"""Lightning's ModelCheckpoint, with ``last.ckpt`` that always holds the latest save point.

Lightning 2.6 writes ``last.ckpt`` only at a step where a top-k checkpoint was also written: once
the monitored metric stops improving (the digits' ``val/acc`` reaches 1.0 within a few epochs),
``last.ckpt`` stays behind, and ``ckpt_path=last``, a crash or a requeue resumes from an old
epoch. Here every save point (each ``every_n_epochs`` / ``every_n_train_steps`` trigger)
refreshes ``last.ckpt``, improved or not.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint


class ModelCheckpoint(LightningModelCheckpoint):
    """Drop-in for ``lightning.pytorch.callbacks.ModelCheckpoint`` (same arguments)."""

    def _save_topk_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]
    ) -> None:
        super()._save_topk_checkpoint(trainer, monitor_candidates)
        # Lightning saves last.ckpt after this call only if a file was written at this step; a
        # save point was reached either way, so mark the step as saved.
        self._last_global_step_saved = trainer.global_step
