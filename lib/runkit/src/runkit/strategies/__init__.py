"""Importing this package registers ``dp`` in Lightning's ``StrategyRegistry``."""

from lightning.pytorch.strategies import StrategyRegistry

from runkit.strategies.dp import DataParallelStrategy

if "dp" not in StrategyRegistry:
    StrategyRegistry.register("dp", DataParallelStrategy, "DataParallel: one process, GPUs")

__all__ = ["DataParallelStrategy"]
