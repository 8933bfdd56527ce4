"""How long the training loop waited for data: two clock reads per step, no device sync.

Lightning's training loop, between one ``on_train_batch_end`` and the next
``on_train_batch_start`` (``fit_loop.epoch_loop.advance``), fetches the next batch from the data
loader (``next(data_fetcher)``), moves it to the device (``batch_to_device``, with the
``on_before_batch_transfer`` hook), and writes the step's logged metrics; under DDP it also
broadcasts the stop flag. The first wait of an epoch runs from ``on_train_epoch_start``, so it
includes starting the loader's worker processes. Validation inside the epoch is not waiting
for data: its time is left out of the wait and of the loop's time alike.

The reading is the loop's wall time: an asynchronous GPU step that has not finished when the
next batch is asked for overlaps with the wait instead of adding to it, so a high share of
waiting means the input pipeline, not the GPU, sets the pace.
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
    if isinstance(batch, Mapping):
        items: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = (getattr(batch, f.name) for f in dataclasses.fields(batch))
    else:
        return None
    for item in items:
        found = batch_length(item)
        if found is not None:
            return found
    return None


def fixed_batches(loader: Any) -> tuple[int, int, int] | None:
    """``(size, last index, last size)`` of a loader whose every batch but the last holds exactly
    ``size`` samples, known without looking at a batch; ``None`` for any other loader.

    Known means: a plain ``DataLoader`` whose ``BatchSampler`` (torch's own) batches a sampler
    with a length, collated by ``default_collate``; a custom sampler, collate function or loader
    class may make batches of any size, so their batches are counted one by one (the first
    dimension of the first tensor, as :func:`batch_length`). Under DDP the sampler is the rank's
    ``DistributedSampler``, so the sizes are the rank's.
    """
    from torch.utils.data import BatchSampler, DataLoader, default_collate

    if type(loader) is not DataLoader or loader.collate_fn is not default_collate:
        return None
    batches = loader.batch_sampler
    if type(batches) is not BatchSampler:
        return None
    try:
        total = len(batches.sampler)
    except TypeError:  # an iterable dataset's sampler has no length
        return None
    size = batches.batch_size
    if batches.drop_last or total % size == 0:
        return size, -1, size  # no partial batch
    return size, total // size, total % size


class LoopTimer:
    """One training epoch's loop time, data wait and samples, measured on the training thread.

    :meth:`batch_start` and :meth:`batch_end` run at every training step, inside the step's
    time: each is kept to one clock read and a few attribute updates (``__slots__``). Samples
    are counted from the loader when :func:`fixed_batches` knows its batch sizes (looking into
    each batch cost a Lightning step about 2 us, most of the callback's per-step cost); else
    per batch, where the common batch, a tuple or list that starts with a tensor, skips
    :func:`batch_length`'s walk (``Mapping``'s ``isinstance`` alone costs more than the rest).
    """

    __slots__ = (
        "_epoch_start",
        "_fixed_size",
        "_last_end",
        "_last_index",
        "_last_size",
        "_paused_at",
        "_said_uncountable",
        "clock",
        "paused_s",
        "samples",
        "steps",
        "wait_s",
    )

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self._said_uncountable = False
        self.start_epoch()

    def start_epoch(self, fixed: tuple[int, int, int] | None = None) -> None:
        """A new epoch; ``fixed`` is :func:`fixed_batches` of its loader (None: count each batch)."""
        self._epoch_start = self._last_end = self.clock()
        self._fixed_size, self._last_index, self._last_size = fixed or (0, -1, 0)
        self._paused_at: float | None = None
        self.wait_s = 0.0
        self.paused_s = 0.0  # validation between the epoch start and the last step
        self.steps = 0
        self.samples: int | None = 0

    def batch_start(self) -> None:
        now = self.clock()
        if self._paused_at is not None:  # after validation: the whole gap since it started is out
            paused = now - self._paused_at
            self._paused_at = None
            self.paused_s += paused
            self._last_end += paused
        self.wait_s += now - self._last_end

    def batch_end(self, batch: Any, batch_idx: int = -1) -> None:
        self._last_end = self.clock()
        self.steps += 1
        samples = self.samples
        if self._fixed_size:  # known from the loader: only the last batch may be short
            last = batch_idx == self._last_index
            self.samples = samples + (self._last_size if last else self._fixed_size)
            return
        if samples is None:
            return
        kind = type(batch)
        if (
            (kind is tuple or kind is list)
            and batch
            and isinstance(first := batch[0], torch.Tensor)
        ):
            shape = first.shape
            if shape:
                self.samples = samples + shape[0]
                return
        size = batch_length(batch)
        if size is None and not self._said_uncountable:
            self._said_uncountable = True
            log.info(
                "loop: a training batch of type %s holds no tensor to count samples in; "
                "loop/samples_per_s is not logged (loop/data_wait_frac is)",
                type(batch).__name__,
            )
        self.samples = None if size is None else samples + size

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
            "loop_s": self._last_end - self._epoch_start - self.paused_s,
            "data_wait_s": self.wait_s,
            "steps": float(self.steps),
        }
        if self.samples is not None:
            out["samples"] = float(self.samples)
        return out
