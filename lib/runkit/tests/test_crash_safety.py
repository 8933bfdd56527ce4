"""kill -9 leaves a loadable last.ckpt; a full disk or a vanished run directory is one line."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from conftest import clean_env, last_line, run_entry
from runkit.safety.checkpoints import (
    AtomicCheckpointIO,
    CheckpointSaveError,
    full_disk_in_one_line,
    save_weights,
)
from runkit.safety.writes import FileWriteError

DRIVER = r"""
import json, os, random, signal, sys, time
from pathlib import Path
import torch
import hydra, lightning.pytorch  # the heavy imports happen once, here, not in every round
import tinyapp.train, runkit.run.builders, runkit.safety.checkpoints, runkit.gpus.resolve, runkit.run.preflight
import tinyapp.data, tinyapp.models

log_dir, rounds = Path(sys.argv[1]), int(sys.argv[2])
random.seed(1234)
overrides = [
    f"paths.log_dir={log_dir}", "model=mlp", "model.net.hidden=[32]", "data.batch_size=32",
    "trainer.max_epochs=1000", "trainer.accelerator=cpu", "test=false", "export_weights=false",
    "logger=none", "callbacks.progress_bar.refresh_rate=0", "callbacks.model_checkpoint.monitor=null",
    "callbacks.model_checkpoint.every_n_epochs=null",
    "+callbacks.model_checkpoint.every_n_train_steps=1",
]
results, previous, previous_step = [], None, -1
for index in range(rounds):
    run = log_dir / f"round_{index:02d}"
    extra = [f"hydra.run.dir={run}"] + ([f"ckpt_path={previous}"] if previous else [])
    pid = os.fork()
    if pid == 0:
        sys.argv = ["train", *overrides, *extra]
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1); os.dup2(devnull, 2)
        try:
            tinyapp.train.main()
        finally:
            os._exit(0)
    last = run / "checkpoints" / "last.ckpt"
    deadline = time.time() + 60
    while not last.exists() and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(random.uniform(0.0, 0.8))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    try:
        step = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
        error = None
    except Exception as err:  # reported, and the test fails
        step, error = None, f"{type(err).__name__}: {err}"
    results.append({"round": index, "step": step, "started_from": previous_step, "error": error})
    if error:
        break
    previous, previous_step = last, step
print(json.dumps(results))
"""


@pytest.mark.slow
def test_kill_9_four_times_leaves_a_loadable_resumable_last_ckpt(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "logs"), "4"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 4, results
    for result in results:
        assert result["error"] is None, result
        assert result["step"] > result["started_from"], result


def test_write_is_in_the_target_directory_not_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A TMPDIR that cannot be written: Lightning's own save would stage its bytes there.
    monkeypatch.setenv("TMPDIR", str(tmp_path / "missing" / "tmp"))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    target = tmp_path / "ckpts" / "a.ckpt"
    AtomicCheckpointIO().save_checkpoint({"x": torch.ones(3)}, target)
    assert torch.equal(torch.load(target, weights_only=True)["x"], torch.ones(3))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``small_disk(kib)``: a fresh tmpfs of that size (a real full disk, as ENOSPC comes)."""
    point = tmp_path / "small disk é"

    def mount(kib: int) -> Path:
        point.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs (a real full disk) needs root")
        command = ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(point)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        return point

    yield mount
    subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)


def fill_with_checkpoints(directory: Path) -> tuple[list[Path], CheckpointSaveError]:
    """Save 40 kB checkpoints until the disk is full; the saved ones and the error."""
    io, saved = AtomicCheckpointIO(), []
    for epoch in range(100):
        path = directory / f"epoch_{epoch:03d}.ckpt"
        try:
            io.save_checkpoint({"epoch": epoch, "w": torch.randn(10_000)}, path)
        except CheckpointSaveError as err:
            return saved, err
        saved.append(path)
    raise AssertionError("the small disk never filled up")


