"""lightning-runkit: everything a training run needs that is not the user's model, data or flow.

The public API, :data:`__all__`, is typed for checkers and loaded on first use: ``import runkit``
pulls in neither torch nor Lightning."""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path
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
    from runkit.run.predictions import load_trained, prepare_predict, trained_config, trained_model
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
    if name not in __all__:
        raise AttributeError(f"module 'runkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_modules()[name]), name)
    globals()[name] = value  # once: later reads find it here
    return value


@functools.cache
def _modules() -> dict[str, str]:
    # each public name's module, read from the imports for type checkers above: one list
    tree = ast.parse(Path(__file__).read_text("utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If))
    imports = [i for i in block.body if isinstance(i, ast.ImportFrom)]
    return {alias.name: str(i.module) for i in imports for alias in i.names}


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
