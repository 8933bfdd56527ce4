"""The numbers behind the logged GPU keys: running statistics per phase, and the flat key scheme.

Pure bookkeeping: no NVML, no torch, no threads. The keys are described in
:mod:`runkit.gpu_stats.callback`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# metric -> statistics logged for it. "last": the key is the metric name; "frac": mean of 0/1.
METRIC_STATS: dict[str, tuple[str, ...]] = {
    "util": ("mean", "max", "min"),
    "mem_util": ("mean", "max"),
    "mem_used_gib": ("mean", "max"),
    "mem_total_gib": ("last",),
    "proc_mem_gib": ("mean", "max"),
    "temp_c": ("mean", "max"),
    "power_w": ("mean", "max"),
    "power_ratio": ("mean", "max"),
    "sm_clock_mhz": ("mean", "min"),
    "throttle_power": ("frac",),
    "throttle_thermal": ("frac",),
    "throttle_hw": ("frac",),
    "throttle_any": ("frac",),
    "fan_pct": ("mean", "max"),
    "pcie_tx_mbs": ("mean", "max"),
    "pcie_rx_mbs": ("mean", "max"),
    "ecc_uncorrected": ("last",),
    "mem_temp_c": ("mean", "max"),
    # GPM (percent of the interval between two samples; see gpm.py)
    "sm_active": ("mean", "max"),
    "sm_occupancy": ("mean", "max"),
    "tensor_active": ("mean", "max"),
    "dram_active": ("mean", "max"),
    "fp16_active": ("mean",),
    "fp32_active": ("mean",),
    "fp64_active": ("mean",),
}
# Per-GPU keys that also get min/mean/max across all GPUs of the run.
AGGREGATED = (
    "util_mean",
    "mem_util_mean",
    "mem_used_gib_max",
    "proc_mem_gib_max",
    "torch_peak_alloc_gib",
    "temp_c_max",
    "power_w_mean",
    "sm_clock_mhz_mean",
    "throttle_any_frac",
    "energy_j",
    "sm_active_mean",
    "tensor_active_mean",
)


@dataclass
class RunningStat:
    """Count, sum, min, max and last value of a stream: O(1) memory however long the epoch."""

    count: int = 0
    total: float = 0.0
    low: float = float("inf")
    high: float = float("-inf")
    last: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.low = min(self.low, value)
        self.high = max(self.high, value)
        self.last = value

    def get(self, stat: str) -> float:
        if stat in ("mean", "frac"):
            return self.total / self.count
        return {"max": self.high, "min": self.low, "last": self.last}[stat]


@dataclass
class GpuAccumulator:
    """What one GPU did during one phase (a training epoch or a validation run)."""

    stats: dict[str, RunningStat] = field(default_factory=dict)
    energy_mj: float | None = None
    samples: int = 0
    sample_seconds: float = 0.0

    def add(self, values: dict[str, float], seconds: float) -> None:
        self.samples += 1
        self.sample_seconds += seconds
        for metric, value in values.items():
            self.stats.setdefault(metric, RunningStat()).add(value)

    def add_energy(self, delta_mj: float) -> None:
        self.energy_mj = (self.energy_mj or 0.0) + delta_mj

    def summary(self) -> dict[str, float]:
        """Flat ``{key: value}`` of the phase, keys as in the callback's docstring (no prefix)."""
        out: dict[str, float] = {}
        for metric, stat in self.stats.items():
            for which in METRIC_STATS.get(metric, ("mean",)):
                key = metric if which == "last" else f"{metric}_{which}"
                out[key] = stat.get(which)
        if self.energy_mj is not None:
            out["energy_j"] = self.energy_mj / 1000.0
        if self.samples:
            out["samples"] = float(self.samples)
            out["sample_ms"] = 1000.0 * self.sample_seconds / self.samples
        return out


def flatten_epoch(
    payloads: Sequence[dict[str, Any]],
    root: str,
    log_cost: bool,
    per_gpu_keys_up_to: int | None = None,
) -> dict[str, float]:
    """Turn every rank's ``{"node", "gpus": {label: summary}, "boards": {label: uuid}}`` into the
    logged keys.

    Per-GPU keys for each node with at most ``per_gpu_keys_up_to`` GPUs (``None``: every node);
    ``{root}/all/`` min/mean/max across GPUs only when the run has more than one GPU (with one,
    they would repeat its own keys). ``{root}/all/energy_j_sum`` counts each physical GPU once,
    however many of its MIG slices the run uses (a slice reports its whole GPU's energy).
    """
    logged: dict[str, float] = {}
    per_key: dict[str, list[float]] = {}
    per_node: dict[int, int] = {}
    for payload in payloads:
        node = payload["node"]
        per_node[node] = per_node.get(node, 0) + len(payload.get("gpus", {}))
    gpu_count = sum(per_node.values())
    energy_by_board: dict[str, float] = {}
    for payload in payloads:
        node = payload["node"]
        detailed = per_gpu_keys_up_to is None or per_node[node] <= per_gpu_keys_up_to
        boards = payload.get("boards", {})
        for label, summary in payload.get("gpus", {}).items():
            prefix = f"{root}/node{node}/{label}/"
            for key, value in summary.items():
                if key == "sample_ms" and not log_cost:
                    continue
                if detailed:
                    logged[prefix + key] = value
                if key in AGGREGATED:
                    per_key.setdefault(key, []).append(value)
            if "energy_j" in summary:
                board = boards.get(label, f"node{node}/{label}")
                energy_by_board.setdefault(board, summary["energy_j"])
    if gpu_count > 1:
        for key, values in per_key.items():
            logged[f"{root}/all/{key}_min"] = min(values)
            logged[f"{root}/all/{key}_mean"] = sum(values) / len(values)
            logged[f"{root}/all/{key}_max"] = max(values)
        if energy_by_board:
            logged[f"{root}/all/energy_j_sum"] = sum(energy_by_board.values())
    return logged


def flatten_loop(loops: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """Every rank's training-loop figures of an epoch as ``loop/`` keys.

    ``loop/data_wait_frac``: the share of the loop's time spent waiting for the next batch, of the
    rank that waited most (under DDP the others wait for it); ``loop/samples_per_s``: training
    samples per second of the whole run (every rank's sum).
    """
    present = [loop for loop in loops if loop and loop.get("loop_s", 0.0) > 0]
    if not present:
        return {}
    out = {"loop/data_wait_frac": max(lp["data_wait_s"] / lp["loop_s"] for lp in present)}
    if all("samples" in lp for lp in present):
        out["loop/samples_per_s"] = sum(lp["samples"] / lp["loop_s"] for lp in present)
    return out
