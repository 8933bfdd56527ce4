"""How long the training loop waited for data: two clock reads a step, no device sync.

The wait is the wall time between one ``on_train_batch_end`` and the next
``on_train_batch_start`` (fetching, moving and hooking the next batch); validation inside the
epoch is left out. An asynchronous GPU step overlaps the wait instead of adding to it, so a high
share means the input pipeline, not the GPU, sets the pace.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)


def batch_length(batch: Any) -> int | None:
    """The number of samples in ``batch``: the first dimension of the first tensor in it.

    Tensors, mappings, lists, tuples and dataclasses are looked into, as Lightning's own
    ``batch_to_device`` does; anything else (a custom object) has no known length: ``None``.
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else None
    if isinstance(batch, (list, tuple)):  # the common batch first: Mapping's check costs more
        items: Any = batch
    elif isinstance(batch, Mapping):
        items = batch.values()
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = (getattr(batch, f.name) for f in dataclasses.fields(batch))
    else:
        return None
    for item in items:
        found = batch_length(item)
        if found is not None:
            return found
    return None


class LoopTimer:
    """One training epoch's loop time, data wait and samples, on the training thread (a clock
    read and a few attribute updates per hook: ``__slots__``)."""

    __slots__ = (
        "_last_end",
        "_paused_at",
        "_said",
        "_start",
        "clock",
        "paused_s",
        "samples",
        "steps",
        "wait_s",
    )

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self._said = False
        self.start_epoch()

    def start_epoch(self) -> None:
        """A new epoch: its first wait, loader start-up included, runs from now."""
        self._start = self._last_end = self.clock()
        self._paused_at: float | None = None
        self.wait_s = self.paused_s = 0.0
        self.steps = 0
        self.samples: int | None = 0

    def batch_start(self) -> None:
        now = self.clock()
        if self._paused_at is not None:  # after validation: the whole gap since it began is out
            self.paused_s += now - self._paused_at
            self._last_end += now - self._paused_at
            self._paused_at = None
        self.wait_s += now - self._last_end

    def batch_end(self, batch: Any) -> None:
        self._last_end = self.clock()
        self.steps += 1
        if self.samples is None:
            return
        size = batch_length(batch)
        if size is None and not self._said:
            self._said = True
            log.info(
                "loop: a training batch of type %s holds no tensor to count samples in; "
                "loop/samples_per_s is not logged (loop/data_wait_frac is)",
                type(batch).__name__,
            )
        self.samples = None if size is None else self.samples + size

    def pause(self) -> None:
        """Validation starts inside the epoch: its time, until the next training batch starts,
        is neither waiting nor training."""
        if self._paused_at is None:
            self._paused_at = self.clock()

    def summary(self) -> dict[str, float] | None:
        """``loop_s`` (epoch start to the last step's end, less validation), ``data_wait_s``,
        ``steps`` and ``samples`` (absent when a batch had no tensor); None before any step."""
        if not self.steps:
            return None
        out = {
            "loop_s": self._last_end - self._start - self.paused_s,
            "data_wait_s": self.wait_s,
            "steps": float(self.steps),
        }
        if self.samples is not None:
            out["samples"] = float(self.samples)
        return out
