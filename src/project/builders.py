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
    loggers = build_loggers(cfg.get("logger"))
    return instantiate(
        cfg.trainer,
        callbacks=build_callbacks(cfg.get("callbacks")),
        logger=loggers or False,
        **overrides,
    )


def _target_nodes(group: DictConfig | None) -> list[DictConfig]:
    if not group:
        return []
    return [node for node in group.values() if isinstance(node, DictConfig) and "_target_" in node]


def plain(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain, resolved Python data (safe to store in a ``weights_only`` checkpoint)."""
    data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    assert isinstance(data, dict)
    return data
