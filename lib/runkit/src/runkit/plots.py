"""Draw the learning curves (and GPU statistics, when logged) of finished runs; a sweep
directory stands for its jobs, several runs are drawn side by side.

Every training run draws its ``curves.png`` at the end (:func:`after_run`); matplotlib is optional.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import logging
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from runkit.errors import RunError

log = logging.getLogger(__name__)

PLOT_FILE = "curves.png"
METRICS_CSV = Path("csv") / "metrics.csv"
HINT = "pip install matplotlib"
FORMATS = (".png", ".svg", ".pdf")
LOOP_WAIT = "loop/data_wait_frac"
_GPU_KEY = re.compile(r"^gpu/(?P<gpu>node\d+/cuda\d+)/(?P<stat>[a-z0-9_]+)$")
_STAGED = re.compile(r"^(?P<stage>train|val|test)(?:[/_.\-](?P<name>.+))?$")
_LOADER = re.compile(r"/(?P<loader>dataloader_idx_\d+)$")
_CSV = "a CSV log (the text file Lightning's CSVLogger writes)"
_SIGNATURES = {b"\x89PNG\r\n\x1a\n": "a PNG image", b"%PDF": "a PDF document",
               b"PK\x03\x04": "a zip archive (a checkpoint?)"}  # fmt: skip
_TITLES = {"lr": "learning rate", "loop": "waiting for data % of the training loop"}
_GPU_LINES = {  # per GPU panel: title, the main statistic, its companion and its line style
    "gpu_util": ("GPU utilization % (epoch mean; thin: max)", "util_mean", "util_max", "-"),
    "gpu_mem": ("GPU memory used GiB (epoch max; dotted: size)", "mem_used_gib_max", "mem_total_gib", ":"),
    "gpu_gpm": ("SM activity % (GPM, epoch mean; dashed: tensor cores)", "sm_active_mean", "tensor_active_mean", "--"),
}  # fmt: skip


class PlotError(RunError):
    """A run directory that cannot be plotted; the message names it and says why."""


def split_column(column: str) -> tuple[str, str, str] | None:
    """``(stage, name, loader)`` of a per-epoch metric column (``val_loss/dataloader_idx_1``:
    ``("val", "loss", "dataloader_idx_1")``); ``None`` for other columns."""
    if column.startswith(("lr-", "gpu/", "loop/")):
        return None
    found = _LOADER.search(column)
    rest = column[: found.start()] if found else column
    if rest.endswith(("_step", "_best")):
        return None
    rest, loader = rest.removesuffix("_epoch"), found["loader"] if found else ""
    staged = _STAGED.match(rest)
    if staged is None:
        return ("", rest, loader) if rest else None
    return staged["stage"], staged["name"] or staged["stage"], loader


@dataclass
class RunMetrics:
    """One run's values per epoch (``series[column][epoch]``) and its ``test/*`` figures."""

    run_dir: Path
    label: str
    series: dict[str, dict[int, float]] = field(default_factory=dict)
    final: dict[str, float] = field(default_factory=dict)

    def curve(self, column: str) -> tuple[list[int], list[float]]:
        points = sorted(self.series.get(column, {}).items())
        return [e for e, _ in points], [v for _, v in points]

    def metric_names(self) -> list[str]:
        names = {parts[1] for c in self.series if (parts := split_column(c))}
        return sorted(names, key=lambda n: ({"loss": 0, "acc": 1}.get(n, 2), n))

    def lines(self, name: str) -> list[tuple[str, str]]:
        found = [
            (" ".join(p for p in (parts[0], parts[2]) if p) or name, column)
            for column in self.series
            if (parts := split_column(column)) and parts[1] == name
        ]
        rank = {"train": 0, "val": 1}
        return sorted(found, key=lambda line: (rank.get(line[0].split(" ")[0], 2), line[0]))

    def test_figure(self, name: str) -> float | None:
        return next((v for c, v in self.final.items() if split_column(c) == ("test", name, "")), None)  # fmt: skip

    def gpus(self) -> list[str]:
        found = {m["gpu"] for c in self.series if (m := _GPU_KEY.match(c))}
        return sorted(found, key=lambda g: tuple(int(n) for n in re.findall(r"\d+", g)))


def read_text_file(path: Path, what: str) -> str:
    try:
        data = path.read_bytes()
    except IsADirectoryError as err:
        raise PlotError(f"{str(path)!r} is a directory; expected {what}") from err
    except OSError as err:
        raise PlotError(f"{str(path)!r} cannot be read ({err.strerror or err})") from err
    kind = next((k for sig, k in _SIGNATURES.items() if data.startswith(sig)), None)
    if kind is None and (nul := data.find(b"\x00")) >= 0:
        kind = f"binary data (a NUL byte at offset {nul})"
    if kind is None:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            kind = f"binary data (byte 0x{data[err.start]:02x} at offset {err.start} is not UTF-8)"
    raise PlotError(f"{str(path)!r} is not {what}: it holds {kind}; the file is damaged or foreign")