def test_every_write_of_a_run_on_a_full_disk_is_one_line(small_disk: Callable[[int], Path]) -> None:
    run = small_disk(256) / "run"
    checkpoints = run / "checkpoints"
    saved, error = fill_with_checkpoints(checkpoints)
    message = str(error)
    assert saved, "not one checkpoint fitted"
    assert "\n" not in message
    assert message.startswith("the disk is full: could not write checkpoint")
    assert str(checkpoints / f"epoch_{len(saved):03d}.ckpt") in message  # where
    kept = f"the last good checkpoint is {str(saved[-1])!r}"
    assert message.endswith(kept)
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.ENOSPC
    for epoch, path in enumerate(saved):
        assert torch.load(path, weights_only=True)["epoch"] == epoch
    assert not list(checkpoints.glob(".*.tmp"))
    # overwriting a checkpoint (last.ckpt) keeps its previous version
    with pytest.raises(CheckpointSaveError) as info:
        AtomicCheckpointIO().save_checkpoint({"w": torch.randn(50_000)}, saved[0])
    assert f"the last good checkpoint is {str(saved[0])!r}" in str(info.value)
    assert torch.load(saved[0], weights_only=True)["epoch"] == 0
    # model.pth export, and config.yaml / metrics.json (the same crash-safe writer)
    with pytest.raises(FileWriteError) as info, full_disk_in_one_line(run):
        save_weights(torch.nn.Linear(200, 200), run / "model.pth")
    assert str(info.value).startswith(
        f"the disk is full: could not write {str(run / 'model.pth')!r}"
    )
    assert str(info.value).endswith(kept)
    assert not (run / "model.pth").exists() and not list(run.glob(".*.tmp"))
    # a logger's plain write (Lightning's CSV log): an OSError with no file name
    with (
        pytest.raises(FileWriteError) as info,
        full_disk_in_one_line(run),
        (run / "metrics.csv").open("a") as handle,
    ):
        handle.write("0.5," * 100_000)
    assert str(info.value).startswith("the disk is full: could not write the run's files")
    assert str(run) in str(info.value) and str(info.value).endswith(kept)
    # Lightning ends a failed fit by flushing its loggers: their error must not hide the first one
    with pytest.raises(CheckpointSaveError) as info, full_disk_in_one_line(run):
        try:
            raise fill_with_checkpoints(run / "checkpoints")[1]
        except CheckpointSaveError:
            with (run / "metrics.csv").open("a") as handle:
                handle.write("0.5," * 100_000)
    assert str(info.value).startswith("the disk is full: could not write checkpoint")


FULL_DISK_RUNS = {
    # the case: not even the first checkpoint fits (the default ConvNet)
    "no-checkpoint-fits": (300, ["trainer.max_epochs=1"]),
    # two epochs' checkpoints fit (the MLP's are ~640 kB), the third does not
    "two-checkpoints-fit": (
        1700,
        [
            "model=mlp",
            "trainer.max_epochs=3",
            "callbacks.model_checkpoint.monitor=null",
            "callbacks.model_checkpoint.save_top_k=-1",
        ],
    ),
}


def failed_run(cwd: Path, *overrides: str) -> str:
    args = ["data.batch_size=256", "callbacks.progress_bar.refresh_rate=0", *overrides]
    done = run_entry(cwd, "train", *args, timeout=600)
    subprocess.run(["umount", "-l", str(cwd / "run é")], capture_output=True, check=False)
    assert done.returncode == 4, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Error executing job" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [last_line(done.stderr)], errors
    return errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL_DISK_RUNS, ids=list(FULL_DISK_RUNS))
def test_training_on_a_full_disk_ends_in_one_line(
    small_disk: Callable[[int], Path], case: str
) -> None:
    kib, overrides = FULL_DISK_RUNS[case]
    disk = small_disk(kib)
    line = failed_run(disk.parent, f'paths.log_dir="{disk / "logs"}"', *overrides)
    assert line.startswith("error: the disk is full: could not write checkpoint"), line
    assert str(disk) in line
    assert not list(disk.rglob(".*.tmp"))
    if case == "no-checkpoint-fits":
        assert line.endswith("no checkpoint was kept before it"), line
        return
    remains = Path(line.split("the last good checkpoint is ")[1].strip("'"))
    assert torch.load(remains, weights_only=True)["epoch"] == 1


TAKE_AWAY = """
import shutil, subprocess
from pathlib import Path
from lightning.pytorch import Callback

class TakeAway(Callback):
    def __init__(self, folder, how):
        self.folder, self.how = Path(folder), how

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch != 1:
            return
        if self.how == "made-read-only":  # a read-only mount of it over it (root ignores chmod)
            folder = str(self.folder)
            subprocess.run(["mount", "--bind", "-o", "ro", folder, folder], check=True)
            return
        shutil.rmtree(self.folder)
        if self.how == "a-file-in-its-place":
            self.folder.write_text("not a directory")
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["deleted", "a-file-in-its-place", "made-read-only"])
def test_a_run_directory_taken_away_mid_run_is_an_environment_failure(
    tmp_path: Path, how: str
) -> None:
    if how == "made-read-only" and os.geteuid() != 0:
        pytest.skip("a read-only mount needs root")
    (tmp_path / "take_away.py").write_text(TAKE_AWAY)
    run = tmp_path / "run é"
    line = failed_run(
        tmp_path, f'hydra.run.dir="{run}"', "model=mlp", "trainer.max_epochs=2",
        "+callbacks.take_away._target_=take_away.TakeAway", f'+callbacks.take_away.folder="{run}"',
        f"+callbacks.take_away.how={how}",
    )  # fmt: skip
    assert f"{run}/" in line, line
