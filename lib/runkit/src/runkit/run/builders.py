"""Turn the composed config into a run's callbacks, loggers and Trainer, one node per object;
the run's own record, ``<run>/csv/metrics.csv`` (read by plots and resume), is always kept."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

import runkit.strategies  # noqa: F401  (registers trainer.strategy=dp before any Trainer)
from runkit.errors import RunError
from runkit.run import launch

log = logging.getLogger(__name__)

# Every Trainer argument is a key of configs/trainer/lightning.yaml (no + needed) at these defaults,
# Trainer.__init__'s (Lightning 2.6) less OWNED_ELSEWHERE. Keys still at them are not passed, so a
# Lightning release that drops one breaks no run.
OWNED_ELSEWHERE = ("precision", "callbacks", "logger")

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "auto", "strategy": "auto", "devices": "auto", "num_nodes": 1,
    "fast_dev_run": False, "max_epochs": None, "min_epochs": None, "max_steps": -1,
    "min_steps": None, "max_time": None, "limit_train_batches": None, "limit_val_batches": None,
    "limit_test_batches": None, "limit_predict_batches": None, "overfit_batches": 0.0,
    "val_check_interval": None, "check_val_every_n_epoch": 1, "num_sanity_val_steps": None,
    "log_every_n_steps": None, "enable_checkpointing": None, "enable_progress_bar": None,
    "enable_model_summary": None, "accumulate_grad_batches": 1, "gradient_clip_val": None,
    "gradient_clip_algorithm": None, "deterministic": None, "benchmark": None,
    "inference_mode": True, "use_distributed_sampler": True, "profiler": None,
    "detect_anomaly": False, "barebones": False, "plugins": None, "sync_batchnorm": False,
    "reload_dataloaders_every_n_epochs": 0, "default_root_dir": None,
    "enable_autolog_hparams": True, "model_registry": None,
}  # fmt: skip


def set_arguments(trainer: Any) -> dict[str, Any]:
    """The composed ``trainer`` node (resolved) less the keys still at Lightning's defaults."""
    resolved = OmegaConf.to_container(trainer, resolve=True)
    return {
        key: value
        for key, value in resolved.items()
        if key not in TRAINER_DEFAULTS
        or (type(value), value) != (type(TRAINER_DEFAULTS[key]), TRAINER_DEFAULTS[key])
    }


# The safety parts of a training run and what a run loses without one.
SAFETY_PARTS = {
    "callbacks.resume_state removed": (
        "runkit.safety.resume.ResumeState",
        "a resumed run will not restore the random state at each batch or carry on the earlier "
        "run's logs",
    ),
    "callbacks.graceful_interrupt removed": (
        "runkit.safety.interrupts.GracefulInterrupt",
        "Ctrl-C/SIGTERM will not save a checkpoint, and a DDP worker whose launching process "
        "dies waits in a collective until its timeout",
    ),
    "trainer.plugins has no AtomicCheckpointIO": (
        "runkit.safety.checkpoints.AtomicCheckpointIO",
        "checkpoint writes are not crash-safe: a kill or a full disk during a save can leave a "
        "half-written file",
    ),
}


def _target_nodes(group: DictConfig | None) -> list[DictConfig]:
    nodes = group.values() if group else []
    return [node for node in nodes if isinstance(node, DictConfig) and "_target_" in node]


def build_trainer(cfg: DictConfig, **overrides: Any) -> Trainer:
    """The Trainer of ``cfg.trainer`` with the run's callbacks and loggers, ``overrides`` on top;
    a training run logs one line for each of :data:`SAFETY_PARTS` it lacks."""
    from hydra.utils import get_object

    from runkit.safety import interrupts

    callbacks = [instantiate(node) for node in _target_nodes(cfg.get("callbacks"))]
    if cfg.trainer.get("enable_model_summary") is None and any(
        isinstance(callback, ModelSummary) for callback in callbacks
    ):  # callbacks.model_summary is the summary; Lightning's would only say it skips itself
        overrides.setdefault("enable_model_summary", False)
    # the run's own record, csv/metrics.csv, unless a logger of cfg.logger writes that file
    out = OmegaConf.select(cfg, "paths.output_dir", default=None)
    record = Path(out, "csv").absolute() if out else None
    loggers = [instantiate(node) for node in _target_nodes(cfg.get("logger"))]

    def is_record(logger: Logger) -> bool:
        return isinstance(logger, CSVLogger) and Path(logger.log_dir).absolute() == record

    if record is not None and not any(map(is_record, loggers)):
        loggers.insert(0, CSVLogger(save_dir=str(out), name="csv", version=""))
    trainer = instantiate(
        set_arguments(cfg.trainer), callbacks=callbacks, logger=loggers or False, **overrides
    )
    if trainer.fast_dev_run and record is not None:
        # Lightning mutes every logger under fast_dev_run; the run's own record stays on.
        trainer.loggers = [logger for logger in loggers if is_record(logger)]
    parts = [*callbacks, trainer.strategy.checkpoint_io]
    missing = {
        key: lost
        for key, (target, lost) in SAFETY_PARTS.items()
        if not any(isinstance(part, get_object(target)) for part in parts)
    }
    if "callbacks.graceful_interrupt removed" not in missing:
        interrupts.watch_parent()  # part of that callback's job: a worker exits when rank 0 dies
    if cfg.get("train") and rank_zero_only.rank == 0:  # eval and test-only runs need none of them
        for key, lost in missing.items():
            log.warning("%s: %s", key, lost)
    launch.track(trainer)  # in a sweep, the job collects the DDP children this Trainer starts
    launch.join_restarted_group(trainer)  # torchrun --max-restarts: a group started again
    return trainer


def run_trainer(cfg: DictConfig, out: Path) -> Trainer:
    """:func:`build_trainer` on the GPUs ``cfg`` asks for; rank 0 saves ``config.yaml``."""
    from runkit.gpus.claims import policy_from_config
    from runkit.gpus.resolve import resolve_for_run
    from runkit.run.run_files import save_config
    from runkit.speed import trainer_settings

    plan = resolve_for_run(
        cfg.trainer.accelerator,
        cfg.trainer.devices,
        select=cfg.select_gpus,
        policy=policy_from_config(cfg),
    )
    if plan.message:
        rank_zero_only(log.info)(plan.message)  # once, not once per DDP process
    trainer = build_trainer(cfg, **trainer_settings(cfg, plan))
    if trainer.is_global_zero:
        save_config(cfg, out)
    return trainer


def plain(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain, resolved data (safe in a ``weights_only`` checkpoint)."""
    data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    assert isinstance(data, dict)
    return data


def can_test(model: Any, datamodule: Any = None, required: bool = False) -> bool:
    """Whether ``trainer.test`` can run on ``model``; else one line and ``False`` (a
    :class:`RunError` when testing is ``required``)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    name = type(model).__name__
    if not is_overridden("test_step", model):
        missing = f"{name} has no test_step"
    elif not any(
        p is not None and is_overridden("test_dataloader", p) for p in (model, datamodule)
    ):
        missing = f"neither {name} nor the data module has a test_dataloader"
    else:
        return True
    if required:
        raise RunError(
            f"{missing}, so there is nothing to evaluate; Lightning's trainer.test needs a "
            "test_step and a test_dataloader"
        )
    if rank_zero_only.rank == 0:
        log.info("No test phase: %s", missing)
    return False
