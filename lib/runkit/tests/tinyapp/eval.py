"""``python -m tinyapp.eval ckpt_path=...`` and ``tinyapp.predict``: the template's two."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from tinyapp import config_dir
import runkit

log = logging.getLogger(__name__)


def evaluate(cfg: Any) -> dict[str, Any]:
    started, out = time.time(), Path(cfg.paths.output_dir)
    source, model, ckpt, datamodule = runkit.load_trained(cfg)
    runkit.can_test(model, datamodule, required=True)
    trainer = runkit.run_trainer(cfg, out)
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


def predict(cfg: Any) -> None:
    from lightning.pytorch.utilities import rank_zero_only

    out = Path(cfg.paths.output_dir)
    _, model, ckpt, datamodule = runkit.load_trained(cfg)
    rank_zero_only(log.info)(runkit.prepare_predict(model, datamodule))
    trainer = runkit.run_trainer(cfg, out)
    with runkit.phase("predict", trainer), runkit.full_disk_in_one_line(out):
        trainer.predict(model, datamodule=datamodule, ckpt_path=ckpt, return_predictions=False,
                        weights_only=True)  # fmt: skip
    if trainer.is_global_zero:
        log.info("Run directory: %s", out)


main = runkit.hydra_entry(evaluate, config_name="eval", config_dir=config_dir())
predict_main = runkit.hydra_entry(predict, config_name="predict", config_dir=config_dir())

if __name__ == "__main__":
    main()
