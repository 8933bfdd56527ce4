"""lightning-runkit: everything a training run needs that is not the user's model, data or flow.

The public API is what this module names (``runkit.hydra_entry``, ``runkit.resolve_for_run``,
...; :data:`PUBLIC`), loaded on first use: ``import runkit`` pulls in neither torch nor
Lightning, so a project's ``--help`` stays instant. The components (callbacks, the CheckpointIO,
the strategy) are named by their modules in a project's configs. The rest is private: a project
imports nothing else (an import-linter contract checks the template's).

Grouped by job, one job per file; nothing here imports a project's code (it arrives through
``_target_`` in the configs).

=============  ==================================================================================
gpus/          NVML access, the GPU inventory, ``CUDA_VISIBLE_DEVICES`` rules, device resolution,
               the listing CLI
gpu_stats/     per-epoch GPU statistics: sampling, statistics, the callback, the run summary
safety/        crash-safe checkpoint I/O and loading, exact resume, interrupts, the finite-loss
               guard, the checkpoint callback
run/           the Hydra entry, preflight checks, builders, run files, sweep/DDP launch
speed.py       the GPU speed switches (TF32, precision=auto, compile, channels-last)
plots.py       ``curves.png`` and ``python -m runkit.plot``
quoting.py     what the program prints for the user to paste, quoted for the shell and Hydra
strategies/    ``trainer.strategy=dp``
testing/       the fake NVML used by tests, benchmarks and CPU demos
compat.py      every access to a private Lightning/torch/OmegaConf/Hydra API, each with a test
=============  ==================================================================================
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
