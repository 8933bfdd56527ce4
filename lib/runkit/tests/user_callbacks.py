"""Callbacks a user could write, which CLI tests add (``+callbacks.pause._target_=user_callbacks.Pause``).

Not part of the project: the tests put this directory on ``PYTHONPATH``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class Pause(Callback):
    """Hold the run at a known point, so a test can send a signal there.

    At the first batch end of the phase named by ``at`` (``train``, ``sanity`` (fit's sanity
    check), ``test``, ``predict``; in training, of epoch ``epoch`` or later) write ``marker`` and
    wait until the test creates ``<marker>.release``. A resumed fit does not pause.
    """

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
    """Write ``marker`` (the phase the project's signal handling says the run is in, then
    ``text``) and wait, in Python where signal handlers run, for ``<marker>.release`` (at most
    300 s)."""
    from runkit.safety import signals

    marker.write_text(f"{signals.request.phase}\n{text}")
    release, deadline = Path(f"{marker}.release"), time.time() + 300
    while not release.exists() and time.time() < deadline:
        time.sleep(0.05)


class PauseInExport(Callback):
    """Hold the run in its export phase, as it starts writing ``model.pth`` (after the test).

    ``on_test_end`` arms a ``state_dict`` hook on every module of the LightningModule: the first
    ``state_dict()`` after the test is the export's (nothing saves a checkpoint after the test),
    and there the hook writes ``marker`` and waits for ``<marker>.release``.
    """

    def __init__(self, marker: str) -> None:
        self.marker, self.done = Path(marker), False

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return

        def pause(*args: Any) -> None:  # a function: torch marks its hooks with an attribute
            if not self.done:
                self.done = True
                hold(self.marker, "export")

        for module in pl_module.modules():
            module.register_state_dict_post_hook(pause)


class HoldSave(Callback):
    """Hold the save a stop signal asked for: ``on_save_checkpoint`` (before the file is written)
    writes ``marker`` and waits for ``<marker>.release``, once, and only after the run got a stop
    signal (the periodic ``last.ckpt`` saves before it go through)."""

    def __init__(self, marker: str) -> None:
        self.marker, self.done = Path(marker), False

    def on_save_checkpoint(self, trainer: Trainer, *args: Any) -> None:
        from runkit.safety import signals

        if self.done or signals.request.received is None or not trainer.is_global_zero:
            return
        self.done = True
        hold(self.marker, f"saving after signal {signals.request.received}")


class FailAtStart(Callback):
    """Raise on every rank when training starts with learning rate ``lr``: a job of a sweep that
    fails after its DDP workers started."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def on_train_start(self, trainer: Trainer, *args: Any) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        if math.isclose(lr, self.lr):
            raise ValueError(f"user callback: refusing lr={lr}")


def _lr(trainer: Trainer) -> float:
    """The job's configured learning rate (a scheduler's ``initial_lr``, once one has stepped)."""
    group = trainer.optimizers[0].param_groups[0]
    return group.get("initial_lr", group["lr"])


class Rendezvous(Callback):
    """Jobs of a sweep meet: at train start each of ``parties`` jobs writes a file into
    ``folder`` and waits for the others' (300 s at most, then raises). A sweep that ran its jobs
    one after another fails here: the first job would wait alone. ``skip_lr``: a job with this
    learning rate takes no part."""

    def __init__(self, folder: str, parties: int, skip_lr: float | None = None) -> None:
        self.folder, self.parties, self.skip_lr = Path(folder), parties, skip_lr

    def on_train_start(self, trainer: Trainer, *args: Any) -> None:
        if self.skip_lr is not None and math.isclose(_lr(trainer), self.skip_lr):
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"{_lr(trainer)}").write_text(str(time.time()))
        deadline = time.time() + 300
        while len(list(self.folder.iterdir())) < self.parties:
            if time.time() > deadline:
                raise RuntimeError(f"rendezvous: alone in {self.folder} after 300 s")
            time.sleep(0.05)


class PauseAtLr(Pause):
    """:class:`Pause` in the job of a sweep whose learning rate is ``lr`` only."""

    def __init__(self, at: str, marker: str, lr: float, epoch: int = 0) -> None:
        super().__init__(at, marker, epoch)
        self.lr = lr

    def _pause(self, trainer: Trainer) -> None:
        if math.isclose(_lr(trainer), self.lr):
            super()._pause(trainer)
