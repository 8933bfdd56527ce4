"""runkit.plots on CSV files written as Lightning's CSVLogger writes them, without training."""

from __future__ import annotations

import csv
import logging
import struct
import sys
from pathlib import Path

import pytest

from runkit import plots as plot

pytest.importorskip("matplotlib", reason="runkit.plots draws with matplotlib (the plot extra)")


def write_run(run: Path, gpus: int = 0, lr: bool = False, extra: bool = False) -> Path:
    """A run directory of four epochs; ``extra``: SM activity and the data wait too."""
    rows: list[dict[str, float]] = []
    for epoch in range(4):
        val = {"epoch": epoch, "step": 10 * epoch, "val/loss": 2 / (epoch + 1), "val/acc": 0.5}
        train = {"epoch": epoch, "step": 10 * epoch, "train/loss": 1.5 / (epoch + 1)}
        train |= {"train/acc": 0.6 + epoch / 10, **({"lr-AdamW": 0.01 / (epoch + 1)} if lr else {})}
        for i in range(gpus):
            stats = {"util_mean": 40 + 10 * i + epoch, "util_max": 60, "mem_used_gib_max": 10}
            stats |= {"mem_total_gib": 80, **({"sm_active_mean": 30 + 10 * epoch} if extra else {})}
            stats |= {"tensor_active_mean": 5} if extra else {}
            train |= {f"gpu/node0/cuda{i}/{k}": v for k, v in stats.items()}
        rows += [val, train | ({"loop/data_wait_frac": 0.6 - 0.1 * epoch} if extra else {})]
    rows.append({"epoch": 4, "step": 41, "test/acc": 0.93, "test/loss": 0.2})
    (run / "csv").mkdir(parents=True)
    keys = ["epoch", "step", *sorted({k for r in rows for k in r} - {"epoch", "step"})]
    with (run / "csv" / "metrics.csv").open("w", newline="") as handle:
        (writer := csv.DictWriter(handle, keys)).writeheader()
        writer.writerows(rows)
    return run


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize(
    ("options", "kinds"),
    [
        ({}, []),
        ({"gpus": 2, "lr": True}, ["lr", "gpu_util", "gpu_mem"]),
    ],
)
def test_one_value_per_epoch_and_panels_for_what_was_logged(tmp_path, options, kinds) -> None:
    run = plot.read_metrics(write_run(tmp_path / "run", **options))
    assert run.curve("train/loss") == ([0, 1, 2, 3], [1.5, 0.75, 0.5, 0.375])
    assert run.final == {"test/acc": 0.93, "test/loss": 0.2} and run.test_figure("acc") == 0.93
    assert run.metric_names() == ["loss", "acc"] and len(run.gpus()) == options.get("gpus", 0)
    assert [p.kind for p in plot.panels_for([run])] == ["metric", "metric", *kinds]


def test_gpu_panels_draw_one_line_per_gpu_and_its_companion(tmp_path) -> None:
    run = plot.read_metrics(write_run(tmp_path / "run", gpus=2, extra=True))
    assert run.gpus() == ["node0/cuda0", "node0/cuda1"]
    kinds = [p.kind for p in plot.panels_for([run])]
    assert kinds == ["metric", "metric", "gpu_util", "gpu_mem", "gpu_gpm", "loop"]
    figure = plot.draw([run])
    titles = ("GPU utilization", "GPU memory", "SM activity", "waiting")
    util, memory, gpm, wait = (
        next(a for a in figure.axes if a.get_title().startswith(t)) for t in titles
    )
    assert [t.get_text() for t in util.get_legend().get_texts()] == ["node0/cuda0", "node0/cuda1"]
    assert {len(ax.get_lines()) for ax in (util, memory, gpm)} == {4}  # and a companion per GPU
    assert list(util.get_lines()[0].get_ydata()) == [40, 41, 42, 43]
    assert list(gpm.get_lines()[0].get_ydata()) == [30, 40, 50, 60]
    assert list(wait.get_lines()[0].get_ydata()) == pytest.approx([60, 50, 40, 30])  # percent


def test_images_grow_with_gpu_rows_and_runs_and_a_sweep_stands_for_its_jobs(tmp_path, capsys):
    run = write_run(tmp_path / "a")
    assert plot.plot_runs([run]) == run / plot.PLOT_FILE
    width, height = png_size(run / plot.PLOT_FILE)
    assert 600 <= width <= 2000 and 250 <= height <= 2000, (width, height)
    with_gpu = plot.plot_runs([write_run(tmp_path / "g", gpus=2)], tmp_path / "gpu.png")
    assert png_size(with_gpu)[1] > height
    sweep = tmp_path / "multiruns" / "2024-01-01_00-00-00"
    for job in ("1", "10", "2"):
        (write_run(sweep / job) / ".hydra").mkdir()
        (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- lr=0.{job}1\n- paths.x=/x\n")
    (sweep / "multirun.yaml").write_text("{}\n")
    runs = plot.expand_run_dirs([run, sweep])
    assert [p.name for p in runs] == ["a", "1", "2", "10"]  # a sweep's jobs in numeric order
    assert plot.read_metrics(sweep / "1").label == "1\nlr=0.11"  # paths.* overrides left out
    assert len(plot.draw([plot.read_metrics(r) for r in runs]).axes) == 2 * 4  # panels x runs
    (tmp_path / "figs").mkdir()  # the CLI; --out a directory
    assert plot.main([str(run), str(sweep), "--out", str(tmp_path / "figs")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "figs" / plot.PLOT_FILE)
    assert png_size(tmp_path / "figs" / plot.PLOT_FILE)[0] > width
    assert plot.plot_runs([run], tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(plot.PlotError, match=r"--out '.*c\.txt' has an unknown format; use"):
        plot.plot_runs([run], tmp_path / "c.txt")


def test_after_run_draws_or_says_why_in_one_line(tmp_path, monkeypatch, caplog) -> None:
    run = write_run(tmp_path / "run", gpus=1)
    assert plot.after_run(run) == run / plot.PLOT_FILE
    png_size(run / plot.PLOT_FILE)
    assert plot.after_run(tmp_path / "no-csv") is None  # logger=none: nothing to draw
    (tmp_path / "broken" / "csv").mkdir(parents=True)
    (tmp_path / "broken" / "csv" / "metrics.csv").write_text("epoch,step\n")
    with caplog.at_level(logging.INFO, logger="runkit.plots"):
        assert plot.after_run(tmp_path / "broken") is None
        assert "has no rows yet" in caplog.text
        caplog.clear()
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
        (run / plot.PLOT_FILE).unlink()
        assert plot.after_run(run) is None
    assert not (run / plot.PLOT_FILE).exists()
    (record,) = caplog.records
    assert "pip install matplotlib" in record.getMessage() and str(run) in record.getMessage()


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("missing", "'missing' does not exist; expected a run or sweep directory"),
        ("empty", "'empty' holds no csv/metrics.csv, neither itself nor in its subfolders"),
        ("header", "has no rows yet"),
        ("eval-run", "logged no values per epoch, nothing to plot (an eval run has test/ figures"),
    ],
)
def test_a_bad_run_dir_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, setup, expected) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    for name, text in (("header", ""), ("eval-run", "epoch,step,test/acc,test/loss\n0,0,0.9,0.3\n")):  # fmt: skip
        (tmp_path / name / "csv").mkdir(parents=True)
        (tmp_path / name / "csv" / "metrics.csv").write_text(text)
    (tmp_path / "empty").mkdir()
    assert plot.main([setup]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and expected in line
    assert not list(tmp_path.glob("**/*.png"))
