"""The project end to end through its own command line, small: DDP training on two CPUs, then eval."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "project"
# The MLP on two processes: the CLI's whole code path at a fraction of the ConvNet's work; batches
# of 32 a process make the steps of one process's 64, and 3 epochs learn whatever the seed.
LEARNS = ("model=mlp", "trainer.max_epochs=3", "data.batch_size=32", "trainer.devices=2",
          "callbacks.progress_bar.refresh_rate=0")  # fmt: skip
# What a parent process (a DDP run, a test runner) may leave in the environment.
LEAKY = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def run(task: str, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LEAKY}
    args = [*overrides, f"paths.log_dir={cwd / 'logs'}"]
    command = [sys.executable, "-m", f"{PACKAGE}.{task}", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def only_run(log_dir: Path) -> Path:
    (run_dir,) = log_dir.iterdir()
    return run_dir


@pytest.mark.slow  # CLI end to end, two processes
def test_ddp_training_writes_one_run_and_eval_of_what_it_saved_gives_the_same_test_figures(
    tmp_path: Path,
) -> None:
    trained = run("train", *LEARNS, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    run_dir = only_run(tmp_path / "logs" / "train" / "runs")
    report = json.loads((run_dir / "metrics.json").read_text())
    assert report["devices"] == 2
    # It learned: far above chance (1 in 10), and the loss fell from where it started (ln 10).
    assert report["metrics"]["test/acc"] > 0.5
    assert report["metrics"]["train/loss"] < 0.5 * math.log(10)
    assert (run_dir / "model.pth").is_file() and (run_dir / "curves.png").is_file()

    evaluated = run("eval", f"ckpt_path={run_dir}", cwd=tmp_path)  # on one process
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    eval_dir = only_run(tmp_path / "logs" / "eval" / "runs")
    again = json.loads((eval_dir / "metrics.json").read_text())["metrics"]
    assert again["test/acc"] == report["metrics"]["test/acc"]