def read_csv_log(path: Path) -> list[dict[str, str]]:
    """The rows of a CSVLogger file; one-line :class:`PlotError` when it is not one, or damaged."""
    text, name = read_text_file(path, _CSV), repr(str(path))
    if not text.strip():
        raise PlotError(
            f"{name} is empty: it has no rows yet (did the run stop before its first epoch ended?)"
        )
    if not text.endswith(("\n", "\r")):
        raise PlotError(
            f"{name} is cut short: its last line ends without a newline (a copy or a write that "
            "stopped part-way); use an intact copy of the file"
        )
    try:
        header, *rows = [row for row in csv.reader(io.StringIO(text, newline="")) if row]
    except csv.Error as err:
        raise PlotError(f"{name} is not {_CSV}: {err}") from err
    if "epoch" not in header or "step" not in header:
        shown = ",".join(header)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise PlotError(f"{name} is not {_CSV}: its header {shown!r} has no epoch and step columns")
    for number, row in enumerate(rows, start=2):
        if len(row) != len(header):
            raise PlotError(
                f"{name} is damaged: row {number} has {len(row)} fields, its header "
                f"{len(header)}; use an intact copy of the file"
            )
    return [dict(zip(header, row, strict=True)) for row in rows]


def _number(text: str | None) -> float | None:
    try:
        return value if math.isfinite(value := float(text or "nan")) else None
    except ValueError:
        return None


def read_metrics(run_dir: str | Path, label: str | None = None) -> RunMetrics:
    run = Path(run_dir)
    metrics = RunMetrics(run, label or _label(run))
    for row in read_csv_log(run / METRICS_CSV):
        if (epoch := _number(row.get("epoch"))) is None:
            continue
        for column, text in row.items():
            if column in ("epoch", "step") or (value := _number(text)) is None:
                continue
            if (parts := split_column(column)) and parts[0] == "test":
                metrics.final[column] = value
            else:
                metrics.series.setdefault(column, {})[int(epoch)] = value
    if not metrics.series and not metrics.final:
        raise PlotError(
            f"{str(run / METRICS_CSV)!r} has no rows yet (did the run stop before its first "
            "epoch ended?)"
        )
    return metrics


def _label(run: Path) -> str:
    overrides = run / ".hydra" / "overrides.yaml"
    if not overrides.exists():
        return run.name
    text = read_text_file(overrides, "Hydra's list of overrides (YAML text)")
    items = [line.strip()[2:].strip() for line in text.splitlines() if line.strip()[:2] == "- "]
    extra = " ".join(i for i in items if not i.startswith(("paths.", "hydra.")))
    extra = extra if len(extra) <= 60 else extra[:57] + "..."
    return f"{run.name}\n{extra}" if extra else run.name


def expand_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """A run stands for itself; a sweep for its runs, in job-number order."""
    runs: list[Path] = []
    for given in paths:
        path = Path(given)
        if not path.is_dir():
            what = "is a file" if path.exists() else "does not exist"
            raise PlotError(f"{str(given)!r} {what}; expected a run or sweep directory")
        if (path / METRICS_CSV).exists():
            runs.append(path)
            continue
        jobs = [p.parent.parent for p in path.glob(f"*/{METRICS_CSV}")]
        if not jobs:
            raise PlotError(
                f"{str(given)!r} holds no {METRICS_CSV}, neither itself nor in its subfolders "
                "(every training run writes one)"
            )
        runs += sorted(jobs, key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name))  # fmt: skip
    return runs


class Panel(NamedTuple):
    kind: str
    name: str = ""


def panels_for(runs: Sequence[RunMetrics]) -> list[Panel]:
    names = dict.fromkeys(n for run in runs for n in run.metric_names())
    gpus = [(run, f"gpu/{gpu}/") for run in runs for gpu in run.gpus()]
    has = {
        "lr": any(c.startswith("lr-") for run in runs for c in run.series),
        "gpu_util": bool(gpus),
        "gpu_mem": bool(gpus),
        "gpu_gpm": any(g + "sm_active_mean" in run.series for run, g in gpus),
        "loop": any(LOOP_WAIT in run.series for run in runs),
    }
    return [Panel("metric", n) for n in names] + [Panel(kind) for kind in has if has[kind]]


