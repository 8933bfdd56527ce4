"""A PyTorch Lightning + Hydra project: your models, data, configs and the flow that runs them.

The machinery (GPUs, checkpoints, signals, the Hydra entry) is the ``lightning-runkit`` library,
imported lazily so that ``python -m project.train --help`` stays fast.
"""

from pathlib import Path

__version__ = "0.1.0"


def config_dir() -> Path:
    """This project's configs: ``configs/`` of a clone, or the copy inside an installed wheel
    (``PROJECT_CONFIG_DIR`` points elsewhere)."""
    from runkit import find_configs

    return find_configs(__file__, env_var="PROJECT_CONFIG_DIR")
