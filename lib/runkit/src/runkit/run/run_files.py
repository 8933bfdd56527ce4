"""What a run leaves in its directory besides checkpoints and logs: ``config.yaml`` (resolved)
and ``metrics.json`` (final figures, the best checkpoint and its score, the run's size)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning_utilities import apply_to_collection
from omegaconf import DictConfig, OmegaConf

from runkit.safety.checkpoints import CONFIG_FILE
from runkit.safety.writes import atomic_write

METRICS_FILE = "metrics.json"


def save_config(cfg: DictConfig, out: Path) -> Path:
    return atomic_write(out / CONFIG_FILE, OmegaConf.to_yaml(cfg, resolve=True))


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Logged metrics as plain floats (one host sync, at the end), optionally one stage's only."""
    return {
        key: float(value)
        for key, value in sorted(metrics.items())
        if key.startswith(prefix) and getattr(value, "numel", lambda: 1)() == 1
    }


def best_checkpoint(trainer: Trainer) -> str | None:
    """The best checkpoint the ModelCheckpoint callback kept, if it kept one."""
    return getattr(trainer.checkpoint_callback, "best_model_path", "") or None


def save_metrics(
    metrics: Mapping[str, float],
    out: Path,
    best_checkpoint: str | None,
    trainer: Trainer,
    resumed_from: str | Path | None = None,
    *,
    started: float,
    energy: Mapping[str, Any] | None = None,
    evaluated: str | Path | None = None,
) -> Path:
    """Write ``metrics.json``: the figures, where they came from (``resumed_from``, or the weights
    an eval ``evaluated``), the time since ``started`` and the GPUs' ``energy``."""
    callback = trainer.checkpoint_callback
    score = getattr(callback, "best_model_score", None) if best_checkpoint else None
    training = {
        "best_checkpoint": best_checkpoint,
        # what the best was kept by, and that best (sweep summaries read it); none without one
        "monitor": getattr(callback, "monitor", None) if best_checkpoint else None,
        "best_score": float(score) if score is not None else None,
        "resumed_from": str(resumed_from) if resumed_from is not None else None,
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
    }
    payload = {
        "metrics": dict(metrics),
        **({"evaluated": str(evaluated)} if evaluated is not None else training),
        "accelerator": type(trainer.accelerator).__name__,
        "devices": trainer.num_devices,
        "num_nodes": trainer.num_nodes,
        "wall_seconds": round(time.time() - started, 2),
        **({"energy": dict(energy)} if energy is not None else {}),
    }
    return atomic_write(out / METRICS_FILE, strict_json(payload, indent=2) + "\n")


def strict_json(payload: Any, **kwargs: Any) -> str:
    """JSON that strict parsers read: a NaN or infinite figure is ``null``, not ``NaN``."""
    finite = apply_to_collection(payload, float, lambda v: v if math.isfinite(v) else None)
    return json.dumps(finite, allow_nan=False, **kwargs)
