"""Ctrl-C (SIGINT) and SIGTERM during training: a checkpoint, the command that resumes, exit 128+N."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

import prewarmed
from conftest import TESTS, clean_env, last_line, run_dirs, run_python
from runkit.safety import interrupts, signals
from runkit.safety.interrupts import GracefulInterrupt, resume_command

SLOW_TRAINING = (
    "trainer.accelerator=cpu",
    "trainer.max_epochs=200",
    "data.batch_size=64",
    "callbacks.progress_bar.refresh_rate=0",
    "test=false",
)


@pytest.mark.slow
def test_ctrl_c_saves_prints_the_resume_command_and_the_command_resumes(tmp_path: Path) -> None:
    # SIGTERM's save and line in one process: test_signals.test_one_stop_delivered_...
    log_dir = tmp_path / "logs"
    process = subprocess.Popen(
        [sys.executable, "-m", "tinyapp.train", *SLOW_TRAINING, f"paths.log_dir={log_dir}"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while not (found := list(log_dir.glob("train/runs/*/checkpoints/last.ckpt"))):
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.1)
    run = found[0].parent.parent
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=180)
    assert process.returncode == 130, err[-2000:]
    saved = run / "checkpoints" / "interrupted.ckpt"
    state = torch.load(saved, map_location="cpu", weights_only=True)
    assert state["global_step"] > 0 and "SIGINT received" in err
    command = next(line.strip() for line in (out + err).splitlines() if "ckpt_path=" in line)
    assert command.startswith(f"PYTHONPATH={TESTS} python -m tinyapp.train ")
    assert command.endswith(f"ckpt_path={saved}")
    assert all(override in command for override in SLOW_TRAINING)

    # The printed command resumes (to the end of the stopped epoch, for the test).
    argv = [a for a in shlex.split(command)[2:] if not a.startswith("trainer.max_epochs=")]
    argv.append(f"trainer.max_epochs={state['epoch'] + 1}")
    resumed = prewarmed.run(
        [sys.executable, *argv], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
        timeout=400,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    (new_run,) = [d for d in run_dirs(log_dir) if d != run]
    assert f"Resuming from {saved}" in (new_run / "train.log").read_text()


def test_resume_command_keeps_overrides_and_replaces_ckpt_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py", "trainer.max_epochs=3", "ckpt_path=old", "a=b c"])
    command = resume_command(Path("/runs/x/checkpoints/interrupted.ckpt"))
    assert "ckpt_path=old" not in command
    assert command.endswith(
        "trainer.max_epochs=3 'a=b c' ckpt_path=/runs/x/checkpoints/interrupted.ckpt"
    )


LATE_SIGNAL = """
import os, signal, time
from runkit.safety import signals
with signals.stop_on_signal(until_exit=True):
    pass  # the run is done; what follows is the process shutting down
os.kill(os.getpid(), signal.SIGINT)
time.sleep(30)
print("not reached")
"""


def test_a_ctrl_c_while_a_finished_run_shuts_down_is_one_line_and_130() -> None:
    # Issue #25.5: a Ctrl-C after "Run directory:" ended the process by the signal, silently.
    done = run_python(LATE_SIGNAL, timeout=60)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: SIGINT received after the run had finished (its files are complete); exit code 130"
    )


LOOPS = ("train", "validation", "test", "predict")


class SignalOnce(Callback):
    """Sends this process SIGTERM as batch ``batch`` of loop ``at`` ends (``sanity``: fit's
    sanity check), and counts the batches that end in each loop."""

    def __init__(self, at: str, batch: int) -> None:
        self.at, self.batch, self.sent = at, batch, False
        self.ended = dict.fromkeys(("sanity", *LOOPS), 0)

    def _end(self, trainer: Trainer, loop: str, batch_idx: int) -> None:
        loop = "sanity" if trainer.sanity_checking else loop
        self.ended[loop] += 1
        if (loop, batch_idx) == (self.at, self.batch) and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


for _loop in LOOPS:  # the same hook in every loop
    setattr(
        SignalOnce, f"on_{_loop}_batch_end", lambda s, t, m, o, b, i, *a, _l=_loop: s._end(t, _l, i)
    )

SAVED = "at epoch 1, step 4; saved {saved}"
STOPS = {
    # case: (what the trainer runs, the loop and batch where the signal comes, the batches that
    # end in each loop, how the line ends)
    "training": ("fit", "train", 1, {"sanity": 2, "train": 2}, "at epoch 0, step 2; saved {saved}"),
    # the sanity check's last batch: fit went on to train one step and saved it
    "sanity check": (
        "fit",
        "sanity",
        1,
        {"sanity": 2},
        "before the first training step (nothing to save)",
    ),
    # the validation after the last training batch ends first, then the epoch
    "training's last batch": ("fit", "train", 3, {"sanity": 2, "train": 4, "validation": 4}, SAVED),
    "fit's validation": ("fit", "validation", 0, {"sanity": 2, "train": 4, "validation": 4}, SAVED),
    "validate": ("validate", "validation", 0, {"validation": 1}, ""),
    "test": ("test", "test", 0, {"test": 1}, ""),
    "predict": ("predict", "predict", 0, {"predict": 1}, ""),
}


@pytest.mark.parametrize("case", list(STOPS))
def test_a_stop_ends_every_loop_at_the_next_batch(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py"])  # the resume command reads it, not pytest's
    fn, at, batch, ended, end = STOPS[case]
    probe = SignalOnce(at, batch)
    limits = {f"limit_{loop}_batches": 4 for loop in ("train", "val", "test", "predict")}
    trainer = Trainer(
        accelerator="cpu", max_epochs=3, num_sanity_val_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, callbacks=[probe, GracefulInterrupt()], **limits,
    )  # fmt: skip
    with pytest.raises(SystemExit) as stop, signals.stop_on_signal(), interrupts.phase(fn, trainer):
        getattr(trainer, fn)(BoringModel())
    assert stop.value.code == 143
    assert {loop: n for loop, n in probe.ended.items() if n} == ended
    saved = tmp_path / "checkpoints" / interrupts.INTERRUPTED_FILE
    assert saved.exists() == ("saved" in end)
    tail = f" {end.format(saved=saved)}" if end else ""
    line = f"stopped by SIGTERM during {fn}{tail}; exit code 143"
    assert last_line(capsys.readouterr().err) == line
