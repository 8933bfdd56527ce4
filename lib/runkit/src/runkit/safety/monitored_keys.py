"""A monitored key the LightningModule never logs ends the run in one line, judged at the end
of the first real validation (without one: a warning that no best is kept)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.model_helpers import is_overridden

from runkit.errors import RunError

log = logging.getLogger(__name__)


class MonitoredKeysCheck(Callback):
    """``settings``: the config setting behind each kind of monitor, for the line."""

    def __init__(self, settings: Mapping[str, str] | None = None) -> None:
        self.settings = dict(settings or {})
        self._checked, self._warned = False, False

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self._checked:
            return
        self._checked = True
        for kind, key, setting, logged in self._missing(trainer, lambda k: k != "scheduler"):
            fix = (
                f"it logs: {', '.join(logged)}. Set {setting} to one of them (and its mode to "
                "min or max)"
                if logged
                else f"it logs nothing (no self.log call). Log {key!r} with self.log"
            )
            if kind == "ModelCheckpoint":
                fix += f", or set {setting}=null to keep the latest checkpoint only"
            raise RunError(f"{setting}={key!r} is not a key {type(pl_module).__name__} logs; {fix}")

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._checked or self._warned:
            return
        self._warned = True
        why = (
            "no val batches"
            if is_overridden("validation_step", pl_module)
            else "no validation_step"
        )
        for _, key, setting, _ in self._missing(trainer, lambda kind: kind == "ModelCheckpoint"):
            if rank_zero_only.rank == 0:
                log.warning(
                    "%s=%r: no validation ran (%s has %s) and training does not log that key, "
                    "so no best checkpoint is kept and the last weights are tested; set %s to a "
                    "key training logs to keep the best",
                    *(setting, key, type(pl_module).__name__, why, setting),
                )

    def _missing(self, trainer: Trainer, applies: Any) -> list[tuple[str, str, str, list[str]]]:
        logged = sorted(trainer.callback_metrics)
        monitors = [
            (_kind(c), getattr(c, "monitor", None), getattr(c, "strict", True))
            for c in trainer.callbacks
        ]
        monitors += [
            ("scheduler", c.monitor, c.strict) for c in getattr(trainer, "lr_scheduler_configs", [])
        ]
        return [
            (kind, key, self.settings.get(kind, f"{kind}(monitor=...)"), logged)
            for kind, key, strict in monitors
            if isinstance(key, str)
            and key not in logged
            and applies(kind)
            and (strict or kind not in ("EarlyStopping", "scheduler"))
        ]


def _kind(callback: Any) -> str:  # the Lightning class it derives from (ModelCheckpoint)
    lightning = (c for c in type(callback).__mro__ if c.__module__.startswith("lightning."))
    return next((c.__name__ for c in lightning if c is not Callback), type(callback).__name__)
