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
