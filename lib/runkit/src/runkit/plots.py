"""Learning curves and GPU statistics of finished runs, drawn as one PNG.

    python -m runkit.plot RUN_DIR                  # RUN_DIR/curves.png
    python -m runkit.plot SWEEP_DIR                # every job side by side: SWEEP_DIR/curves.png
    python -m runkit.plot RUN_A RUN_B --out ab.png # several runs side by side

Every training run draws its own ``curves.png`` from ``csv/metrics.csv`` at the end (rank 0,
:func:`after_run`): train and validation metrics per epoch, the learning rate, each GPU's
utilisation, memory and SM activity, and the data wait. matplotlib is an optional extra, so a
missing plot never fails a finished run (one line says how to get it); drawing uses the Agg
canvas, no pyplot state. Importing this module is cheap (no torch, no matplotlib).
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runkit.errors import RunError

log = logging.getLogger(__name__)

PLOT_FILE = "curves.png"
METRICS_CSV = Path("csv") / "metrics.csv"
INSTALL_HINT = "pip install matplotlib"
FORMATS = (".png", ".svg", ".pdf")

# Training-epoch GPU statistics written by runkit.gpu_stats.callback (key_prefix "gpu").
_GPU_KEY = re.compile(r"^gpu/(?P<gpu>node\d+/cuda\d+)/(?P<stat>[a-z0-9_]+)$")
LOOP_WAIT = "loop/data_wait_frac"  # also from runkit.gpu_stats (any CPU or GPU run)
_PANEL_SIZE = (4.6, 3.0)  # inches per panel
_DPI = 100
_MAX_WIDTH_PX = 6000  # wide sweeps get a lower resolution instead of an enormous file


class PlotError(RunError):
    """A run directory that cannot be plotted; the message names it and says why."""


@dataclass
class RunMetrics:
    """What one run logged, one value per epoch.

    ``series[column]`` maps epoch -> the last value logged for ``column`` in that epoch;
    ``final`` holds the ``test/*`` figures (logged once, after fit).
    """

    run_dir: Path
    label: str
    series: dict[str, dict[int, float]] = field(default_factory=dict)
    final: dict[str, float] = field(default_factory=dict)

    def curve(self, column: str) -> tuple[list[int], list[float]]:
        """Epochs and values of ``column``, sorted by epoch (empty when never logged)."""
        points = sorted(self.series.get(column, {}).items())
        return [epoch for epoch, _ in points], [value for _, value in points]

    def metric_names(self) -> list[str]:
        """The metrics logged per epoch (``loss``, ``acc``...), whatever the separator after the
        stage (``val/loss``, ``val_loss``) and the loader (``val_loss/dataloader_idx_0``): loss
        first, then accuracy; a name logged without a stage is a metric of its own."""
        names = {split_column(c)[1] for c in self.series if split_column(c) is not None}
        order = {"loss": 0, "acc": 1}
        return sorted(names, key=lambda n: (order.get(n, 2), n))

    def lines(self, name: str) -> list[tuple[str, str]]:
        """``(label, column)`` of every curve of metric ``name``: one per stage and loader."""
        found = []
        for column in self.series:
            parts = split_column(column)
            if parts is not None and parts[1] == name:
                stage, _, loader = parts
                found.append((" ".join(p for p in (stage, loader) if p) or name, column))
        rank = {"train": 0, "val": 1}
        return sorted(found, key=lambda line: (rank.get(line[0].split(" ")[0], 2), line[0]))

    def test_figure(self, name: str) -> float | None:
        """The test figure of metric ``name`` (``test/loss``, ``test_loss``...), if one."""
        for column, value in self.final.items():
            parts = split_column(column)
            if parts is not None and parts[1] == name and not parts[2]:
                return value
        return None

    def lr_columns(self) -> list[str]:
        """Learning-rate columns written by Lightning's LearningRateMonitor."""
        return sorted(c for c in self.series if c.startswith("lr-"))

    def gpus(self) -> list[str]:
        """GPUs with statistics, as ``node{N}/cuda{i}``, in node then CUDA index order."""
        found = {m["gpu"] for c in self.series if (m := _GPU_KEY.match(c))}
        return sorted(found, key=lambda g: tuple(int(n) for n in re.findall(r"\d+", g)))


_STAGED = re.compile(r"^(?P<stage>train|val|test)(?:[/_.\-](?P<name>.+))?$")
_LOADER = re.compile(r"/(?P<loader>dataloader_idx_\d+)$")
_OTHER_PANELS = ("lr-", "gpu/", "loop/")  # columns drawn by panels of their own


def split_column(column: str) -> tuple[str, str, str] | None:
    """``(stage, name, loader)`` of a per-epoch column the module logged, ``None`` for columns
    that are not a metric curve (per-step values, ``*_best``, the lr, GPU and loop panels').

    ``val/loss``, ``val_loss`` and ``val-loss`` are ``("val", "loss", "")``;
    ``val_loss/dataloader_idx_1`` is ``("val", "loss", "dataloader_idx_1")``; Lightning's
    ``_epoch`` suffix (a value logged per step and per epoch) is dropped; ``alpha``, logged
    without a stage, is ``("", "alpha", "")``.
    """
    if column.startswith(_OTHER_PANELS):
        return None
    loader_match = _LOADER.search(column)
    loader = loader_match["loader"] if loader_match else ""
    rest = column[: loader_match.start()] if loader_match else column
    if rest.endswith(("_step", "_best")):
        return None
    rest = rest.removesuffix("_epoch")
    staged = _STAGED.match(rest)
    if staged is None:
        return ("", rest, loader) if rest else None
    return staged["stage"], staged["name"] or staged["stage"], loader


# --------------------------------------------------------------------------------------------
# Reading


def read_metrics(run_dir: str | Path, label: str | None = None) -> RunMetrics:
    """Read ``RUN_DIR/csv/metrics.csv`` into one value per epoch and column.

    Raises :class:`PlotError` (one line) for a missing directory, a run without the CSV log, or a
    CSV log that is empty, cut short, binary or not the CSV logger's (:func:`read_csv_log`).
    """
    run = Path(run_dir)
    path = run / METRICS_CSV
    if not run.is_dir():
        raise PlotError(f"{str(run_dir)!r} is not a directory; expected a run directory")
    if not path.exists():
        raise PlotError(
            f"{str(run_dir)!r} has no {METRICS_CSV} (a run directory written by "
            "a training run, or a sweep directory holding such runs, is expected)"
        )
    metrics = RunMetrics(run, label or _label(run))
    for row in read_csv_log(path):
        epoch = _number(row.get("epoch"))
        if epoch is None:
            continue
        for column, text in row.items():
            value = _number(text)
            if column in ("epoch", "step") or value is None:
                continue
            parts = split_column(column)
            if parts is not None and parts[0] == "test":
                metrics.final[column] = value
            else:
                metrics.series.setdefault(column, {})[int(epoch)] = value
    if not metrics.series and not metrics.final:
        raise PlotError(
            f"{str(path)!r} has no rows yet (did the run stop before its first epoch ended?)"
        )
    return metrics


def read_text_file(path: Path, what: str) -> str:
    """The text of a file the program wrote, or :class:`PlotError` (one line naming it) when it
    cannot be read or is not UTF-8 text: a damaged file must not end in a decoding traceback."""
    try:
        data = path.read_bytes()
    except IsADirectoryError as err:
        raise PlotError(f"{str(path)!r} is a directory; expected {what}") from err
    except OSError as err:
        raise PlotError(f"{str(path)!r} cannot be read ({err.strerror or err})") from err
    kind = _binary_kind(data)
    if kind is None:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            kind = f"binary data (byte 0x{data[err.start]:02x} at offset {err.start} is not UTF-8)"
    raise PlotError(f"{str(path)!r} is not {what}: it holds {kind}; the file is damaged or foreign")


_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "a PNG image",
    b"%PDF": "a PDF document",
    b"PK\x03\x04": "a zip archive (a checkpoint?)",
}


def _binary_kind(data: bytes) -> str | None:
    """What ``data`` looks like when it is clearly not text; None for text-like bytes."""
    for signature, kind in _SIGNATURES.items():
        if data.startswith(signature):
            return kind
    nul = data.find(b"\x00")
    return f"binary data (a NUL byte at offset {nul})" if nul >= 0 else None


def read_csv_log(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV log written by Lightning's CSVLogger, checked for damage.

    One-line :class:`PlotError` when the file is empty, binary, not a CSV with ``epoch`` and
    ``step`` columns, cut short (its last line has no newline: the logger ends every row with
    one) or has a row with another number of fields than its header.
    """
    what = "a CSV log (the text file Lightning's CSVLogger writes)"
    text = read_text_file(path, what)
    if not text.strip():
        raise PlotError(
            f"{str(path)!r} is empty: it has no rows yet (did the run stop before its first "
            "epoch ended?)"
        )
    if not text.endswith(("\n", "\r")):
        raise PlotError(
            f"{str(path)!r} is cut short: its last line ends without a newline (a copy or a "
            "write that stopped part-way); use an intact copy of the file"
        )
    try:
        lines = [row for row in csv.reader(io.StringIO(text, newline="")) if row]
    except csv.Error as err:
        raise PlotError(f"{str(path)!r} is not {what}: {err}") from err
    header, rows = lines[0], lines[1:]
    if "epoch" not in header or "step" not in header:
        shown = ",".join(header)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise PlotError(
            f"{str(path)!r} is not {what}: its header {shown!r} has no epoch and step columns"
        )
    for number, row in enumerate(rows, start=2):
        if len(row) != len(header):
            raise PlotError(
                f"{str(path)!r} is damaged: row {number} has {len(row)} fields, its header "
                f"{len(header)}; use an intact copy of the file"
            )
    return [dict(zip(header, row, strict=True)) for row in rows]


def _number(text: str | None) -> float | None:
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _label(run: Path) -> str:
    """The run's folder name, plus the overrides it was started with (a sweep job's parameters)."""
    overrides = run / ".hydra" / "overrides.yaml"
    extra = ""
    if overrides.exists():
        text = read_text_file(overrides, "Hydra's list of overrides (YAML text)")
        items = [
            line.strip()[2:].strip() for line in text.splitlines() if line.strip().startswith("- ")
        ]
        items = [item for item in items if not item.startswith(("paths.", "hydra."))]
        extra = " ".join(items)
        if len(extra) > 60:
            extra = extra[:57] + "..."
    return f"{run.name}\n{extra}" if extra else run.name


def expand_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Run directories for ``paths``: a run stands for itself; a directory without its own
    ``csv/metrics.csv`` (a sweep, ``logs/train/runs``) stands for the runs directly inside it."""
    runs: list[Path] = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise PlotError(f"{str(given)!r} does not exist; expected a run or sweep directory")
        if not path.is_dir():
            raise PlotError(f"{str(given)!r} is a file; expected a run or sweep directory")
        if (path / METRICS_CSV).exists():  # a directory there is refused by read_metrics
            runs.append(path)
            continue
        jobs = sorted((p.parent.parent for p in path.glob(f"*/{METRICS_CSV}")), key=_job_order)
        if not jobs:
            raise PlotError(
                f"{str(given)!r} holds no {METRICS_CSV}, neither itself nor in its subfolders "
                "(every training run writes one)"
            )
        runs.extend(jobs)
    return runs


