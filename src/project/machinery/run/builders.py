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


def build_trainer(cfg: DictConfig, **overrides: Any) -> Trainer:
    """The Trainer of ``cfg.trainer`` with the run's callbacks and loggers.

    ``overrides`` replace trainer arguments the run decided on (the resolved devices, say);
    everything else reaches the Trainer exactly as configured.
    """
    from project.machinery.safety import checkpoints as checkpointing
    from project.machinery.safety import interrupts, resume

    loggers = build_loggers(cfg.get("logger"))
    # Always on: crash-safe checkpoint writes, exact resume, a checkpoint on Ctrl-C / SIGTERM.
    interrupts.watch_parent()
    plugins = overrides.pop("plugins", None) or instantiate(cfg.trainer.get("plugins"))
    safety = [resume.ResumeState(seed=int(cfg.get("seed") or 0)), interrupts.GracefulInterrupt()]
    trainer = instantiate(
        cfg.trainer,
        callbacks=build_callbacks(cfg.get("callbacks")) + safety,
        logger=loggers or False,
        plugins=checkpointing.with_atomic_io(plugins),
        **overrides,
    )
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
