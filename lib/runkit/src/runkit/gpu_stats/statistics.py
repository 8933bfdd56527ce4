"""The numbers behind the logged GPU keys: statistics per phase, the key scheme, the ``fit`` table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# metric -> statistics logged (mean and max unless listed); "last": the key is the metric's name,
# "frac": the mean of 0/1 readings.
METRIC_STATS: dict[str, tuple[str, ...]] = {
    "util": ("mean", "max", "min"), "sm_clock_mhz": ("mean", "min"),
    "mem_total_gib": ("last",), "ecc_uncorrected": ("last",),
    **dict.fromkeys(("throttle_power", "throttle_thermal", "throttle_hw", "throttle_any"), ("frac",)),
    **dict.fromkeys(("fp16_active", "fp32_active", "fp64_active"), ("mean",)),
}  # fmt: skip
# Per-GPU keys that also get min/mean/max across all GPUs of the run.
AGGREGATED = (
    *("util_mean", "mem_util_mean", "mem_used_gib_max", "proc_mem_gib_max", "torch_peak_alloc_gib"),
    *("temp_c_max", "power_w_mean", "sm_clock_mhz_mean", "throttle_any_frac", "energy_j"),
    *("sm_active_mean", "tensor_active_mean"),
)  # fmt: skip
# The run means the table shows, with their column titles: utilisation and the GPM figures.
WEIGHTED = {"util": "util %", "sm_active": "SM active %", "sm_occupancy": "occupancy %",
            "tensor_active": "tensor %", "dram_active": "DRAM bw %"}  # fmt: skip


class GpuAccumulator:
    """One GPU during one phase: per metric count, sum, min, max and last."""

    def __init__(self) -> None:
        self.stats: dict[str, list[float]] = {}
        self.energy_mj: float | None = None
        self.samples, self.seconds = 0, 0.0

    def add(self, values: dict[str, float], seconds: float) -> None:
        self.samples += 1
        self.seconds += seconds
        for metric, v in values.items():
            if (s := self.stats.get(metric)) is None:
                self.stats[metric] = [1, v, v, v, v]
            else:
                s[:] = s[0] + 1, s[1] + v, min(s[2], v), max(s[3], v), v

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for metric, (n, total, low, high, last) in self.stats.items():
            got = {"mean": total / n, "frac": total / n, "min": low, "max": high, "last": last}
            for which in METRIC_STATS.get(metric, ("mean", "max")):
                out[metric if which == "last" else f"{metric}_{which}"] = got[which]
        if self.energy_mj is not None:
            out["energy_j"] = self.energy_mj / 1000.0
        if self.samples:
            out |= {"samples": float(self.samples), "sample_ms": 1e3 * self.seconds / self.samples}
        return out


def flatten_epoch(
    payloads: Sequence[dict[str, Any]], root: str, log_cost: bool, per_gpu_keys_up_to: int = 8
) -> dict[str, float]:
    """Every rank's payload as the logged keys: per GPU for nodes with at most
    ``per_gpu_keys_up_to`` GPUs, ``{root}/all/`` aggregates for several GPUs."""
    per_node: dict[int, int] = {}
    for p in payloads:
        per_node[p["node"]] = per_node.get(p["node"], 0) + len(p.get("gpus", {}))
    logged: dict[str, float] = {}
    per_key: dict[str, list[float]] = {}
    energy: dict[str, float] = {}
    for p in payloads:
        node, boards = p["node"], p.get("boards", {})
        for label, summary in p.get("gpus", {}).items():
            for key, value in summary.items():
                if per_node[node] <= per_gpu_keys_up_to and (log_cost or key != "sample_ms"):
                    logged[f"{root}/node{node}/{label}/{key}"] = value
                if key in AGGREGATED:
                    per_key.setdefault(key, []).append(value)
            if "energy_j" in summary:
                energy.setdefault(boards.get(label, f"{node}/{label}"), summary["energy_j"])
    if sum(per_node.values()) > 1:
        for key, values in per_key.items():
            logged[f"{root}/all/{key}_min"] = min(values)
            logged[f"{root}/all/{key}_mean"] = sum(values) / len(values)
            logged[f"{root}/all/{key}_max"] = max(values)
        if energy:
            logged[f"{root}/all/energy_j_sum"] = sum(energy.values())
    return logged


def flatten_loop(loops: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """The waiting share of the rank that waited most, and the run's training samples per second."""
    present = [lp for lp in loops if lp and lp.get("loop_s", 0.0) > 0]
    if not present:
        return {}
    out = {"loop/data_wait_frac": max(lp["data_wait_s"] / lp["loop_s"] for lp in present)}
    if all("samples" in lp for lp in present):
        out["loop/samples_per_s"] = sum(lp["samples"] / lp["loop_s"] for lp in present)
    return out


