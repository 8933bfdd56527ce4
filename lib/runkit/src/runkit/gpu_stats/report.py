"""The end-of-``fit`` GPU report: each GPU over the whole run, as rows and as one Rich table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Metrics whose run mean the table shows: utilisation and the GPM figures (gpm.py).
WEIGHTED = ("util", "sm_active", "sm_occupancy", "tensor_active", "dram_active")


class RunSummary:
    """What each GPU did over the training epochs of a run, from the gathered epoch figures:
    epoch means weighted by their samples, the peaks' maximum, the energy's sum."""

    def __init__(self) -> None:
        self._runs: dict[tuple[int, str], dict[str, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._runs)

    def add_epoch(self, everyone: Sequence[dict[str, Any]]) -> None:
        """Fold one training epoch (every rank's ``{"node", "gpus": {label: summary}}``) in."""
        for payload in everyone:
            for label, summary in payload.get("gpus", {}).items():
                run = self._runs.setdefault((payload["node"], label), {})
                n = summary.get("samples", 0.0)
                sums = {f"{m}_mean": (f"{m}_weighted", f"{m}_samples") for m in WEIGHTED}
                sums["sample_ms"] = ("sample_ms_weighted", "")
                for key, (weighted, samples) in sums.items():
                    if key in summary:
                        run[weighted] = run.get(weighted, 0.0) + summary[key] * n
                        if samples:
                            run[samples] = run.get(samples, 0.0) + n
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
            ident, n = names.get((node, label), {}), run["samples"]
            means = {}
            for m in WEIGHTED:
                samples = run.get(f"{m}_samples")
                means[f"{m}_mean"] = run[f"{m}_weighted"] / samples if samples else None
            cost = run.get("sample_ms_weighted")
            rows.append(
                {
                    "gpu": f"node{node}/{label}",
                    "name": ident.get("name", "?"),
                    "uuid": ident.get("uuid", "?"),
                    **means,
                    "mem_used_gib_max": run.get("mem_used_gib_max"),
                    "torch_peak_alloc_gib": run.get("torch_peak_alloc_gib"),
                    "energy_j": run.get("energy_j"),
                    "samples": int(n),
                    "sample_ms": cost / n if n and cost is not None else None,
                }
            )
        return rows


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    """Print :meth:`RunSummary.rows` as one Rich table on the console."""
    from rich.console import Console
    from rich.table import Table

    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    table = Table(title="GPU statistics over the run (training epochs)")
    # GPM columns only when some GPU had GPM: older GPUs would show a column of n/a
    gpm = [
        (metric, title)
        for metric, title in (
            ("sm_active", "SM active %"),
            ("sm_occupancy", "occupancy %"),
            ("tensor_active", "tensor %"),
            ("dram_active", "DRAM bw %"),
        )
        if any(row.get(f"{metric}_mean") is not None for row in rows)
    ]
    for column in (
        "GPU",
        "name",
        "util %",
        *(title for _, title in gpm),
        "peak mem GiB",
        "torch peak GiB",
        "energy kJ",
        "samples",
        "NVML ms/sample",
    ):
        table.add_column(column, justify="left" if column in ("GPU", "name") else "right")
    for row in rows:
        energy = None if row["energy_j"] is None else row["energy_j"] / 1000
        table.add_row(
            row["gpu"],
            row["name"],
            fmt(row["util_mean"], ".1f"),
            *(fmt(row.get(f"{metric}_mean"), ".1f") for metric, _ in gpm),
            fmt(row["mem_used_gib_max"], ".2f"),
            fmt(row["torch_peak_alloc_gib"], ".2f"),
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
