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

from project.machinery.run.cli import hydra_entry

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

    from project.machinery import plots as plot
    from project.machinery import speed
    from project.machinery.gpu_stats.callback import energy_report
    from project.machinery.gpus.claims import policy_from_config
    from project.machinery.gpus.resolve import resolve_for_run
    from project.machinery.run import builders, launch, run_files
    from project.machinery.safety import checkpoints as checkpointing
    from project.machinery.safety import interrupts
    from project.machinery.safety.resume import check_fits

    started, out = time.time(), Path(cfg.paths.output_dir)
    resume = checkpointing.resolve_ckpt_path(cfg.ckpt_path, cfg.paths.log_dir, cfg.task_name)
    if resume is None and cfg.train:  # a requeued SLURM job continues from its own checkpoint
        resume = launch.requeued_checkpoint(out)

    # Check the GPUs: none means the CPU; with several, choose which (select_gpus).
    # least_used waits for GPUs that qualify (gpu_* keys) and claims them until the run ends.
    policy = policy_from_config(cfg)
    plan = resolve_for_run(
        cfg.trainer.accelerator, cfg.trainer.devices, select=cfg.select_gpus, policy=policy
    )
    if plan.message and rank_zero_only.rank == 0:  # once, not once per DDP process
        log.info(plan.message)
    # Fast defaults for that hardware: TF32 on Ampere+, precision=auto -> bf16-mixed on a bf16 GPU.
    trainer_kwargs = speed.trainer_settings(cfg, plan)

    # Build: the data, and the model (any LightningModule; the template's holds a network, model.net).
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    if cfg.train and resume is not None:
        check_fits(model, resume)  # the same model as the run it continues, else one line
    model.save_hyperparameters({"config": builders.plain(cfg)}, logger=False)
    trainer = builders.build_trainer(cfg, **trainer_kwargs)
    if trainer.is_global_zero:
        run_files.save_config(cfg, out)

    # Train, resuming from a checkpoint when asked. Ctrl-C / SIGTERM in any phase: every rank
    # stops at the same batch, fit saves and prints how to resume, the run exits with 128+signal.
    if cfg.train:
        with interrupts.phase("fit", trainer), checkpointing.full_disk_in_one_line(out):
            trainer.fit(model, datamodule=datamodule, ckpt_path=resume, weights_only=True)
    fit_metrics = run_files.scalars(trainer.callback_metrics)

    # Evaluate the best checkpoint on the test split (the weights in the model when none was kept).
    best = run_files.best_checkpoint(trainer)
    test_metrics: dict[str, float] = {}
    if cfg.test:
        with interrupts.phase("test", trainer), checkpointing.full_disk_in_one_line(out):
            trainer.test(model, datamodule=datamodule, ckpt_path=best, weights_only=True)
        test_metrics = run_files.scalars(trainer.callback_metrics, prefix="test")

    # Save the tested weights as model.pth (the network's, or the whole module's when it has no
    # `net`: checkpointing.exported_part) and the figures as metrics.json (rank 0 only).
    metrics = {**fit_metrics, **test_metrics}
    # A signal here: the files are written, then exit 128+N. A full disk: one line.
    with interrupts.phase("export"), checkpointing.full_disk_in_one_line(out):
        if trainer.is_global_zero:
            if cfg.export_weights:
                weights = checkpointing.exported_part(model)
                checkpointing.save_weights(weights, out / checkpointing.WEIGHTS_FILE)
            run_files.save_metrics(
                metrics,
                out,
                best_checkpoint=best,
                trainer=trainer,
                resumed_from=resume,
                started=started,
                energy=energy_report(trainer),  # GPU energy in J, kWh, J per training sample
            )
            plot.after_run(out)  # curves.png: learning curves, GPU use (needs matplotlib)
            log.info("Run directory: %s", out)
    return metrics


main = hydra_entry(train, config_name="train")

if __name__ == "__main__":
    main()