def _job_order(path: Path) -> tuple[int, int, str]:
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


# --------------------------------------------------------------------------------------------
# Drawing


@dataclass(frozen=True)
class Panel:
    """One row of the figure: what it shows and how to draw it for a run."""

    kind: str  # "metric", "lr", "gpu_util", "gpu_mem", "gpu_gpm" or "loop"
    name: str = ""

    @property
    def title(self) -> str:
        return {
            "lr": "learning rate",
            "gpu_util": "GPU utilization % (epoch mean; thin: max)",
            "gpu_mem": "GPU memory used GiB (epoch max; dotted: size)",
            "gpu_gpm": "SM activity % (GPM, epoch mean; dashed: tensor cores)",
            "loop": "waiting for data % of the training loop",
        }.get(self.kind, self.name)


def panels_for(runs: Sequence[RunMetrics]) -> list[Panel]:
    """The panels any of ``runs`` has data for, in a fixed order, so side-by-side rows align."""
    names: list[str] = []
    for run in runs:
        names += [n for n in run.metric_names() if n not in names]
    panels = [Panel("metric", name) for name in names]
    if any(run.lr_columns() for run in runs):
        panels.append(Panel("lr"))
    if any(run.gpus() for run in runs):
        panels += [Panel("gpu_util"), Panel("gpu_mem")]
    if any(f"gpu/{gpu}/sm_active_mean" in run.series for run in runs for gpu in run.gpus()):
        panels.append(Panel("gpu_gpm"))
    if any(LOOP_WAIT in run.series for run in runs):
        panels.append(Panel("loop"))
    return panels


