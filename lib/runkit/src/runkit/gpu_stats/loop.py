"""How long the training loop waited for data: the wall time between one batch's end and the
next batch's start, validation left out; two clock reads a step, no device sync. An asynchronous
GPU step overlaps the wait, so a high share means the input pipeline sets the pace."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException

log = logging.getLogger(__name__)


def batch_length(batch: Any) -> int | None:
    """The samples in ``batch`` as Lightning counts them for ``self.log``; None without a tensor.
    The common ``(inputs, ...)`` batch is read directly (Lightning's walk costs microseconds)."""
    first = batch[0] if type(batch) in (tuple, list) and batch else batch
    if type(first) is torch.Tensor and first.ndim:
        return first.shape[0]
    try:
        return extract_batch_size(batch)
    except MisconfigurationException:
        return None


class LoopTimer:
    """One training epoch's loop time, data wait, steps and samples."""

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self._said_uncountable = False
        self.start_epoch()

    def start_epoch(self) -> None:
        self._epoch_start = self._last_end = self.clock()
        self._paused_at: float | None = None
        self.wait_s = self.paused_s = 0.0  # paused: validation between epoch start and last step
        self.steps = 0
        self.samples: int | None = 0

    def batch_start(self) -> None:
        now = self.clock()
        if self._paused_at is not None:  # after validation: the whole gap since it started is out
            gap, self._paused_at = now - self._paused_at, None
            self.paused_s += gap
            self._last_end += gap
        self.wait_s += now - self._last_end

    def batch_end(self, batch: Any) -> None:
        self._last_end = self.clock()
        self.steps += 1
        if self.samples is not None and (size := batch_length(batch)) is not None:
            self.samples += size
        elif self.samples is not None:
            self.samples = None
            if not self._said_uncountable:
                self._said_uncountable = True
                log.info("loop: a training batch of type %s holds no tensor to count samples "
                         "in; loop/samples_per_s is not logged (loop/data_wait_frac is)",
                         type(batch).__name__)  # fmt: skip

    def pause(self) -> None:
        """Validation starts: its time, until the next training batch starts, is left out."""
        if self._paused_at is None:
            self._paused_at = self.clock()

    def summary(self) -> dict[str, float] | None:
        """``loop_s`` (epoch start to the last step's end, less validation), ``data_wait_s``,
        ``steps`` and ``samples`` (absent when a batch had no tensor); None before any step."""
        if not self.steps:
            return None
        loop_s = self._last_end - self._epoch_start - self.paused_s
        out = {"loop_s": loop_s, "data_wait_s": self.wait_s, "steps": float(self.steps)}
        return out if self.samples is None else {**out, "samples": float(self.samples)}
