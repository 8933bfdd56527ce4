"""A monitored key the LightningModule never logs ends the run in one line, before training.

``ModelCheckpoint(monitor=...)``, ``EarlyStopping(monitor=...)`` and a scheduler's ``monitor``
name a key the module is expected to ``self.log``. When it does not (a module of one's own that
logs ``val_loss`` where the config says ``val/acc``), Lightning finds out only after the first
training epoch and raises an 85-line MisconfigurationException. This callback looks right after
the sanity check, when the module has logged its validation keys, and names what it does log.

Which keys are checked when, following Lightning's own rules:

* at the end of the sanity check: every monitored key that names a validation figure (it starts
  with ``val``, as ``val/loss`` or ``val_loss`` do), of callbacks and schedulers alike;
* at the end of the first real validation (before the checkpoint callback, which Lightning runs
  last): every callback's key, since that is when ``ModelCheckpoint`` and a strict
  ``EarlyStopping`` would fail. Scheduler keys may name training figures that exist only once the
  first epoch ends; Lightning reports those itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from runkit.errors import RunError


class MonitoredKeysCheck(Callback):
    """Fail in one line when a monitor names a key the LightningModule does not log.

    Args:
        settings: for the one-line error, the config setting behind each kind of monitor, by
            class name (``"ModelCheckpoint"``, ``"EarlyStopping"``) or ``"scheduler"``; a kind
            not listed is named by its class.
    """

    def __init__(self, settings: Mapping[str, str] | None = None) -> None:
        self.settings = dict(settings or {})
        self._checked_validation = False

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(trainer, pl_module, lambda key, kind: key.startswith("val"))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self._checked_validation:
            return
        self._checked_validation = True
        self._check(trainer, pl_module, lambda key, kind: kind != "scheduler")

    def _check(self, trainer: Trainer, pl_module: LightningModule, applies: Any) -> None:
        logged = sorted(trainer.callback_metrics)
        for kind, key in _monitors(trainer):
            if key in logged or not applies(key, kind):
                continue
            setting = self.settings.get(kind, f"{kind}(monitor=...)")
            shown = ", ".join(logged) if logged else "nothing yet"
            raise RunError(
                f"{setting}={key!r} is not a key {type(pl_module).__name__} logs; it logs: "
                f"{shown}. Set {setting} to one of them (and its mode to min or max)"
            )


def _monitors(trainer: Trainer) -> Iterator[tuple[str, str]]:
    """(kind, key) of every monitor: callbacks with a ``monitor`` and schedulers with one."""
    for callback in trainer.callbacks:
        key = getattr(callback, "monitor", None)
        kind = _kind(callback)
        if isinstance(key, str) and (kind != "EarlyStopping" or getattr(callback, "strict", True)):
            yield kind, key
    for config in getattr(trainer, "lr_scheduler_configs", []):
        if isinstance(config.monitor, str) and getattr(config, "strict", True):
            yield "scheduler", config.monitor


def _kind(callback: Any) -> str:
    """The Lightning class a callback derives from (``ModelCheckpoint`` for a subclass)."""
    for cls in type(callback).__mro__:
        if cls.__module__.startswith("lightning.") and cls.__name__ != "Callback":
            return cls.__name__
    return type(callback).__name__
