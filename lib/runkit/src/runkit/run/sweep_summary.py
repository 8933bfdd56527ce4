"""What a parallel sweep leaves beside its jobs: ``summary.csv``, a table, ``summary.png``: a row
per job (all its attempts): status, values, best score, final metrics, wall time, GPU energy."""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runkit.run.sweep import Attempt, finished, newest_checkpoint, read_metrics

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.csv"
PLOT_FILE = "summary.png"
FIXED = ["job", "status", "overrides", "attempts", "monitor", "best", "wall_s", "energy_j", "dir"]


def job_rows(attempts: Sequence[Attempt], not_started: Sequence[Sequence[str]] = ()) -> list[dict]:
    """One row per job, in job order; ``not_started``: the overrides of jobs a stop kept back."""
    by_job: dict[tuple[str, ...], list[Attempt]] = {}
    for attempt in attempts:
        by_job.setdefault(tuple(attempt.overrides), []).append(attempt)
    rows = []
    for overrides, tries in sorted(by_job.items(), key=lambda item: item[1][0].num):
        done = next((a for a in tries if finished(a)), None)
        last = done or tries[-1]
        data = read_metrics(last.dir) or {}
        energy = (data.get("energy") or {}).get("energy_j")
        monitor, best = data.get("monitor") or "", data.get("best_score")
        if done is None:  # stopped or failed: no metrics.json, but its checkpoints know the best
            monitor, best = checkpoint_best(tries)
        row: dict[str, Any] = {
            "job": tries[0].num,
            "status": "finished" if done is not None else last.status,
            "overrides": " ".join(overrides),
            "attempts": len(tries),
            "monitor": monitor,
            "best": best,
            "wall_s": round(sum((a.ended or a.started) - a.started for a in tries), 1),
            "energy_j": energy,
            "dir": last.dir,
        }
        row.update({key: value for key, value in sorted((data.get("metrics") or {}).items())})
        rows.append(row)
    for overrides in not_started:
        if tuple(overrides) not in by_job:
            rows.append({"job": "", "status": "not started", "overrides": " ".join(overrides)})
    return rows


def checkpoint_best(attempts: Sequence[Attempt]) -> tuple[str, float | None]:
    """The monitored key and best score so far of an unfinished job (all its ``attempts``), from
    its newest checkpoint's ModelCheckpoint state; ``("", None)`` without one."""
    path = newest_checkpoint(attempts)
    if path is None:
        return "", None
    from runkit.errors import RunError
    from runkit.safety.checkpoints import load_file

    try:  # a sharded checkpoint keeps the callbacks' state in meta.pt, beside the shards
        data = load_file(path / "meta.pt" if path.is_dir() else path, mmap=True)
    except RunError as err:
        log.warning("No best score for the summary from %s: %s", path, err)
        return "", None
    for key, state in (data.get("callbacks") or {}).items():
        if key.startswith("ModelCheckpoint") and isinstance(state, dict):
            score = state.get("best_model_score")
            if score is not None:
                return str(state.get("monitor") or ""), float(score)
    return "", None


def write_summary(sweep_dir: Path, rows: Sequence[dict]) -> Path:
    """Write ``summary.csv`` atomically."""
    metric_keys = sorted({k for row in rows for k in row} - set(FIXED))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIXED + metric_keys, restval="")
    writer.writeheader()
    writer.writerows(rows)
    path = sweep_dir / SUMMARY_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(buffer.getvalue(), encoding="utf-8")
    os.replace(tmp, path)
    return path


def varying(rows: Sequence[dict]) -> list[str]:
    """Each job's overrides minus those every job has: what tells the jobs apart."""
    lists = [row["overrides"].split(" ") for row in rows]
    common = set.intersection(*map(set, lists)) if len(lists) > 1 else set()
    return [" ".join(o for o in overrides if o not in common) for overrides in lists]


def print_table(rows: Sequence[dict], key: str | None) -> None:
    """The summary as a Rich table: job, status, values, best, ``key`` (a metric), time, energy."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Sweep summary")
    for name in ("job", "status", "values", "best", key or "", "wall s", "energy J"):
        if name:
            table.add_column(name)
    for row, values in zip(rows, varying(rows), strict=True):
        cells = [str(row.get("job", "")), row["status"], values, _fmt(row.get("best"))]
        if key:
            cells.append(_fmt(row.get(key)))
        cells += [_fmt(row.get("wall_s"), 0), _fmt(row.get("energy_j"), 0)]
        table.add_row(*cells)
    Console(width=max(100, Console().width)).print(table)


def plot_summary(sweep_dir: Path, rows: Sequence[dict], key: str | None) -> Path | None:
    """``summary.png``: each job's best score (or ``key``) as a bar labelled by its values;
    ``None`` without matplotlib or a figure."""
    name = key if key and any(_number(row.get(key)) is not None for row in rows) else "best"
    points = [
        (label or f"#{row['job']}", _number(row.get(name)))
        for row, label in zip(rows, varying(rows), strict=True)
        if _number(row.get(name)) is not None
    ]
    if not points:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("summary.png needs matplotlib: pip install 'lightning-runkit[plot]'")
        return None
    figure, axes = plt.subplots(figsize=(8, 0.5 * len(points) + 1.5))
    labels, values = zip(*points, strict=True)
    axes.barh(range(len(values)), values, color="#4c72b0")
    axes.set_yticks(range(len(values)), labels=labels, fontsize=8)
    axes.invert_yaxis()
    monitor = next((row.get("monitor") for row in rows if row.get("monitor")), "")
    axes.set_xlabel(name if name != "best" else f"best {monitor}".strip())
    axes.set_title(f"{len(points)} job(s) of {sweep_dir.name}")
    with warnings.catch_warnings():  # very long labels: the figure is still readable
        warnings.simplefilter("ignore")
        figure.tight_layout()
    path = sweep_dir / PLOT_FILE
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _fmt(value: Any, digits: int = 4) -> str:
    number = _number(value)
    return "" if number is None else f"{number:.{digits}f}"