def draw(runs: Sequence[RunMetrics]) -> Any:
    """A matplotlib ``Figure`` (Agg canvas) of ``runs``: a grid of panels for one run, one column
    per run for several."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = panels_for(runs)
    if not panels:
        names = ", ".join(repr(str(run.run_dir)) for run in runs)
        raise PlotError(
            f"{names} logged no values per epoch, nothing to plot "
            "(an eval run has test/ figures only; see its metrics.json)"
        )
    if len(runs) == 1:
        ncols = 1 if len(panels) == 1 else 2
        nrows = math.ceil(len(panels) / ncols)
        cells = [(panel, runs[0]) for panel in panels]
    else:
        ncols, nrows = len(runs), len(panels)
        cells = [(panel, run) for panel in panels for run in runs]
    width, height = _PANEL_SIZE[0] * ncols, _PANEL_SIZE[1] * nrows + 0.6
    figure = Figure(
        figsize=(width, height), dpi=min(_DPI, _MAX_WIDTH_PX / width), layout="constrained"
    )
    FigureCanvasAgg(figure)
    share = "row" if len(runs) > 1 else False
    axes = figure.subplots(nrows, ncols, squeeze=False, sharey=share)
    for index, (panel, run) in enumerate(cells):
        ax = axes[index // ncols][index % ncols]
        drawn = _draw_panel(ax, panel, run)
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        title = panel.title if len(runs) == 1 or index >= ncols else f"{run.label}\n{panel.title}"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("epoch", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7, loc="best")
    for index in range(len(cells), nrows * ncols):
        axes[index // ncols][index % ncols].set_visible(False)
    if len(runs) == 1:
        figure.suptitle(_headline(runs[0]), fontsize=10)
    return figure


def _headline(run: RunMetrics) -> str:
    tested = ", ".join(f"{key} {value:.4g}" for key, value in sorted(run.final.items()))
    name = run.label.replace("\n", "  ")
    return f"{name}  ({tested})" if tested else name


def _draw_panel(ax: Any, panel: Panel, run: RunMetrics) -> bool:
    """Draw ``panel`` for ``run`` on ``ax``; False when the run has nothing for it."""
    drawn = False
    if panel.kind == "metric":
        for label, column in run.lines(panel.name):
            epochs, values = run.curve(column)
            style = "-" if label.startswith("train") else "--"
            ax.plot(epochs, values, style, marker="o", markersize=3, label=label)
            drawn = True
        test = run.test_figure(panel.name)
        if test is not None and drawn:
            ax.axhline(test, color="tab:green", linestyle=":", label=f"test {test:.4g}")
    elif panel.kind == "lr":
        for column in run.lr_columns():
            epochs, values = run.curve(column)
            ax.plot(epochs, values, marker="o", markersize=3, label=column.removeprefix("lr-"))
            drawn = True
        if drawn and all(v > 0 for c in run.lr_columns() for v in run.curve(c)[1]):
            ax.set_yscale("log")
    elif panel.kind == "loop":
        epochs, values = run.curve(LOOP_WAIT)
        if epochs:
            ax.plot(epochs, [100 * v for v in values], marker="o", markersize=3, label="data wait")
            ax.set_ylim(0, 105)
            drawn = True
    else:
        for n, gpu in enumerate(run.gpus()):
            color = f"C{n % 10}"
            if panel.kind == "gpu_util":
                main, extra, extra_style = "util_mean", "util_max", "-"
            elif panel.kind == "gpu_gpm":
                main, extra, extra_style = "sm_active_mean", "tensor_active_mean", "--"
            else:
                main, extra, extra_style = "mem_used_gib_max", "mem_total_gib", ":"
            epochs, values = run.curve(f"gpu/{gpu}/{main}")
            if not epochs:
                continue
            ax.plot(epochs, values, color=color, marker="o", markersize=3, label=gpu)
            extra_epochs, extra_values = run.curve(f"gpu/{gpu}/{extra}")
            ax.plot(extra_epochs, extra_values, extra_style, color=color, linewidth=0.8)
            drawn = True
        if drawn and panel.kind in ("gpu_util", "gpu_gpm"):
            ax.set_ylim(0, 105)
        elif drawn:
            ax.set_ylim(bottom=0)
    return drawn


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Draw ``run_dirs`` (runs or sweeps) into ``out`` and return its path.

    ``out`` defaults to ``<dir>/curves.png`` for a single directory argument (a run or a sweep)
    and ``curves.png`` in the current directory for several. ``out`` may be a directory.
    """
    runs = [read_metrics(path) for path in expand_run_dirs(run_dirs)]
    target = _output_path(run_dirs, out)
    figure = draw(runs)
    buffer = io.BytesIO()
    figure.savefig(buffer, format=target.suffix.lstrip("."))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(buffer.getvalue())
    except OSError as err:
        raise PlotError(f"cannot write {str(target)!r}: {err.strerror or err}") from err
    return target


