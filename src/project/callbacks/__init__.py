"""Lightning callbacks of the template.

Kept import-light on purpose: ``import project.callbacks`` pulls in neither torch nor Lightning.
Hydra configs name the full path (``project.callbacks.gpu_stats.GpuStatsMonitor``); the
attribute below is resolved only when someone asks for it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GpuStatsMonitor"]


def __getattr__(name: str) -> Any:
    if name == "GpuStatsMonitor":
        from project.callbacks.gpu_stats import GpuStatsMonitor

        return GpuStatsMonitor
    raise AttributeError(f"module 'project.callbacks' has no attribute {name!r}")
