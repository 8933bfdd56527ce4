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

    started, out = time.time(), Path(cfg.paths.output_dir)
    # The run's model and data, rebuilt from its own config (trusted _target_s only); a run
    # directory stands for its model.pth, the weights whose test figures it reported.
    source, model, ckpt, datamodule = runkit.load_trained(cfg)
    runkit.can_test(model, datamodule, required=True)  # else one line: nothing to evaluate
    # The GPUs as training takes them (least_used waits and claims), its hardware settings.
    trainer = runkit.run_trainer(cfg, out)
    # Ctrl-C / SIGTERM: every rank stops, exit 128+N. A full disk (the CSV log): one line.
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
