"""runkit.plots: learning curves and GPU panels from csv/metrics.csv, the CLI and its errors.

The CSV files here are written the way Lightning's CSVLogger writes them (one row per log call,
empty cells for the other columns), so no training is needed; tests/test_readme.py checks that a
real run leaves its curves.png.
"""

from __future__ import annotations

import csv
import logging
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import prewarmed
from conftest import clean_env, last_line
from runkit import plots as plot

pytest.importorskip("matplotlib", reason="runkit.plots draws with matplotlib (the plot extra)")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GPU = "gpu/node0/cuda{i}/{stat}"


def write_run(
    run: Path,
    epochs: int = 4,
    gpus: int = 0,
    lr: bool = False,
    overrides: str = "",
    gpm: bool = False,
    loop: bool = False,
) -> Path:
    """A run directory with csv/metrics.csv shaped like the template's CSV logger output."""
    rows: list[dict[str, float | int]] = []
    step = 0
    for epoch in range(epochs):
        step += 10
        rows.append(
            {
                "epoch": epoch,
                "step": step,
                "val/loss": 2.0 / (epoch + 1),
                "val/acc": 0.5 + epoch / 10,
            }
        )
        train: dict[str, float | int] = {
            "epoch": epoch,
            "step": step,
            "train/loss": 1.5 / (epoch + 1),
            "train/acc": 0.6 + epoch / 10,
        }
        if lr:
            train["lr-AdamW"] = 0.01 / (epoch + 1)
        for i in range(gpus):
            train[GPU.format(i=i, stat="util_mean")] = 40 + 10 * i + epoch
            train[GPU.format(i=i, stat="util_max")] = 60 + 10 * i + epoch
            train[GPU.format(i=i, stat="mem_used_gib_max")] = 10.0 + 2 * i
            train[GPU.format(i=i, stat="mem_total_gib")] = 80.0
            if gpm:
                train[GPU.format(i=i, stat="sm_active_mean")] = 30.0 + 10 * epoch
                train[GPU.format(i=i, stat="tensor_active_mean")] = 5.0 + epoch
        if loop:
            train["loop/data_wait_frac"] = 0.6 - 0.1 * epoch
        rows.append(train)
    rows.append({"epoch": epochs, "step": step + 1, "test/acc": 0.93, "test/loss": 0.2})
    columns = sorted({key for row in rows for key in row} - {"epoch", "step"})
    (run / "csv").mkdir(parents=True)
    with (run / "csv" / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["epoch", "step", *columns])
        writer.writeheader()
        writer.writerows(rows)
    if overrides:
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text(f"- {overrides}\n- paths.log_dir=/x\n")
    return run


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG header, after checking the signature and the IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return prewarmed.run(
        [sys.executable, "-m", "runkit.plot", *args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_read_metrics_keeps_one_value_per_epoch_and_test_figures_apart(tmp_path: Path) -> None:
    run = plot.read_metrics(write_run(tmp_path / "run", epochs=3))
    assert run.curve("train/loss") == ([0, 1, 2], [1.5, 0.75, 0.5])
    assert run.curve("val/acc")[0] == [0, 1, 2]
    assert run.final == {"test/acc": 0.93, "test/loss": 0.2}
    assert run.metric_names() == ["loss", "acc"]
    assert run.gpus() == []


def test_panels_add_lr_and_gpu_rows_only_when_logged(tmp_path: Path) -> None:
    plain = plot.read_metrics(write_run(tmp_path / "a"))
    full = plot.read_metrics(write_run(tmp_path / "b", gpus=2, lr=True))
    assert [p.kind for p in plot.panels_for([plain])] == ["metric", "metric"]
    kinds = [p.kind for p in plot.panels_for([full])]
    assert kinds == ["metric", "metric", "lr", "gpu_util", "gpu_mem"]
    assert full.gpus() == ["node0/cuda0", "node0/cuda1"]


def test_gpm_and_data_wait_panels_only_when_logged(tmp_path: Path) -> None:
    plain = plot.read_metrics(write_run(tmp_path / "a", gpus=1))
    assert {p.kind for p in plot.panels_for([plain])}.isdisjoint({"gpu_gpm", "loop"})
    run = plot.read_metrics(write_run(tmp_path / "b", gpus=2, gpm=True, loop=True))
    assert [p.kind for p in plot.panels_for([run])][-2:] == ["gpu_gpm", "loop"]
    figure = plot.draw([run])
    titles = {ax.get_title(): ax for ax in figure.axes if ax.get_visible()}
    gpm = next(ax for title, ax in titles.items() if title.startswith("SM activity"))
    wait = next(ax for title, ax in titles.items() if title.startswith("waiting for data"))
    assert len(gpm.get_lines()) == 4  # per GPU: SM activity and, dashed, tensor-core activity
    assert list(gpm.get_lines()[0].get_ydata()) == [30, 40, 50, 60]
    assert list(wait.get_lines()[0].get_ydata()) == pytest.approx([60, 50, 40, 30])  # percent


def test_one_run_makes_a_valid_png_of_sensible_size(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    path = plot.plot_runs([run])
    assert path == run / plot.PLOT_FILE
    width, height = png_size(path)
    assert 600 <= width <= 2000 and 250 <= height <= 2000, (width, height)


def test_gpu_panels_draw_one_line_per_gpu(tmp_path: Path) -> None:
    run = plot.read_metrics(write_run(tmp_path / "run", gpus=2))
    figure = plot.draw([run])
    titles = {ax.get_title(): ax for ax in figure.axes if ax.get_visible()}
    util = next(ax for title, ax in titles.items() if title.startswith("GPU utilization"))
    memory = next(ax for title, ax in titles.items() if title.startswith("GPU memory"))
    assert [t.get_text() for t in util.get_legend().get_texts()] == ["node0/cuda0", "node0/cuda1"]
    # Per GPU: the main line and its companion (max utilization / memory size).
    assert len(util.get_lines()) == 4 and len(memory.get_lines()) == 4
    assert list(util.get_lines()[0].get_ydata()) == [40, 41, 42, 43]
    # The image with GPU rows is taller than the one without.
    with_gpu = plot.plot_runs([tmp_path / "run"], tmp_path / "gpu.png")
    without = plot.plot_runs([write_run(tmp_path / "plain")], tmp_path / "plain.png")
    assert png_size(with_gpu)[1] > png_size(without)[1]


def test_several_runs_side_by_side_share_rows(tmp_path: Path) -> None:
    runs = [plot.read_metrics(write_run(tmp_path / name)) for name in ("a", "b", "c")]
    figure = plot.draw(runs)
    assert len(figure.axes) == 2 * 3  # two panels (loss, acc) x three runs
    out = plot.plot_runs([tmp_path / "a", tmp_path / "b", tmp_path / "c"], tmp_path / "abc.png")
    one = plot.plot_runs([tmp_path / "a"], tmp_path / "a.png")
    assert png_size(out)[0] > png_size(one)[0]


def test_sweep_directory_stands_for_its_jobs_in_numeric_order(tmp_path: Path) -> None:
    sweep = tmp_path / "multiruns" / "2024-01-01_00-00-00"
    for job in ("0", "1", "10", "2"):
        write_run(sweep / job, overrides=f"model.optimizer.lr=0.{job}1")
    (sweep / "multirun.yaml").write_text("{}\n")
    assert [p.name for p in plot.expand_run_dirs([sweep])] == ["0", "1", "2", "10"]
    runs = [plot.read_metrics(p) for p in plot.expand_run_dirs([sweep])]
    assert runs[0].label == "0\nmodel.optimizer.lr=0.01"  # paths.* overrides are left out
    assert plot.plot_runs([sweep]) == sweep / plot.PLOT_FILE


def test_out_names_a_file_or_a_directory_and_rejects_unknown_formats(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    (tmp_path / "figs").mkdir()
    assert plot.plot_runs([run], tmp_path / "figs") == tmp_path / "figs" / plot.PLOT_FILE
    svg = plot.plot_runs([run], tmp_path / "c.svg")
    assert svg.read_text().lstrip().startswith("<?xml")
    with pytest.raises(plot.PlotError, match=r"--out '.*c\.txt' has an unknown format; use"):
        plot.plot_runs([run], tmp_path / "c.txt")


def test_after_run_draws_curves_png(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", gpus=1)
    assert plot.after_run(run) == run / plot.PLOT_FILE
    png_size(run / plot.PLOT_FILE)


def test_after_run_without_matplotlib_logs_one_line_and_carries_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    run = write_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with caplog.at_level(logging.INFO, logger="runkit.plots"):
        assert plot.after_run(run) is None
    assert not (run / plot.PLOT_FILE).exists()
    (record,) = caplog.records
    assert "pip install matplotlib" in record.getMessage()
    assert str(run) in record.getMessage()


def test_after_run_never_raises_on_a_broken_csv(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    (run / "csv").mkdir(parents=True)
    (run / "csv" / "metrics.csv").write_text("epoch,step\n")
    with caplog.at_level(logging.INFO, logger="runkit.plots"):
        assert plot.after_run(run) is None
    assert "has no rows yet" in caplog.text
    assert plot.after_run(tmp_path / "no-csv") is None  # logger=none: nothing to draw


@pytest.mark.slow
def test_cli_draws_and_prints_the_path(tmp_path: Path) -> None:
    write_run(tmp_path / "a", gpus=1)
    write_run(tmp_path / "b")
    result = run_cli("a", "b", "--out", "ab.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ab.png"
    png_size(tmp_path / "ab.png")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("missing", "'missing' does not exist; expected a run or sweep directory"),
        ("empty", "'empty' holds no csv/metrics.csv, neither itself nor in its subfolders"),
        ("header", "has no rows yet"),
    ],
)
def test_cli_bad_run_dir_is_one_line_and_exit_2(tmp_path: Path, setup: str, expected: str) -> None:
    if setup == "empty":
        (tmp_path / "empty").mkdir()
    elif setup == "header":
        (tmp_path / "header" / "csv").mkdir(parents=True)
        (tmp_path / "header" / "csv" / "metrics.csv").write_text("")
    result = run_cli(setup, cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert last_line(result.stderr).startswith("error: ")
    assert expected in result.stderr
    assert not list(tmp_path.glob("**/*.png"))


def test_a_run_with_test_figures_only_is_a_clear_error(tmp_path: Path) -> None:
    run = tmp_path / "eval-run"
    (run / "csv").mkdir(parents=True)
    (run / "csv" / "metrics.csv").write_text("epoch,step,test/acc,test/loss\n0,0,0.9,0.3\n")
    with pytest.raises(plot.PlotError, match="an eval run has test/ figures only"):
        plot.plot_runs([run])
    assert not (run / plot.PLOT_FILE).exists()
