"""benchmarks/: run_all.py keeps and compares every ratio a benchmark prints; loop_parity.py's
--parts puts every profiled action in one part, exclusively."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import _common  # noqa: E402
import loop_parity  # noqa: E402
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
    assert first == {"script": "loop_parity", "label": "wall clock", "median": 0.95, "min": 0.9,
                     "max": 1.1, "repeats": 3, "target": 0.95, "met": True}  # fmt: skip
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
    """run_all's file: a wall-clock ratio targeted at 1, a step one untargeted: (median, min, max)."""
    records = [
        {"label": "tiny / plain Lightning, wall clock", "target": 1.0, "met": wall[0] >= 1.0},
        {"label": "tiny median training step only", "target": None, "met": None},
    ]
    for record, figures in zip(records, (wall, step), strict=True):
        record.update(script="loop_parity", repeats=6, median=figures[0], min=figures[1],
                      max=figures[2])  # fmt: skip
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
    [(["--compare", "gone.json"], "gone.json: one or two existing result files"),
     (["--only", "startup,warp"], "unknown warp; known: loop_parity")],
)  # fmt: skip
def test_a_missing_file_or_an_unknown_benchmark_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    args: list[str], said: str,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["run_all.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        run_all.main()
    assert exit_info.value.code == 2 and said in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("action", "part"),
    [
        ("run_training_epoch", loop_parity.LIGHTNING_LOOP),
        ("save_checkpoint", loop_parity.CHECKPOINT),
        ("[_TrainingEpochLoop].train_dataloader_next", loop_parity.DATA),
        ("[_EvaluationLoop].val_next", loop_parity.DATA),
        ("[Strategy]SingleDeviceStrategy.training_step", loop_parity.TRAINING_STEP),
        ("[LightningModule]ClassifierModule.optimizer_step", loop_parity.TRAINING_STEP),
        ("[Strategy]SingleDeviceStrategy.validation_step", loop_parity.VALIDATION_STEP),
        ("[LightningModule]ClassifierModule.on_validation_epoch_end", loop_parity.MODULE_EPOCH_END),
        ("[Strategy]SingleDeviceStrategy.batch_to_device", loop_parity.LIGHTNING_HOOKS),
        ("[Callback]FiniteLoss.on_before_backward", "callback FiniteLoss: batch hooks"),
        ("[Callback]ModelCheckpoint{'monitor': 'val.acc', 'mode': 'max'}.on_train_epoch_end",
         "callback ModelCheckpoint: epoch hooks"),
    ],
)  # fmt: skip
def test_each_action_belongs_to_its_part(action: str, part: str) -> None:
    assert loop_parity.part_of(action) == part


def test_parts_are_exclusive_and_add_up_to_the_steady_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One clock for wall and CPU: the times at which the profiler reads it, in order.
    times = iter([0.0, 0.0, 1.0, 2.0, 4.0, 7.0, 10.0, 12.0])
    monkeypatch.setattr(loop_parity._common, "stamp", lambda: (t := next(times), t))
    loop_parity.PARTS.clear()
    profiler = loop_parity.parts_profiler()
    profiler.start("run_training_epoch")  # the warm-up epoch: not timed
    profiler.stop("run_training_epoch")
    profiler.start("run_training_epoch")  # the window opens at 0
    profiler.start("[Strategy]SingleDeviceStrategy.training_step")  # 1
    profiler.start("[Callback]FiniteLoss.on_before_backward")  # 2
    profiler.stop("[Callback]FiniteLoss.on_before_backward")  # 4
    profiler.stop("[Strategy]SingleDeviceStrategy.training_step")  # 7
    profiler.stop("run_training_epoch")  # 10
    profiler.start("[Callback]Clock.on_train_end")  # 12: the window closes
    (parts,) = loop_parity.PARTS
    assert parts[loop_parity.TRAINING_STEP] == (4.0, 4.0)  # 6 less the nested hook's 2
    assert parts["callback FiniteLoss: batch hooks"] == (2.0, 2.0)
    assert parts[loop_parity.LIGHTNING_LOOP] == (6.0, 6.0)  # 4 in the epoch's own code, 2 after
    named = sum(value[0] for name, value in parts.items() if not name.startswith("_"))
    assert named == 12.0 and parts["_epochs"] == 1


def _result(size: str, ratio: float, parts: bool) -> dict:
    """measure_size's result: two repeats, the template ``ratio`` times as fast as the others."""
    sample = {"_epochs": 2, "_actions": 400}
    template = {**sample, loop_parity.TRAINING_STEP: (0.2, 0.2),
                "callback FiniteLoss: batch hooks": (0.01, 0.01)}  # fmt: skip
    plain = {**sample, loop_parity.TRAINING_STEP: (0.2, 0.19)}
    arms = ("template", "plain", "hand", "parts", "plain_parts")
    pairs = (("template", "plain"), ("template", "hand"), ("plain", "hand"))
    return {
        "size": size, "steps": 20, "step_ms": 5.0,
        "ratios": {(a, b, clock): [ratio, ratio + 0.02] for a, b in pairs
                   for clock in ("wall", "cpu", "step")},
        "epoch": {f"{arm}/epoch_{clock}": [100.0, 110.0] for arm in arms for clock in ("wall", "cpu")},
        "parts": {"template": [template] * parts, "plain": [plain] * parts},
        "hand_parts": {name: [(10.0, 9.0)] for name in ("steps", "validation", "save")},
    }  # fmt: skip


def test_each_size_prints_its_ratios_and_parts_in_one_form_with_the_targets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    verdicts = loop_parity.print_size(_result("mid", 0.97, parts=False), {})
    lines = capsys.readouterr().out.splitlines()
    wall = next(line for line in lines if line.startswith("  mid / plain Lightning, wall clock"))
    assert wall.endswith("0.980   [0.970 .. 0.990]   target >= 1: NOT met")
    assert any(line.startswith("  mid / plain Lightning, CPU time") for line in lines)
    assert any(line.startswith("  mid / hand loop, wall clock") for line in lines)
    assert verdicts == [
        ("mid / plain Lightning, wall clock", 1.0, False),
        ("mid / plain Lightning, CPU time", 1.0, False),
        ("mid / hand loop, wall clock", 0.95, True),
        ("mid / hand loop, CPU time", 0.95, True),
    ]
    # tiny against the hand loop is reported, not targeted; parts: what the template spends
    # beyond plain Lightning, CPU ms an epoch (2 epochs, 20 steps): template, plain, beyond, a step
    tiny = [label for label, _, _ in loop_parity.print_size(_result("tiny", 1.0, True), {})]
    assert tiny == ["tiny / plain Lightning, wall clock", "tiny / plain Lightning, CPU time"]
    lines = capsys.readouterr().out.splitlines()
    for name, figures in (
        ("callback FiniteLoss: batch hooks", ["5.00", "0.00", "+5.00", "+0.250"]),
        ("training steps", ["100.00", "95.00", "+5.00", "+0.250"]),
        ("sum (the profiled epoch)", ["105.00", "95.00", "+10.00", "+0.500"]),
    ):
        line = next(line for line in lines if line.strip().startswith(name))
        assert line.split()[-5:-1] == figures, name
