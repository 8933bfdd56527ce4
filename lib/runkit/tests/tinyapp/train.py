"""``python -m tinyapp.train``: the template's train.py, the same calls in the same order."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from tinyapp import config_dir
import runkit

log = logging.getLogger(__name__)


def train(cfg: Any) -> dict[str, Any]:
    import lightning.pytorch as pl
    from hydra.utils import instantiate
    from lightning.pytorch.utilities import rank_zero_only

    started, out = time.time(), Path(cfg.paths.output_dir)
    resume = runkit.resolve_ckpt_path(cfg.ckpt_path, cfg.paths.log_dir, cfg.task_name)
    if resume is None and cfg.train:
        resume = runkit.requeued_checkpoint(out)
    policy = runkit.policy_from_config(cfg)
    plan = runkit.resolve_for_run(
        cfg.trainer.accelerator, cfg.trainer.devices, select=cfg.select_gpus, policy=policy
    )
    if plan.message:
        rank_zero_only(log.info)(plan.message)
    trainer_kwargs = runkit.trainer_settings(cfg, plan)
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data, _convert_="all")
    model = instantiate(cfg.model, _convert_="all")
    if cfg.train and resume is not None:
        runkit.check_fits(model, resume)
    model.save_hyperparameters({"config": runkit.plain(cfg)}, logger=False)
    trainer = runkit.build_trainer(cfg, **trainer_kwargs)
    if trainer.is_global_zero:
        runkit.save_config(cfg, out)
    if cfg.train:
        with runkit.phase("fit", trainer), runkit.full_disk_in_one_line(out):
            trainer.fit(model, datamodule=datamodule, ckpt_path=resume, weights_only=True)
    fit_metrics = runkit.scalars(trainer.callback_metrics)
    best = runkit.best_checkpoint(trainer)
    test_metrics: dict[str, float] = {}
    if cfg.test and runkit.can_test(model, datamodule):
        with runkit.phase("test", trainer), runkit.full_disk_in_one_line(out):
            trainer.test(model, datamodule=datamodule, ckpt_path=best, weights_only=True)
        test_metrics = runkit.scalars(trainer.callback_metrics, prefix="test")
    metrics = {**fit_metrics, **test_metrics}
    with runkit.phase("export"), runkit.full_disk_in_one_line(out):
        if cfg.export_weights and (trainer.is_global_zero or runkit.is_sharded(model)):
            runkit.save_weights(runkit.exported_part(model), out / runkit.WEIGHTS_FILE)
        if trainer.is_global_zero:
            runkit.save_metrics(metrics, out, best_checkpoint=best, trainer=trainer,
                                resumed_from=resume, started=started,
                                energy=runkit.energy_report(trainer))  # fmt: skip
            runkit.after_run(out)
            log.info("Run directory: %s", out)
    return metrics


main = runkit.hydra_entry(train, config_name="train", config_dir=config_dir())

if __name__ == "__main__":
    main()
