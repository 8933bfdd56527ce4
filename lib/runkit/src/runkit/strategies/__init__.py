"""Training strategies the Trainer finds by name (``trainer.strategy=...``).

Importing this package registers them in Lightning's ``StrategyRegistry``; preflight and the
Trainer builder import it, so ``trainer.strategy=dp`` works from the command line.
"""

from lightning.pytorch.strategies import StrategyRegistry

from runkit.strategies.dp import DataParallelStrategy

DataParallelStrategy.register_strategies(StrategyRegistry)

__all__ = ["DataParallelStrategy"]
