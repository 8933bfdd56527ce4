"""A DDP rank that dies ends the whole two-process CPU job in bounded time; last.ckpt still loads.

Rank 1 dying: Lightning's ``_ChildProcessObserver`` in rank 0 sees it within 5 s and kills the
job. Rank 0 dying: nothing in Lightning watches it; :func:`runkit.safety.interrupts.watch_parent`
makes the orphaned worker exit within about a second instead of waiting in a gloo collective.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import clean_env

DDP = (
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.max_epochs=500",
    "data.batch_size=32",
    "callbacks.progress_bar.refresh_rate=0",
    "test=false",
)


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["rank1", "rank0"])
def test_a_dying_rank_ends_the_job(tmp_path: Path, victim: str) -> None:
    log_dir = tmp_path / "logs"
    rank0 = subprocess.Popen(
        [sys.executable, "-m", "project.train", *DDP, f"paths.log_dir={log_dir}"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not list(log_dir.glob("train/runs/*/checkpoints/last.ckpt")):
            assert time.time() < deadline and rank0.poll() is None, "DDP training did not start"
            time.sleep(0.2)
        workers = children(rank0.pid)
        assert workers, "rank 0 started no worker process"
        rank1 = workers[0]
        os.kill(rank1 if victim == "rank1" else rank0.pid, signal.SIGKILL)
        survivor = rank0.pid if victim == "rank1" else rank1
        start = time.time()
        while alive(survivor) and time.time() - start < 60:
            if victim == "rank1":
                rank0.poll()
            time.sleep(0.2)
        assert not alive(survivor), f"the surviving rank was still running after 60 s ({victim})"
        if victim == "rank1":
            rank0.wait(timeout=10)
            assert rank0.returncode != 0
    finally:
        if rank0.poll() is None:
            rank0.kill()
        out = rank0.communicate(timeout=120)[0]
    if victim == "rank1":
        assert "another process of this 2-process job died" in out, out[-2000:]
    (last,) = log_dir.glob("train/runs/*/checkpoints/last.ckpt")
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] > 0
