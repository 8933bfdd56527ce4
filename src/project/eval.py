"""Evaluate trained weights on the test split: a Lightning checkpoint, a model.pth or a run.

    python -m project.eval ckpt_path=logs/train/runs/<run>/checkpoints/epoch_012.ckpt
    python -m project.eval ckpt_path=logs/train/runs/<run>/model.pth
    python -m project.eval ckpt_path=logs/train/runs/<run>          # the weights it tested

The model (any LightningModule) and the data split are rebuilt from the config saved with the
run, so the figures match what training reported for the same weights; ``data.*`` overrides
(``data.batch_size=1``) apply. Results go to this run's ``metrics.json``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from project import config_dir
import runkit

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Test the weights at ``cfg.ckpt_path`` and return the test metrics."""
    import time
    from pathlib import Path

    import lightning.pytorch as pl
    from hydra.utils import instantiate
    from lightning.pytorch.utilities import rank_zero_only

    started, out = time.time(), Path(cfg.paths.output_dir)
    # A run directory stands for its model.pth: the weights whose test figures it reported.
    source = runkit.resolve_ckpt_path(
        cfg.ckpt_path, cfg.paths.log_dir, "train", tested_weights=True
    )
    assert source is not None  # ckpt_path is required (???) in eval.yaml

    # Rebuild the run's model and data from its own config (trusted _target_s only).
    data = runkit.load_file(source, mmap=True)
    trained = runkit.trained_config(cfg, source, data)
    pl.seed_everything(cfg.seed, workers=True)
    model, ckpt = runkit.trained_model(trained["model"], source, data)
    datamodule = instantiate(trained["data"], _convert_="all")  # plain containers, as in training
    plan = (
        runkit.resolve_for_run(  # least_used waits for and claims GPUs as in training (gpu_* keys)
            cfg.trainer.accelerator,
            cfg.trainer.devices,
            select=cfg.select_gpus,
            policy=runkit.policy_from_config(cfg),
        )
    )
    if plan.message:
        rank_zero_only(log.info)(plan.message)  # once, not once per DDP process
    # The same hardware settings as training (precision=auto -> bf16-mixed on a bf16 GPU...).
    trainer = runkit.build_trainer(cfg, **runkit.trainer_settings(cfg, plan))
    if trainer.is_global_zero:
        runkit.save_config(cfg, out)
    # Ctrl-C / SIGTERM: every rank stops, exit 128+N. A full disk (the CSV log): one line.
    if runkit.can_test(model, datamodule):  # else one line, and no figures
        with runkit.phase("eval", trainer), runkit.full_disk_in_one_line(out):
            trainer.test(model, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
    metrics = runkit.scalars(trainer.callback_metrics, prefix="test")
    if trainer.is_global_zero:
        runkit.save_metrics(
            metrics, out, best_checkpoint=None, trainer=trainer, started=started, evaluated=source
        )
        summary = ", ".join(f"{key}={value:.4f}" for key, value in metrics.items())
        log.info("Evaluated %s: %s", source, summary)
        log.info("Run directory: %s", out)
    return metrics


main = runkit.hydra_entry(evaluate, config_name="eval", config_dir=config_dir())

if __name__ == "__main__":
    main()
