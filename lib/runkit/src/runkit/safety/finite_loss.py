"""Stop (or skip the batch) when the training loss is NaN or infinite; never save such weights.

``stop`` reads the losses kept on the device every ``check_every_n_steps`` steps and before any
save (no host sync a step); ``skip`` syncs once a step. A diverged run stops before test/export.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from runkit.errors import RunError

log = logging.getLogger(__name__)


class NonFiniteLossError(RunError):
    exit_code = 3


class DivergedError(NonFiniteLossError):  # the weights or the monitored metric
    pass


class FiniteLoss(Callback):
    """Watch the training loss for NaN/inf; ``action`` is ``stop`` (default) or ``skip``."""

    def __init__(
        self,
        action: Literal["stop", "skip"] = "stop",
        check_every_n_steps: int = 50,
        max_skipped: int = 100,
    ) -> None:
        invalid = "callbacks.finite_loss.{}={!r} is invalid; expected {}"
        if action not in ("stop", "skip"):
            raise RunError(invalid.format("action", action, "stop or skip"))
        if not isinstance(check_every_n_steps, int) or check_every_n_steps < 1:
            raise RunError(
                invalid.format("check_every_n_steps", check_every_n_steps, "an integer >= 1")
            )
        self.action, self.max_skipped = action, max_skipped
        self.check_every_n_steps = check_every_n_steps
        self.skipped, self._batch = 0, 0
        self._lower = "Lower the learning rate"  # the hint; the config key where there is one
        self._losses: list[tuple[Tensor, int, int, int]] = []  # (loss, step, epoch, batch)
        self._loss_finite: Tensor | None = None  # this step's verdict (skip mode)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._losses = []
        with contextlib.suppress(KeyError, TypeError):  # the run's config (hparams) has the key
            pl_module.hparams["config"]["model"]["optimizer"]["lr"]
            self._lower = "Lower model.optimizer.lr"

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, index: int) -> None:
        self._batch = index

    def on_before_backward(self, trainer: Trainer, pl_module: Any, loss: Tensor) -> None:
        if self.action == "stop":
            where = (trainer.global_step, trainer.current_epoch, self._batch)
            self._losses.append((loss.detach().sum(), *where))
        else:
            finite = torch.isfinite(loss.detach()).all()
            self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        if self._loss_finite is None:
            return
        finite, self._loss_finite = bool(self._loss_finite), None  # the one host sync per step
        if finite:
            return
        self.skipped += 1
        log.warning(
            "Non-finite training loss at step %d (epoch %d, batch %d): batch skipped (%d so far)",
            *(trainer.global_step, trainer.current_epoch, self._batch, self.skipped),
        )
        optimizer.zero_grad(set_to_none=True)  # torch optimisers skip parameters without grads
        if self.skipped > self.max_skipped:
            raise NonFiniteLossError(
                f"{self.skipped} training batches had a non-finite loss "
                f"(callbacks.finite_loss.max_skipped={self.max_skipped}); stopping"
            )

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step % self.check_every_n_steps == 0:
            self.check()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.check()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:  # before ModelCheckpoint's
            self._check_monitored(trainer, "training stopped, no checkpoint holds it")

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: Any) -> None:
        self.check()  # raising here keeps Lightning from writing the file
        self.on_train_end(trainer, pl_module, "this checkpoint is not written")

    def on_train_end(
        self, trainer: Trainer, pl_module: Any, outcome: str = "nothing is tested or exported"
    ) -> None:
        # The module's weights, not the whole state_dict (a MaxMetric may hold -inf on purpose).
        if _agreed(trainer, not _all_finite([*pl_module.parameters(), *pl_module.buffers()])):
            raise DivergedError(self._diverged(trainer, "weights are", outcome))
        self._check_monitored(trainer, outcome)

    def _check_monitored(self, trainer: Trainer, outcome: str) -> None:
        monitor = getattr(trainer.checkpoint_callback, "monitor", None)
        value = trainer.callback_metrics.get(monitor) if monitor else None
        bad = value is not None and not _all_finite([value])
        if _agreed(trainer, bad):
            what = f"monitored metric {monitor}{f'={float(value)}' if bad else ' (on another rank)'} is"
            hint = f", or check how {type(trainer.lightning_module).__name__} computes {monitor}"
            raise DivergedError(self._diverged(trainer, what, outcome) + hint)

    def _diverged(self, trainer: Trainer, what: str, outcome: str) -> str:
        from runkit.safety.checkpoints import load_file

        callback = trainer.checkpoint_callback
        # Lightning names last_model_path before it writes it: only a file that is there counts.
        paths = (getattr(callback, n, "") for n in ("last_model_path", "best_model_path"))
        kept = next((p for p in paths if p and Path(p).exists()), "")
        if kept:  # the epoch and step it holds (a sharded one: in its meta.pt, not its shards)
            held = load_file(Path(kept) / "meta.pt" if Path(kept).is_dir() else kept, mmap=True)
            kept = f"{kept} (epoch {held.get('epoch')}, step {held.get('global_step')})"
        skipped = f", {self.skipped} batch(es) skipped" if self.skipped else ""
        # The epoch of the latest step: after the loop, current_epoch is already one more.
        epoch = max(trainer.fit_loop.epoch_progress.current.started - 1, 0)
        return (
            f"training diverged: the {what} not finite (NaN or inf) at step {trainer.global_step} "
            f"(epoch {epoch}{skipped}); {outcome}; the last finite checkpoint is "
            f"{kept or 'none (none was saved)'}. {self._lower}"
        )

    def check(self) -> None:
        if not self._losses:
            return
        finite = torch.isfinite(torch.stack([loss for loss, *_ in self._losses]))
        if bool(finite.all()):
            self._losses.clear()
            return
        # Kept as they are: any later check (a save on the way out) refuses again.
        _, step, epoch, batch = self._losses[int((~finite).nonzero()[0, 0])]
        raise NonFiniteLossError(
            f"non-finite training loss (NaN or inf) at step {step} (epoch {epoch}, batch {batch}); "
            f"training stopped, checkpoints saved before it are kept. {self._lower}, "
            "or set callbacks.finite_loss.action=skip to skip such batches"
        )


def _all_finite(tensors: Any) -> bool:
    """Whether every float tensor (a sharded one: this rank's shard) is finite; one host sync."""
    flags = [
        torch.isfinite(local).all()
        for tensor in tensors
        if isinstance(tensor, Tensor)
        and (
            local := tensor.to_local() if hasattr(tensor, "to_local") else tensor
        ).is_floating_point()
        and local.numel()
    ]
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all()) if flags else True


def _agreed(trainer: Trainer, bad: bool) -> bool:  # on any rank; every rank calls it
    return bool(trainer.strategy.reduce_boolean_decision(bad, all=False))
