"""The numbers behind the logged GPU keys: running statistics per phase, the flat key scheme and
the end-of-``fit`` report. Pure bookkeeping: no NVML, no torch, no threads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MEAN_MAX = ("mean", "max")
# metric -> statistics logged (MEAN_MAX unless listed). "last": the key is the metric name;
# "frac": the mean of 0/1 readings.
METRIC_STATS: dict[str, tuple[str, ...]] = {
    "util": ("mean", "max", "min"),
    "mem_total_gib": ("last",),
    "sm_clock_mhz": ("mean", "min"),
    **dict.fromkeys(("throttle_power", "throttle_thermal", "throttle_hw", "throttle_any"), ("frac",)),
    "ecc_uncorrected": ("last",),
    **dict.fromkeys(("fp16_active", "fp32_active", "fp64_active"), ("mean",)),
}  # fmt: skip
# Per-GPU keys that also get min/mean/max across all GPUs of the run.
AGGREGATED = (
    *("util_mean", "mem_util_mean", "mem_used_gib_max", "proc_mem_gib_max", "torch_peak_alloc_gib"),
    *("temp_c_max", "power_w_mean", "sm_clock_mhz_mean", "throttle_any_frac", "energy_j"),
    *("sm_active_mean", "tensor_active_mean"),
)  # fmt: skip
# Metrics whose run mean the table shows: utilisation and the GPM figures (gpm.py).
WEIGHTED = ("util", "sm_active", "sm_occupancy", "tensor_active", "dram_active")


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
        self.low, self.high, self.last = min(self.low, value), max(self.high, value), value

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
        """Flat ``{key: value}`` of the phase (no prefix)."""
        out: dict[str, float] = {}
        for metric, stat in self.stats.items():
            for which in METRIC_STATS.get(metric, MEAN_MAX):
                out[metric if which == "last" else f"{metric}_{which}"] = stat.get(which)
        if self.energy_mj is not None:
            out["energy_j"] = self.energy_mj / 1000.0
        if self.samples:
            out["samples"] = float(self.samples)
            out["sample_ms"] = 1000.0 * self.sample_seconds / self.samples
        return out


def flatten_epoch(
    payloads: Sequence[dict[str, Any]], root: str, log_cost: bool, per_gpu_keys_up_to: int = 8
) -> dict[str, float]:
    """Every rank's ``{"node", "gpus": {label: summary}, "boards": {label: uuid}}`` as the logged
    keys: per GPU for nodes with at most ``per_gpu_keys_up_to`` GPUs; ``{root}/all/`` min, mean
    and max only for a run of several GPUs; ``energy_j_sum`` counts each physical GPU once."""
    per_node: dict[int, int] = {}
    for payload in payloads:
        per_node[payload["node"]] = per_node.get(payload["node"], 0) + len(payload.get("gpus", {}))
    logged: dict[str, float] = {}
    per_key: dict[str, list[float]] = {}
    energy_by_board: dict[str, float] = {}
    for payload in payloads:
        node, boards = payload["node"], payload.get("boards", {})
        for label, summary in payload.get("gpus", {}).items():
            for key, value in summary.items():
                if key == "sample_ms" and not log_cost:
                    continue
                if per_node[node] <= per_gpu_keys_up_to:
                    logged[f"{root}/node{node}/{label}/{key}"] = value
                if key in AGGREGATED:
                    per_key.setdefault(key, []).append(value)
            if "energy_j" in summary:
                energy_by_board.setdefault(
                    boards.get(label, f"{node}/{label}"), summary["energy_j"]
                )
    if sum(per_node.values()) > 1:
        for key, values in per_key.items():
            logged[f"{root}/all/{key}_min"] = min(values)
            logged[f"{root}/all/{key}_mean"] = sum(values) / len(values)
            logged[f"{root}/all/{key}_max"] = max(values)
        if energy_by_board:
            logged[f"{root}/all/energy_j_sum"] = sum(energy_by_board.values())
    return logged


def flatten_loop(loops: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """``loop/data_wait_frac``: the waiting share of the rank that waited most (the others wait
    for it); ``loop/samples_per_s``: training samples per second of the whole run."""
    present = [loop for loop in loops if loop and loop.get("loop_s", 0.0) > 0]
    if not present:
        return {}
    out = {"loop/data_wait_frac": max(lp["data_wait_s"] / lp["loop_s"] for lp in present)}
    if all("samples" in lp for lp in present):
        out["loop/samples_per_s"] = sum(lp["samples"] / lp["loop_s"] for lp in present)
    return out


class RunSummary:
    """Each GPU over the training epochs of a run: epoch means weighted by their samples, the
    peaks' maximum, the energy's sum."""

    def __init__(self) -> None:
        self._runs: dict[tuple[int, str], dict[str, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._runs)

    def add_epoch(self, everyone: Sequence[dict[str, Any]]) -> None:
        for payload in everyone:
            for label, summary in payload.get("gpus", {}).items():
                run = self._runs.setdefault((payload["node"], label), {})
                n = summary.get("samples", 0.0)
                for m in (*WEIGHTED, "sample"):
                    key = "sample_ms" if m == "sample" else f"{m}_mean"
                    if key in summary:
                        run[f"{m}_weighted"] = run.get(f"{m}_weighted", 0.0) + summary[key] * n
                        run[f"{m}_samples"] = run.get(f"{m}_samples", 0.0) + n
                for key in ("mem_used_gib_max", "torch_peak_alloc_gib"):
                    if key in summary:
                        run[key] = max(run.get(key, 0.0), summary[key])
                if "energy_j" in summary:
                    run["energy_j"] = run.get("energy_j", 0.0) + summary["energy_j"]
                run["samples"] = run.get("samples", 0.0) + n

    def rows(self, identities: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """One row per GPU; ``identities`` are every rank's setup reports (names, UUIDs)."""
        names = {(p["node"], g["label"]): g for p in identities for g in p.get("gpus", [])}
        rows = []
        for (node, label), run in sorted(self._runs.items()):
            ident = names.get((node, label), {})
            means = {}
            for m in (*WEIGHTED, "sample"):
                n = run.get(f"{m}_samples")
                means["sample_ms" if m == "sample" else f"{m}_mean"] = (
                    run[f"{m}_weighted"] / n if n else None
                )
            rows.append(
                {
                    "gpu": f"node{node}/{label}",
                    "name": ident.get("name", "?"),
                    "uuid": ident.get("uuid", "?"),
                    **means,
                    "mem_used_gib_max": run.get("mem_used_gib_max"),
                    "torch_peak_alloc_gib": run.get("torch_peak_alloc_gib"),
                    "energy_j": run.get("energy_j"),
                    "samples": int(run["samples"]),
                }
            )
        return rows


