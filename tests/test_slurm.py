"""The project's own scripts/slurm/train.sbatch on a SLURM cluster: two nodes train one run.

A one-host cluster for it: ``sudo bash scripts/slurm/cluster.sh start`` (CI's slurm job does it).
Without a cluster this skips with a reason; under CI (``CI=true``) it fails instead.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = Path(os.environ.get("RUNKIT_SLURM_DIR", "/tmp/runkit-slurm")) / "slurm.conf"


@pytest.mark.slurm
@pytest.mark.slow
def test_train_sbatch_trains_one_run_on_two_nodes(tmp_path: Path) -> None:
    env = {**os.environ, "SLURM_CONF": str(CONF), "OMP_NUM_THREADS": "1"}
    sinfo = CONF.is_file() and shutil.which("sinfo") and ["sinfo", "-h"]
    if not sinfo or subprocess.run(sinfo, env=env, capture_output=True).returncode:
        message = "no SLURM cluster; start one with sudo bash scripts/slurm/cluster.sh start"
        pytest.fail(message) if os.environ.get("CI") == "true" else pytest.skip(message)
    (tmp_path / ".venv").symlink_to(sys.prefix)  # what train.sbatch activates
    (tmp_path / "logs" / "slurm").mkdir(parents=True)
    sbatch = ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
              "--gpus-per-node=0", str(ROOT / "scripts" / "slurm" / "train.sbatch"),
              "trainer.accelerator=cpu", "trainer.max_epochs=1", "data.batch_size=256", "test=false",
              "callbacks.progress_bar.refresh_rate=0", f"paths.log_dir={tmp_path / 'logs'}"]  # fmt: skip
    run = {"cwd": tmp_path, "env": env, "capture_output": True, "text": True}
    with open(CONF.parent / "tests.lock", "w") as lock:  # tests sharing the cluster take turns
        fcntl.flock(lock, fcntl.LOCK_EX)
        job = subprocess.run(sbatch, check=True, **run).stdout.strip()
        deadline, state = time.monotonic() + 600, ""
        while time.monotonic() < deadline and state not in ("COMPLETED", "FAILED", "CANCELLED"):
            time.sleep(1)
            show = subprocess.run(["scontrol", "show", "job", job], **run).stdout
            state = show.split("JobState=")[1].split()[0] if "JobState=" in show else ""
    assert state == "COMPLETED", (tmp_path / "logs" / "slurm" / f"train-{job}.out").read_text()
    (run_dir,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    assert json.loads((run_dir / "metrics.json").read_text())["num_nodes"] == 2
