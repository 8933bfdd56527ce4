"""Train a model: check the GPUs, choose the devices, build the model, train, evaluate, save.

    python -m project.train                                   # the default run, shipped digits
    python -m project.train trainer.max_epochs=3 model.optimizer.lr=0.01
    python -m project.train trainer.devices=2                 # DDP: 2 GPUs, or 2 CPU processes
    python -m project.train -m model.optimizer.lr=0.01,0.001  # a sweep, one folder per job

Everything heavy is imported inside :func:`train`, so ``--help`` and ``--cfg job`` are instant.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from project import config_dir
import runkit

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run the whole flow for one composed config and return the final metrics."""
    import time
    from pathlib import Path

    import lightning.pytorch as pl
    from hydra.utils import instantiate
    from lightning.pytorch.utilities import rank_zero_only

    started, out = time.time(), Path(cfg.paths.output_dir)
    resume = runkit.resolve_ckpt_path(cfg.ckpt_path, cfg.paths.log_dir, cfg.task_name)
    if resume is None and cfg.train:  # a requeued SLURM job continues from its own checkpoint
        resume = runkit.requeued_checkpoint(out)

    # Check the GPUs: none means the CPU; with several, choose which (select_gpus).
    # least_used waits for GPUs that qualify (gpu_* keys) and claims them until the run ends.
    policy = runkit.policy_from_config(cfg)
    plan = runkit.resolve_for_run(
        cfg.trainer.accelerator, cfg.trainer.devices, select=cfg.select_gpus, policy=policy
    )
    if plan.message:
        rank_zero_only(log.info)(plan.message)  # once, not once per DDP process
    # Fast defaults for that hardware: TF32 on Ampere+, precision=auto -> bf16-mixed on a bf16 GPU.
    trainer_kwargs = runkit.trainer_settings(cfg, plan)

    # Build: the data, and the model (any LightningModule; the template's holds a network, model.net).
    pl.seed_everything(cfg.seed, workers=True)
    # _convert_="all": lists and dicts of the config reach the code as plain Python containers, so
    # checkpoints (save_hyperparameters) hold no OmegaConf objects that weights_only refuses.
    datamodule = instantiate(cfg.data, _convert_="all")
    model = instantiate(cfg.model, _convert_="all")
    if cfg.train and resume is not None:
        runkit.check_fits(model, resume)  # the same model as the run it continues, else one line
    model.save_hyperparameters({"config": runkit.plain(cfg)}, logger=False)
    trainer = runkit.build_trainer(cfg, **trainer_kwargs)
    if trainer.is_global_zero:
        runkit.save_config(cfg, out)

    # Train, resuming from a checkpoint when asked. Ctrl-C / SIGTERM in any phase: every rank
    # stops at the same batch, fit saves and prints how to resume, the run exits with 128+signal.
    if cfg.train:
        with runkit.phase("fit", trainer), runkit.full_disk_in_one_line(out):
            trainer.fit(model, datamodule=datamodule, ckpt_path=resume, weights_only=True)
    fit_metrics = runkit.scalars(trainer.callback_metrics)

    # Evaluate the best checkpoint on the test split (the weights in the model when none was kept).
    best = runkit.best_checkpoint(trainer)
    test_metrics: dict[str, float] = {}
    if cfg.test and runkit.can_test(model, datamodule):  # else one line; the run still exports
        with runkit.phase("test", trainer), runkit.full_disk_in_one_line(out):
            trainer.test(model, datamodule=datamodule, ckpt_path=best, weights_only=True)
        test_metrics = runkit.scalars(trainer.callback_metrics, prefix="test")

    # Save the tested weights as model.pth (the network's, or the whole module's when it has no
    # `net`: runkit.exported_part) and the figures as metrics.json (rank 0 only).
    metrics = {**fit_metrics, **test_metrics}
    # A signal here: the files are written, then exit 128+N. A full disk: one line.
    with runkit.phase("export"), runkit.full_disk_in_one_line(out):
        if cfg.export_weights and (trainer.is_global_zero or runkit.is_sharded(model)):
            # trainer=fsdp: every rank takes part in gathering the shards, rank 0 writes.
            runkit.save_weights(runkit.exported_part(model), out / runkit.WEIGHTS_FILE)
        if trainer.is_global_zero:
            runkit.save_metrics(
                metrics,
                out,
                best_checkpoint=best,
                trainer=trainer,
                resumed_from=resume,
                started=started,
                energy=runkit.energy_report(trainer),  # GPU energy in J, kWh, J per training sample
            )
            runkit.after_run(out)  # curves.png: learning curves, GPU use (needs matplotlib)
            log.info("Run directory: %s", out)
    return metrics


main = runkit.hydra_entry(train, config_name="train", config_dir=config_dir())

if __name__ == "__main__":
    main()
