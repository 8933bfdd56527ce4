"""Turn the composed config into the objects a run needs: callbacks, loggers, the Trainer.

Each config node with a ``_target_`` is instantiated as it stands, so a node maps one-to-one onto
the class it names and a user's own class drops in by changing ``_target_``.
"""

from __future__ import annotations

import logging
from typing import Any

from hydra.utils import instantiate
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf

import project.machinery.strategies  # noqa: F401  (registers trainer.strategy=dp before any Trainer)
from project.machinery.run import launch

log = logging.getLogger(__name__)


def build_callbacks(cfg: DictConfig | None) -> list[Callback]:
    """One callback per entry of ``cfg.callbacks`` (entries without a ``_target_`` are skipped)."""
    return [instantiate(node) for node in _target_nodes(cfg)]


def build_loggers(cfg: DictConfig | None) -> list[Logger]:
    """One logger per entry of ``cfg.logger``; an empty list means no logger."""
    return [instantiate(node) for node in _target_nodes(cfg)]


# The safety parts of a training run, each a config node like every other (configs/callbacks/,
# configs/trainer/default.yaml), and what a run loses when one is removed on purpose.
SAFETY_PARTS = (
    (
        "callbacks.resume_state removed",
        "project.machinery.safety.resume.ResumeState",
        "a resumed run will not restore the random state at each batch or carry on the "
        "earlier run's logs",
    ),
    (
        "callbacks.graceful_interrupt removed",
        "project.machinery.safety.interrupts.GracefulInterrupt",
        "Ctrl-C/SIGTERM will not save a checkpoint, and a DDP worker whose launching process "
        "dies waits in a collective until its timeout",
    ),
    (
        "trainer.plugins has no AtomicCheckpointIO",
        "project.machinery.safety.checkpoints.AtomicCheckpointIO",
        "checkpoint writes are not crash-safe: a kill or a full disk during a save can leave "
        "a half-written file",
    ),
)


def build_trainer(cfg: DictConfig, **overrides: Any) -> Trainer:
    """The Trainer of ``cfg.trainer`` with the run's callbacks and loggers.

    ``overrides`` replace trainer arguments the run decided on (the resolved devices, say);
    everything else reaches the Trainer exactly as configured, the safety parts included
    (:data:`SAFETY_PARTS`). A run that trains logs one line for each safety part it lacks.
    """
    from hydra.utils import get_object
    from lightning.pytorch.utilities import rank_zero_only

    from project.machinery.safety import interrupts

    callbacks = build_callbacks(cfg.get("callbacks"))
    loggers = build_loggers(cfg.get("logger"))
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, **overrides)
    parts = [*callbacks, trainer.strategy.checkpoint_io]
    missing = {
        key: lost
        for key, target, lost in SAFETY_PARTS
        if not any(isinstance(part, get_object(target)) for part in parts)
    }
    if not any(key.startswith("callbacks.graceful_interrupt") for key in missing):
        interrupts.watch_parent()  # part of that callback's job: a worker exits when rank 0 dies
    if cfg.get("train") and rank_zero_only.rank == 0:  # eval and test-only runs need none of them
        for key, lost in missing.items():
            log.warning("%s: %s", key, lost)
    launch.track(trainer)  # in a sweep, the job collects the DDP children this Trainer starts
    return trainer


def _target_nodes(group: DictConfig | None) -> list[DictConfig]:
    if not group:
        return []
    return [node for node in group.values() if isinstance(node, DictConfig) and "_target_" in node]


def plain(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain, resolved Python data (safe to store in a ``weights_only`` checkpoint)."""
    data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    assert isinstance(data, dict)
    return data