def draw(runs: Sequence[RunMetrics]) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = panels_for(runs)
    if not panels:
        raise PlotError(
            f"{', '.join(repr(str(run.run_dir)) for run in runs)} logged no values per epoch, "
            "nothing to plot (an eval run has test/ figures only; see its metrics.json)"
        )
    one = len(runs) == 1
    ncols = min(2, len(panels)) if one else len(runs)
    nrows = math.ceil(len(panels) / ncols) if one else len(panels)
    width = 4.6 * ncols
    figure = Figure(figsize=(width, 3 * nrows + 0.6), dpi=min(100, 6000 / width), layout="constrained")  # fmt: skip
    FigureCanvasAgg(figure)
    axes = figure.subplots(nrows, ncols, squeeze=False, sharey=False if one else "row").flat
    cells = [(panel, run) for panel in panels for run in runs]
    for index, ax in enumerate(axes):
        if index >= len(cells):
            ax.set_visible(False)
            continue
        panel, run = cells[index]
        title = _GPU_LINES.get(panel.kind, [_TITLES.get(panel.kind, panel.name)])[0]
        ax.set_title(title if one or index >= ncols else f"{run.label}\n{title}", fontsize=9)
        ax.set_xlabel("epoch", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if _draw_panel(ax, panel, run):
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    if one:
        tested = ", ".join(f"{key} {value:.4g}" for key, value in sorted(runs[0].final.items()))
        name = runs[0].label.replace("\n", "  ")
        figure.suptitle(f"{name}  ({tested})" if tested else name, fontsize=10)
    return figure


def _draw_panel(ax: Any, panel: Panel, run: RunMetrics) -> bool:
    style = {"marker": "o", "markersize": 3}
    if panel.kind == "metric":
        lines = run.lines(panel.name)
        for label, column in lines:
            ax.plot(*run.curve(column), "-" if label[:5] == "train" else "--", label=label, **style)
        test = run.test_figure(panel.name)
        if test is not None and lines:
            ax.axhline(test, color="tab:green", linestyle=":", label=f"test {test:.4g}")
        return bool(lines)
    if panel.kind == "lr":
        columns = sorted(c for c in run.series if c.startswith("lr-"))
        for column in columns:
            ax.plot(*run.curve(column), label=column.removeprefix("lr-"), **style)
        if all(v > 0 for c in columns for v in run.curve(c)[1]):
            ax.set_yscale("log")
        return bool(columns)
    if panel.kind == "loop":
        epochs, values = run.curve(LOOP_WAIT)
        ax.plot(epochs, [100 * v for v in values], label="data wait", **style)
        ax.set_ylim(0, 105)
        return bool(epochs)
    _, main, extra, extra_style = _GPU_LINES[panel.kind]
    drawn = [gpu for gpu in run.gpus() if run.curve(f"gpu/{gpu}/{main}")[0]]
    for n, gpu in enumerate(drawn):
        ax.plot(*run.curve(f"gpu/{gpu}/{main}"), color=f"C{n % 10}", label=gpu, **style)
        ax.plot(*run.curve(f"gpu/{gpu}/{extra}"), extra_style, color=f"C{n % 10}", linewidth=0.8)
    if drawn:
        ax.set_ylim(0, None if panel.kind == "gpu_mem" else 105)
    return bool(drawn)


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Draw ``run_dirs`` into ``out`` (a file or a directory; default: the one directory or .)."""
    runs = [read_metrics(path) for path in expand_run_dirs(run_dirs)]
    if out is None:
        out = run_dirs[0] if len(run_dirs) == 1 else "."
    target = Path(out) / PLOT_FILE if Path(out).is_dir() else Path(out)
    if target.suffix.lower() not in FORMATS:
        raise PlotError(
            f"--out {str(out)!r} has an unknown format; use a name ending in {', '.join(FORMATS)}"
        )
    buffer = io.BytesIO()
    draw(runs).savefig(buffer, format=target.suffix.lstrip("."))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(buffer.getvalue())
    except OSError as err:
        raise PlotError(f"cannot write {str(target)!r}: {err.strerror or err}") from err
    return target


def after_run(run_dir: str | Path) -> Path | None:
    """Draw ``run_dir/curves.png`` at the end of a training run; never fails the run."""
    run = Path(run_dir)
    if not (run / METRICS_CSV).exists():
        log.info("No %s in this run, so no %s.", METRICS_CSV, PLOT_FILE)
        return None
    if importlib.util.find_spec("matplotlib") is None:
        log.info("Learning-curve plots need matplotlib: %s, then python -m runkit.plot %s", HINT, run)  # fmt: skip
        return None
    try:
        path = plot_runs([run])
    except Exception as err:  # a plot is a convenience: a finished run must not fail over it
        log.warning("Could not draw %s: %s", PLOT_FILE, err)
        return None
    log.info("Learning curves: %s", path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    what = (__doc__ or "").split("\n\n")[0]  # the first paragraph above
    parser = argparse.ArgumentParser(prog="python -m runkit.plot", description=what)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run or sweep directory")
    parser.add_argument("--out", help=f"image ({', '.join(FORMATS)}) or directory to write")
    args = parser.parse_args(argv)
    try:
        print(plot_runs(args.run_dirs, args.out))
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:
        if not (err.name or "").startswith("matplotlib"):
            raise
        print(f"error: python -m runkit.plot needs matplotlib: {HINT}", file=sys.stderr)
        return 2
    return 0
