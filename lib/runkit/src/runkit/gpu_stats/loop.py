"""How long the training loop waited for data: two clock reads per measured step, no device sync.

The wait is the wall time between one ``on_train_batch_end`` and the next
``on_train_batch_start`` (fetching, moving and hooking the next batch); validation inside the
epoch is left out. An asynchronous GPU step overlaps the wait instead of adding to it, so a high
share means the input pipeline, not the GPU, sets the pace. Steps shorter than ``SLOW_STEP_S``
are timed in windows (:class:`LoopTimer`, :class:`Ticker`), so the hooks' cost stays out of a
fast loop.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
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


WINDOW_STEPS = 64
"""Steps in a measuring window: the fewest a window measures before it may close."""

WINDOW_EVERY_S = 1.0
"""Seconds between the starts of two measuring windows (:class:`Ticker`)."""

SLOW_STEP_S = 0.005
"""Steps at least this long are all measured: two hook calls (about 6 us) are then under 0.1 %
of a step. Faster steps are measured in windows (:class:`LoopTimer`)."""


class LoopTimer:
    """One training epoch's loop time, data wait and samples, measured on the training thread.

    :meth:`batch_start` and :meth:`batch_end` run at every measured training step, inside the
    step's time: each is kept to one clock read and a few attribute updates (``__slots__``).
    Samples are counted from the loader when :func:`fixed_batches` knows its batch sizes
    (looking into each batch cost a Lightning step about 2 us, most of the callback's per-step
    cost); else per batch, where the common batch, a tuple or list that starts with a tensor,
    skips :func:`batch_length`'s walk (``Mapping``'s ``isinstance`` alone costs more than the
    rest).

    Windows: the two hook calls a step cost about 6 us with Lightning's dispatch, 1 % of a
    0.7 ms step. So where the loader's batch sizes are known and ``window_steps`` steps took
    less than ``slow_step_s`` each, :meth:`batch_end` returns False: the caller stops calling
    the two hooks until it calls them again (``GpuStatsMonitor``: every ``WINDOW_EVERY_S``, and
    at each epoch's and validation's start), when a new window begins. The epoch's steps and
    samples then come from the batch index the caller passes to :meth:`summary`, exactly; its
    data wait is the wait measured plus, for each step whose wait was not, the mean wait of the
    typical steps measured (not the epoch's first, whose wait includes starting the loader's
    workers, nor one right after a validation). Slower steps, and loaders whose batches are
    counted one by one, are measured at every step: their figures are exact.
    """

    __slots__ = (
        "_check_at",
        "_epoch_start",
        "_first_index",
        "_fixed_size",
        "_last_end",
        "_last_index",
        "_last_size",
        "_odd_steps",
        "_odd_wait",
        "_open",
        "_paused_at",
        "_pending",
        "_said_uncountable",
        "_slow_step_s",
        "_unknown_waits",
        "_window_start",
        "_window_steps",
        "_windowed",
        "clock",
        "paused_s",
        "samples",
        "steps",
        "wait_s",
    )

    def __init__(
        self,
        clock: Any = time.perf_counter,
        window_steps: int = WINDOW_STEPS,
        slow_step_s: float = SLOW_STEP_S,
    ) -> None:
        self.clock = clock
        self._window_steps = window_steps
        self._slow_step_s = slow_step_s
        self._said_uncountable = False
        self.start_epoch()

    def start_epoch(self, fixed: tuple[int, int, int] | None = None) -> None:
        """A new epoch; ``fixed`` is :func:`fixed_batches` of its loader (None: count each batch).
        Its first window opens now."""
        self._epoch_start = self._last_end = self._window_start = self.clock()
        self._fixed_size, self._last_index, self._last_size = fixed or (0, -1, 0)
        self._pending = True  # the next batch start settles the epoch's first wait
        self._open = True  # the hooks are called
        self._windowed = False  # some of this epoch's steps were not measured
        self._check_at = self._window_steps
        self._paused_at: float | None = None
        self._first_index = 0
        self._odd_steps = 0  # measured steps whose wait is not typical: the first, after a pause
        self._odd_wait = 0.0
        self._unknown_waits = 0  # measured steps whose wait went unseen (a window's first)
        self.wait_s = 0.0  # of the measured steps
        self.paused_s = 0.0  # validation between the epoch start and the last step
        self.steps = 0  # measured
        self.samples: int | None = 0

    def batch_start(self) -> None:
        now = self.clock()
        if self._pending:  # the epoch's first step, the first after a validation or a window's
            self._settle(now)
            return
        self.wait_s += now - self._last_end

    def _settle(self, now: float) -> None:
        self._pending = False
        paused_at, self._paused_at = self._paused_at, None
        if paused_at is not None:  # after validation: the whole gap since it started is out
            self.paused_s += now - paused_at
            self._last_end += now - paused_at
        if not self._open:  # a window begins: the loop since the last one was not seen
            self._open = True
            self._window_start = now
            self._check_at = self.steps + 1 + self._window_steps
            if paused_at is None:
                self._unknown_waits += 1
            else:  # its wait is in the validation's time: none, but not a typical step
                self._odd_steps += 1
            return
        wait = now - self._last_end
        self.wait_s += wait
        if not self.steps:  # the loader starting up: no typical step either
            self._odd_steps += 1
            self._odd_wait += wait

    def batch_end(self, batch: Any, batch_idx: int = -1) -> bool:
        """Count the step; False: stop calling the two hooks until the next window."""
        if self._pending:  # its start went unseen (the hooks came back within the step)
            return True
        self._last_end = now = self.clock()
        self.steps += 1
        samples = self.samples
        if self._fixed_size:  # known from the loader: only the last batch may be short
            last = batch_idx == self._last_index
            self.samples = samples + (self._last_size if last else self._fixed_size)
            if self.steps >= self._check_at:
                return self._window_full(now, batch_idx)
            return True
        if samples is None:
            return True
        kind = type(batch)
        if (
            (kind is tuple or kind is list)
            and batch
            and isinstance(first := batch[0], torch.Tensor)
        ):
            shape = first.shape
            if shape:
                self.samples = samples + shape[0]
                return True
        size = batch_length(batch)
        if size is None and not self._said_uncountable:
            self._said_uncountable = True
            log.info(
                "loop: a training batch of type %s holds no tensor to count samples in; "
                "loop/samples_per_s is not logged (loop/data_wait_frac is)",
                type(batch).__name__,
            )
        self.samples = None if size is None else samples + size
        return True

    def _window_full(self, now: float, batch_idx: int) -> bool:
        """A window has its steps: close it if they were fast, else measure on."""
        self._check_at = self.steps + self._window_steps
        if now - self._window_start >= self._window_steps * self._slow_step_s:
            self._window_start = now
            return True
        if not self._windowed:  # every step so far was measured: the first index follows
            self._windowed = True
            self._first_index = batch_idx - self.steps + 1
        self._open = False
        self._pending = True  # the next batch start seen begins a window
        return False

    def pause(self) -> None:
        """Validation starts inside the epoch: its time, until the next training batch starts,
        is neither waiting nor training."""
        if self._paused_at is None:
            self._paused_at = self.clock()
            self._pending = True

    @property
    def windowed(self) -> bool:
        """Some of this epoch's steps were not measured: :meth:`summary` needs the batch index."""
        return self._windowed

    def summary(self, batch_idx: int | None = None) -> dict[str, float] | None:
        """``loop_s`` (epoch start to the last step's end, less validation), ``data_wait_s``,
        ``steps`` and ``samples`` (absent when a batch had no tensor); None before any step.

        ``batch_idx``: the index of the epoch's last batch so far (Lightning's); needed once a
        window has closed (see the class), when the steps and samples come from it.
        """
        if not self.steps:
            return None
        end = self._last_end
        if not self._windowed or batch_idx is None:
            steps, samples, wait = self.steps, self.samples, self.wait_s
        else:
            if not self._open:  # the last step went unseen: until the validation, or now
                end = self.clock() if self._paused_at is None else self._paused_at
            steps = batch_idx - self._first_index + 1
            samples = steps * self._fixed_size
            if self._first_index <= self._last_index <= batch_idx:
                samples += self._last_size - self._fixed_size
            typical = self.steps - self._unknown_waits - self._odd_steps
            mean = (self.wait_s - self._odd_wait) / typical if typical > 0 else 0.0
            wait = self.wait_s + mean * (steps - typical - self._odd_steps)
        out = {
            "loop_s": end - self._epoch_start - self.paused_s,
            "data_wait_s": wait,
            "steps": float(steps),
        }
        if samples is not None:
            out["samples"] = float(samples)
        return out


class Ticker:
    """Call ``tick`` every ``period_s`` seconds from a daemon thread, until :meth:`stop`.

    Why a thread: between two windows no hook of the loop runs, so nothing on the training
    thread could begin the next one. ``tick`` must be quick and safe from another thread.
    """

    def __init__(self, period_s: float, tick: Callable[[], None]) -> None:
        self._period_s = period_s
        self._tick = tick
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runkit-loop-windows", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._period_s):
            self._tick()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
