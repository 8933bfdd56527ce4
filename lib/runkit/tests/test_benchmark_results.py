"""benchmarks/run_all.py keeps every ratio a benchmark prints, and compares runs by label."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import _common  # noqa: E402
import run_all  # noqa: E402


def test_a_printed_ratio_line_is_also_recorded_as_json_under_run_all_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(_common.RESULTS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    _common.ratio_line("x", [1.0])
    assert list(tmp_path.iterdir()) == []  # outside run_all: no record
    records = tmp_path / "ratios.jsonl"
    monkeypatch.setenv(_common.RESULTS_ENV, str(records))
    monkeypatch.setattr(sys, "argv", ["benchmarks/loop_parity.py"])
    line = _common.ratio_line("  wall clock", [0.9, 1.1, 0.95], target=0.95)
    _common.ratio_line("median step", [1.25])
    assert "0.950" in line and "met" in line
    first, second = (json.loads(text) for text in records.read_text().splitlines())
    assert first == {
        "script": "loop_parity",
        "label": "wall clock",
        "median": 0.95,
        "min": 0.9,
        "max": 1.1,
        "repeats": 3,
        "target": 0.95,
        "met": True,
    }
    assert second["median"] == 1.25 and second["met"] is None


def test_compare_pairs_ratios_by_script_and_label() -> None:
    def result(**medians: float) -> dict:
        ratios = [{"label": label, "median": m} for label, m in medians.items()]
        return {"scripts": {"startup": {"ratios": ratios}}}

    lines = run_all.compare(result(first_step=1.2, help=0.3), result(first_step=1.1, new=2.0))
    assert len(lines) == 3
    assert "startup: first_step" in lines[0] and "1.200 -> 1.100 (-0.100)" in lines[0]
    assert "startup: new" in lines[1] and "2.000 (now only)" in lines[1]
    assert "startup: help" in lines[2] and "0.300 (earlier only)" in lines[2]


def _results_file(path: Path, wall: tuple[float, ...], step: tuple[float, ...]) -> Path:
    """A results file as run_all writes it: a targeted wall-clock ratio (met when its median is
    at least 1) and an untargeted step ratio, each (median, min, max)."""
    records = [
        {"label": "tiny / plain Lightning, wall clock", "target": 1.0, "met": wall[0] >= 1.0},
        {"label": "tiny median training step only", "target": None, "met": None},
    ]
    for record, figures in zip(records, (wall, step), strict=True):
        record.update(
            script="loop_parity",
            repeats=6,
            **dict(zip(("median", "min", "max"), figures, strict=True)),
        )
    run = {"args": [], "exit_code": 0, "seconds": 1.0, "load_average": [1.0, 1.0]}
    path.write_text(json.dumps({"scripts": {"loop_parity": {**run, "ratios": records}}}))
    return path


def test_compare_two_files_shows_each_change_and_marks_a_regression(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    earlier = _results_file(tmp_path / "earlier.json", (1.02, 1.0, 1.05), (0.70, 0.60, 0.80))
    now = _results_file(tmp_path / "now.json", (0.97, 0.95, 0.99), (0.75, 0.70, 0.78))
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--compare", str(earlier), str(now)])
    assert run_all.main() == 0  # two files: compared, nothing run
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"change against {earlier}:"
    wall_line, step_line = out[1:]
    assert "1.020 -> 0.970 (-0.050)" in wall_line
    assert "outside the earlier [1.000 .. 1.050]" in wall_line
    assert "REGRESSION: target >= 1 met before, not now" in wall_line
    assert "0.700 -> 0.750 (+0.050)" in step_line  # inside the spread, no target: no mark
    assert "outside" not in step_line and "REGRESSION" not in step_line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--compare", "gone.json"], "gone.json: one or two existing result files"),
        (["--only", "startup,warp"], "unknown warp; known: loop_parity"),
    ],
)
def test_a_missing_file_or_an_unknown_benchmark_is_refused_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    said: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["run_all.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        run_all.main()
    assert exit_info.value.code == 2 and said in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
