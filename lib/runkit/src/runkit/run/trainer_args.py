"""Every ``Trainer`` argument is a key of ``configs/trainer/lightning.yaml``: no ``+`` needed.
Keys still at these defaults are not passed, so a Lightning release that drops one breaks no run."""

from __future__ import annotations

from typing import Any

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
"""``Trainer.__init__``'s arguments and defaults (Lightning 2.6), less :data:`OWNED_ELSEWHERE`."""


def set_arguments(trainer: Any) -> dict[str, Any]:
    """The composed ``trainer`` node (resolved) less the keys still at Lightning's defaults."""
    from omegaconf import OmegaConf

    resolved = OmegaConf.to_container(trainer, resolve=True)
    return {
        key: value
        for key, value in resolved.items()
        if key not in TRAINER_DEFAULTS
        or (type(value), value) != (type(TRAINER_DEFAULTS[key]), TRAINER_DEFAULTS[key])
    }
