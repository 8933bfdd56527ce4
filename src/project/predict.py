"""Predict with trained weights: a Lightning checkpoint, a model.pth or a run.

    python -m project.predict ckpt_path=logs/train/runs/<run>               # the weights it tested
    python -m project.predict ckpt_path=logs/train/runs/<run>/model.pth data.batch_size=512
    python -m project.predict ckpt_path=logs/train/runs/<run> data=<another data config>

The model and data are rebuilt from the run's config as in eval (``data=`` / ``data.*`` choose
other data). It runs the module's ``predict_step`` (its forward when it has none) on the data
module's ``predict_dataloader`` (its test split when it has none) and writes ``predictions.pt``
(and ``predictions.csv`` for one value or class per item) in dataset order to this run's
directory, on one process or under DDP (``trainer.devices=2``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from project import config_dir
import runkit

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)


def predict(cfg: DictConfig) -> None:
    """Predict with the weights at ``cfg.ckpt_path``; the files go to the run directory."""
    from pathlib import Path

    from lightning.pytorch.utilities import rank_zero_only

    out = Path(cfg.paths.output_dir)
    # The run's model and data as eval rebuilds them, on the GPUs as training takes them.
    _, model, ckpt, datamodule = runkit.load_trained(cfg)
    # predict_step, or the forward; predict_dataloader, or the test split: which, in one line.
    rank_zero_only(log.info)(runkit.prepare_predict(model, datamodule))
    trainer = runkit.run_trainer(cfg, out)
    # callbacks.predictions writes the files. Ctrl-C / SIGTERM: every rank stops, exit 128+N.
    with runkit.phase("predict", trainer), runkit.full_disk_in_one_line(out):
        trainer.predict(
            model,
            datamodule=datamodule,
            ckpt_path=ckpt,
            return_predictions=False,
            weights_only=True,
        )
    if trainer.is_global_zero:
        log.info("Run directory: %s", out)


main = runkit.hydra_entry(predict, config_name="predict", config_dir=config_dir())

if __name__ == "__main__":
    main()