class RunSummary:
    """Each GPU over a run's training epochs: means weighted by samples, peaks' max, energy's sum."""

    def __init__(self) -> None:
        self.epochs: dict[tuple[int, str], list[dict[str, float]]] = {}

    def add_epoch(self, everyone: Sequence[dict[str, Any]]) -> None:
        for p in everyone:
            for label, summary in p.get("gpus", {}).items():
                self.epochs.setdefault((p["node"], label), []).append(summary)

    def rows(self, identities: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        names = {(p["node"], g["label"]): g for p in identities for g in p.get("gpus", [])}
        rows = []
        for (node, label), epochs in sorted(self.epochs.items()):
            ident = names.get((node, label), {})
            row = {"gpu": f"node{node}/{label}", "name": ident.get("name", "?"),
                   "uuid": ident.get("uuid", "?"), "samples": int(sum(e.get("samples", 0) for e in epochs))}  # fmt: skip
            for key in ("sample_ms", *(f"{m}_mean" for m in WEIGHTED)):
                have = [(e[key], e.get("samples", 0.0)) for e in epochs if key in e]
                n = sum(w for _, w in have)
                row[key] = sum(v * w for v, w in have) / n if n else None
            for key, total in (("mem_used_gib_max", max), ("torch_peak_alloc_gib", max), ("energy_j", sum)):  # fmt: skip
                values = [e[key] for e in epochs if key in e]
                row[key] = total(values) if values else None
            rows.append(row)
        return rows


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    """:meth:`RunSummary.rows` as one Rich table; GPM columns only where a GPU had GPM."""
    from rich.console import Console
    from rich.table import Table

    def fmt(value: float | None, spec: str = ".1f") -> str:
        return "n/a" if value is None else format(value, spec)

    means = ["util", *(m for m in list(WEIGHTED)[1:] if any(r[f"{m}_mean"] is not None for r in rows))]  # fmt: skip
    table = Table(title="GPU statistics over the run (training epochs)")
    for column in ("GPU", "name", *(WEIGHTED[m] for m in means), "peak mem GiB",
                   "torch peak GiB", "energy kJ", "samples", "NVML ms/sample"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("GPU", "name") else "right")
    for row in rows:
        energy = None if row["energy_j"] is None else row["energy_j"] / 1000
        table.add_row(
            row["gpu"], row["name"], *(fmt(row[f"{m}_mean"]) for m in means),
            *(fmt(row[k], ".2f") for k in ("mem_used_gib_max", "torch_peak_alloc_gib")),
            fmt(energy, ".2f"), str(row["samples"]), fmt(row["sample_ms"], ".2f"),
        )  # fmt: skip
    console = Console()
    if not console.is_terminal:  # a log file, CI, a SLURM .out: no screen to fit, no wrapped rows
        unbounded = console.options.update(max_width=10_000)
        console = Console(
            width=max(console.width, console.measure(table, options=unbounded).maximum)
        )
    console.print(table)