GPM_COLUMNS = {
    "sm_active": "SM active %",
    "sm_occupancy": "occupancy %",
    "tensor_active": "tensor %",
    "dram_active": "DRAM bw %",
}


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    """Print :meth:`RunSummary.rows` as one Rich table; GPM columns only where a GPU had GPM."""
    from rich.console import Console
    from rich.table import Table

    def fmt(value: float | None, spec: str = ".1f") -> str:
        return "n/a" if value is None else format(value, spec)

    gpm = [m for m in GPM_COLUMNS if any(row.get(f"{m}_mean") is not None for row in rows)]
    table = Table(title="GPU statistics over the run (training epochs)")
    table.add_column("GPU")
    table.add_column("name")
    for column in ("util %", *(GPM_COLUMNS[m] for m in gpm), "peak mem GiB", "torch peak GiB",
                   "energy kJ", "samples", "NVML ms/sample"):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        energy = None if row["energy_j"] is None else row["energy_j"] / 1000
        table.add_row(
            row["gpu"],
            row["name"],
            *(fmt(row.get(f"{metric}_mean")) for metric in ("util", *gpm)),
            *(fmt(row[k], ".2f") for k in ("mem_used_gib_max", "torch_peak_alloc_gib")),
            fmt(energy, ".2f"),
            str(row["samples"]),
            fmt(row["sample_ms"], ".2f"),
        )
    console = Console()
    if not console.is_terminal:  # a log file, CI, a SLURM .out: no screen to fit, no wrapped rows
        unbounded = console.options.update(max_width=10_000)
        console = Console(
            width=max(console.width, console.measure(table, options=unbounded).maximum)
        )
    console.print(table)
