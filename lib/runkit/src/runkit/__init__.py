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
from typing import Any

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

__all__ = sorted(PUBLIC)


def __getattr__(name: str) -> Any:
    module = PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'runkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later reads find it here
    return value


def __dir__() -> list[str]:
    return [*__all__, "PUBLIC", "__version__"]