def _output_path(run_dirs: Sequence[str | Path], out: str | Path | None) -> Path:
    if out is None:
        return Path(run_dirs[0]) / PLOT_FILE if len(run_dirs) == 1 else Path(PLOT_FILE)
    target = Path(out)
    if target.is_dir():
        return target / PLOT_FILE
    if target.suffix.lower() not in FORMATS:
        raise PlotError(
            f"--out {str(out)!r} has an unknown format; use a name ending in {', '.join(FORMATS)}"
        )
    return target


def after_run(run_dir: str | Path) -> Path | None:
    """Draw ``run_dir/curves.png`` at the end of a training run; never fails the run.

    Returns the image's path, or None (with one log line saying why) when there is no CSV log,
    matplotlib is not installed, the CSV log is damaged, or drawing failed.
    """
    run = Path(run_dir)
    if not (run / METRICS_CSV).exists():  # anything else there is read, and refused, below
        log.info("No %s in this run, so no %s.", METRICS_CSV, PLOT_FILE)
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.info(
            "Learning-curve plots need matplotlib: %s, then python -m runkit.plot %s",
            INSTALL_HINT,
            run,
        )
        return None
    try:
        path = plot_runs([run])
    except Exception as err:  # a plot is a convenience: a finished run must not fail over it
        log.warning("Could not draw %s: %s", PLOT_FILE, err)
        return None
    log.info("Learning curves: %s", path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m runkit.plot RUN_DIR [RUN_DIR ...] [--out FILE]``."""
    parser = argparse.ArgumentParser(
        prog="python -m runkit.plot",
        description="Draw the learning curves (and GPU statistics, when logged) of finished runs. "
        "A sweep directory stands for its jobs; several runs are drawn side by side.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run or sweep directory")
    parser.add_argument(
        "--out",
        help=f"image to write ({', '.join(FORMATS)}) or a directory; default: RUN_DIR/{PLOT_FILE} "
        f"for one directory, ./{PLOT_FILE} for several",
    )
    args = parser.parse_args(argv)
    try:
        path = plot_runs(args.run_dirs, args.out)
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:
        if not (err.name or "").startswith("matplotlib"):
            raise
        print(f"error: python -m runkit.plot needs matplotlib: {INSTALL_HINT}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
