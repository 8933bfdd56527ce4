"""A kill -9 at any moment leaves a last.ckpt that loads and resumes.

One driver process imports torch and Lightning once, then forks a training run per round (the
real Hydra entry point, saving a checkpoint every step), kills it with SIGKILL at a random moment
after its first checkpoint, and checks that ``last.ckpt`` loads with ``weights_only=True``. Each
round resumes from the previous round's ``last.ckpt``, so "it resumes" is checked 20 times too:
a round passes only when its own ``last.ckpt`` shows a later step than the one it started from.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import clean_env
from project.machinery.safety.checkpoints import AtomicCheckpointIO

DRIVER = r"""
import json, os, random, signal, sys, time
from pathlib import Path
import torch
import hydra, lightning.pytorch  # the heavy imports happen once, here, not in every round
import project.train, project.machinery.run.builders, project.machinery.safety.checkpoints, project.machinery.gpus.devices, project.machinery.run.preflight
import project.data.digits, project.models.classifier, project.models.nets

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
            project.train.main()
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
def test_kill_9_twenty_times_leaves_a_loadable_resumable_last_ckpt(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "logs"), "20"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 20, results
    for result in results:
        assert result["error"] is None, result
        assert result["step"] > result["started_from"], result


def test_failed_write_leaves_the_old_checkpoint_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": torch.tensor(1)}, target)
    before = target.read_bytes()
    monkeypatch.setenv("PROJECT_FAIL_CHECKPOINT_WRITES", "ENOSPC")
    with pytest.raises(Exception, match="No space left on device") as info:
        io.save_checkpoint({"step": torch.tensor(2)}, target)
    assert "the previous checkpoint files are unchanged" in str(info.value)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert torch.load(target, weights_only=True)["step"] == 1


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
