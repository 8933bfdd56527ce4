"""lightning-runkit: everything a training run needs that is not the user's model, data or flow.

The public API is :data:`__all__`, loaded on first use, so ``import runkit`` pulls in neither
torch nor Lightning and a project's ``--help`` stays instant. The components (callbacks, the
CheckpointIO, the strategy) are named by their modules in a project's configs. Grouped by job:
``gpus/`` (NVML, the inventory, device resolution, claims), ``gpu_stats/`` (per-epoch GPU
statistics), ``safety/`` (checkpoints, resume, interrupts, the finite-loss guard), ``run/`` (the
Hydra entry, preflight, builders, run files, launch), ``speed.py``, ``plots.py``, ``quoting.py``,
``strategies/`` (DP, FSDP), ``testing/`` (the fake NVML) and ``compat.py`` (every private API used,
each with a test). Nothing here imports a project's code; it arrives through ``_target_``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as a type checker sees them; at run time, loaded on first use
    from runkit.data import ArrayDataModule
    from runkit.errors import RunError
    from runkit.gpu_stats.callback import energy_report
    from runkit.gpus.claims import policy_from_config
    from runkit.gpus.resolve import resolve_for_run
    from runkit.plots import after_run
    from runkit.run.builders import build_trainer, can_test, plain, run_trainer
    from runkit.run.cli import find_configs, hydra_entry
    from runkit.run.launch import requeued_checkpoint
    from runkit.run.predictions import prepare_predict
    from runkit.run.rebuild import load_trained, trained_config, trained_model
    from runkit.run.run_files import best_checkpoint, save_config, save_metrics, scalars
    from runkit.safety.checkpoints import (
        WEIGHTS_FILE,
        exported_part,
        full_disk_in_one_line,
        is_sharded,
        load_file,
        load_network,
        resolve_ckpt_path,
        save_weights,
    )
    from runkit.safety.interrupts import phase
    from runkit.safety.resume import check_fits
    from runkit.safety.trusted import TRUSTED_TARGETS
    from runkit.speed import trainer_settings

__version__ = "0.1.0"

PUBLIC: dict[str, str] = {
    # the Hydra entry and where a project's configs are
    "hydra_entry": "runkit.run.cli",
    "find_configs": "runkit.run.cli",
    "RunError": "runkit.errors",
    # check the GPUs, choose them, claim them
    "policy_from_config": "runkit.gpus.claims",
    "resolve_for_run": "runkit.gpus.resolve",
    "trainer_settings": "runkit.speed",
    # build
    "build_trainer": "runkit.run.builders",
    "plain": "runkit.run.builders",
    "can_test": "runkit.run.builders",
    "run_trainer": "runkit.run.builders",
    "ArrayDataModule": "runkit.data",
    # train, resume, stop
    "resolve_ckpt_path": "runkit.safety.checkpoints",
    "load_file": "runkit.safety.checkpoints",
    "requeued_checkpoint": "runkit.run.launch",
    "check_fits": "runkit.safety.resume",
    "phase": "runkit.safety.interrupts",
    "full_disk_in_one_line": "runkit.safety.checkpoints",
    # save and restore
    "WEIGHTS_FILE": "runkit.safety.checkpoints",
    "exported_part": "runkit.safety.checkpoints",
    "save_weights": "runkit.safety.checkpoints",
    "is_sharded": "runkit.safety.checkpoints",
    "load_network": "runkit.safety.checkpoints",
    "TRUSTED_TARGETS": "runkit.safety.trusted",
    "load_trained": "runkit.run.rebuild",
    "trained_config": "runkit.run.rebuild",
    "trained_model": "runkit.run.rebuild",
    "prepare_predict": "runkit.run.predictions",
    # what a run leaves
    "save_config": "runkit.run.run_files",
    "save_metrics": "runkit.run.run_files",
    "scalars": "runkit.run.run_files",
    "best_checkpoint": "runkit.run.run_files",
    "energy_report": "runkit.gpu_stats.callback",
    "after_run": "runkit.plots",
}
"""Each public name and the module that defines it."""

__all__ = [
    "TRUSTED_TARGETS",
    "WEIGHTS_FILE",
    "ArrayDataModule",
    "RunError",
    "after_run",
    "best_checkpoint",
    "build_trainer",
    "can_test",
    "check_fits",
    "energy_report",
    "exported_part",
    "find_configs",
    "full_disk_in_one_line",
    "hydra_entry",
    "is_sharded",
    "load_file",
    "load_network",
    "load_trained",
    "phase",
    "plain",
    "policy_from_config",
    "prepare_predict",
    "requeued_checkpoint",
    "resolve_ckpt_path",
    "resolve_for_run",
    "run_trainer",
    "save_config",
    "save_metrics",
    "save_weights",
    "scalars",
    "trained_config",
    "trained_model",
    "trainer_settings",
]


def __getattr__(name: str) -> Any:
    module = PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'runkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later reads find it here
    return value


def __dir__() -> list[str]:
    return [*__all__, "PUBLIC", "__version__"]
