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


def test_a_printed_ratio_line_is_also_recorded_as_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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


def test_no_record_is_written_outside_run_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(_common.RESULTS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    _common.ratio_line("x", [1.0])
    assert list(tmp_path.iterdir()) == []


def test_compare_pairs_ratios_by_script_and_label() -> None:
    def result(**medians: float) -> dict:
        ratios = [{"label": label, "median": m} for label, m in medians.items()]
        return {"scripts": {"startup": {"ratios": ratios}}}

    lines = run_all.compare(result(first_step=1.2, help=0.3), result(first_step=1.1, new=2.0))
    assert len(lines) == 1
    assert "startup: first_step" in lines[0] and "1.200 -> 1.100 (-0.100)" in lines[0]


def test_an_unknown_benchmark_name_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--only", "startup,warp"])
    with pytest.raises(SystemExit) as exit_info:
        run_all.main()
    assert exit_info.value.code == 2
    assert "unknown warp; known: loop_parity" in capsys.readouterr().err
