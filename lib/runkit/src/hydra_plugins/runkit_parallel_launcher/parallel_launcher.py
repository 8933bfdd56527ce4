"""Hydra finds launchers only in its ``hydra_plugins`` namespace: ``runkit_parallel`` is
:class:`runkit.run.sweep.ParallelLauncher` (importing it registers its config)."""

from runkit.run import sweep


class RunkitParallelLauncher(sweep.ParallelLauncher):
    """``hydra/launcher=runkit_parallel``."""
