"""benchmarks/loop_parity.py --parts: every profiled action lands in one part, exclusively."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import loop_parity  # noqa: E402


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
        (
            "[Callback]ModelCheckpoint{'monitor': 'val.acc', 'mode': 'max'}.on_train_epoch_end",
            "callback ModelCheckpoint: epoch hooks",
        ),
    ],
)
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
    """What measure_size returns, for two repeats with the template ``ratio`` times as fast as
    plain Lightning and the hand loop."""
    sample = {"_epochs": 2, "_actions": 400}
    template = {
        **sample,
        loop_parity.TRAINING_STEP: (0.2, 0.2),
        "callback FiniteLoss: batch hooks": (0.01, 0.01),
    }
    plain = {**sample, loop_parity.TRAINING_STEP: (0.2, 0.19)}
    epoch = {
        f"{arm}/epoch_{clock}": [100.0, 110.0]
        for arm in ("template", "plain", "hand", "parts", "plain_parts")
        for clock in ("wall", "cpu")
    }
    return {
        "size": size,
        "steps": 20,
        "ratios": {
            (first, second, clock): [ratio, ratio + 0.02]
            for first, second in (("template", "plain"), ("template", "hand"), ("plain", "hand"))
            for clock in ("wall", "cpu", "step")
        },
        "step_ms": 5.0,
        "epoch": epoch,
        "parts": {"template": [template] * parts, "plain": [plain] * parts},
        "hand_parts": {name: [(10.0, 9.0)] for name in ("steps", "validation", "save")},
    }


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
