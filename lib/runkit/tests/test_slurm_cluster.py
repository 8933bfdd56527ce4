"""SLURM for real: the project's own ``scripts/slurm/train.sbatch``, unmodified, on a one-host
cluster (``scripts/slurm/cluster.sh start``: slurmctld and two slurmd nodes of one CPU each).

Only sbatch options and Hydra overrides change on the command line. Every job holds rank 0 at a
known batch (``user_callbacks.Pause``) until the test has sent its signal and seen the job take
it, so no check depends on how fast this machine is; deadlines are generous, nothing is timed.
Without a cluster these tests skip, naming the script; under CI (``CI=true``) they fail.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import clean_env

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parents[2]
SBATCH, CLUSTER = (
    ROOT / "scripts" / "slurm" / "train.sbatch",
    ROOT / "scripts" / "slurm" / "cluster.sh",
)
CONF = Path(os.environ.get("RUNKIT_SLURM_DIR", "/tmp/runkit-slurm")) / "slurm.conf"
DEADLINE_S = 600.0
NODES = ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0")
# 2 ranks x 629 samples / 128 a batch: 5 steps an epoch, 10 in all; bit-identical on the CPU.
TRAIN = (
    "trainer.accelerator=cpu",
    "trainer.deterministic=true",
    "trainer.max_epochs=2",
    "model.scheduler.T_max=2",
    "data.batch_size=128",
    "callbacks.progress_bar.refresh_rate=0",
    "test=false",
    "export_weights=false",
)
STEPS = 10


def env() -> dict[str, str]:
    return clean_env(SLURM_CONF=str(CONF), PYTHONPATH=str(TESTS), OMP_NUM_THREADS="1")


def slurm(*command: str, cwd: Path | None = None) -> str:
    done = subprocess.run(command, cwd=cwd, env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(command)}: {done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A submit directory as train.sbatch expects one (``.venv``, ``logs/slurm``), on a cluster."""
    problem = None if CONF.is_file() else f"no {CONF}"
    try:
        up = problem or subprocess.run(["sinfo", "-h"], env=env(), capture_output=True, text=True)
        problem = problem or (up.returncode and (up.stderr.strip().splitlines() or ["sinfo"])[-1])
    except OSError as err:
        problem = str(err)
    if problem:
        message = f"no SLURM cluster ({problem}); start one with sudo {CLUSTER} start"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    site = tmp_path_factory.mktemp("slurm")
    (site / ".venv").symlink_to(sys.prefix)
    (site / "logs" / "slurm").mkdir(parents=True)
    return site


@contextmanager
def turn() -> Iterator[None]:
    """The cluster to one test at a time: the project's own slurm test (``tests/test_slurm.py``)
    shares it, and a reset here would lose its job (it takes the same lock)."""
    with open(CONF.parent / "tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(autouse=True)
def _one_at_a_time(site: Path) -> Iterator[None]:
    with turn():
        yield


def submit(site: Path, name: str, *overrides: str, options: tuple[str, ...] = ()) -> str:
    """``sbatch`` train.sbatch from ``site``; the job's id. ``name`` names its output file."""
    out = slurm("sbatch", "--parsable", f"--job-name={name}", *NODES, *options, str(SBATCH),
                *TRAIN, f"paths.log_dir={site / 'logs'}", *overrides, cwd=site)  # fmt: skip
    return out.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    text = slurm("scontrol", "show", "job", job_id)
    return dict(re.findall(r"(\w+)=(\S*)", text))


def wait(what: str, check: Callable[[], Any], deadline_s: float = DEADLINE_S) -> Any:
    """Poll ``check`` until it returns something true (which is returned)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"{what}: not after {deadline_s:.0f} s")


FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def ended(job_id: str, state: str = "COMPLETED") -> dict[str, str]:
    """Wait for the job to end; its record, which says ``state``."""
    info = wait(f"job {job_id} to end", lambda: (i := job(job_id))["JobState"] in FINAL and i)
    assert info["JobState"] == state, info
    return info


def reset_cluster() -> None:
    """Forget every job: the next one is job 1 again, as after a controller's state was lost."""
    sudo = ["sudo", "-n"] if os.geteuid() else []
    subprocess.run([*sudo, "bash", str(CLUSTER), "reset"], check=True, timeout=300)


def output(site: Path, name: str, job_id: str) -> str:
    path = site / "logs" / "slurm" / f"{name}-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def pause(site: Path, name: str, epoch: int = 1) -> tuple[list[str], Path]:
    """Hold rank 0 at its first batch of ``epoch`` (0: before any checkpoint) until released."""
    marker = site / f"{name}.pause"
    return [
        "+callbacks.pause._target_=user_callbacks.Pause",
        "+callbacks.pause.at=train",
        f"+callbacks.pause.epoch={epoch}",
        f"+callbacks.pause.marker={marker}",
    ], marker


def hold_then(site: Path, name: str, job_id: str, marker: Path, send: list[str], got: str) -> None:
    """At the pause: ``send``, wait until the job's output says ``got``, let rank 0 go on."""
    wait(f"job {job_id} paused", lambda: marker.exists() or job(job_id)["JobState"] in FINAL)
    assert marker.exists(), output(site, name, job_id)[-3000:]
    slurm(*send)
    wait(f"'{got}' from job {job_id}", lambda: got in output(site, name, job_id))
    Path(f"{marker}.release").touch()


def runs(site: Path, job_id: str) -> list[Path]:
    return sorted((site / "logs" / "train" / "runs").glob(f"*slurm-{job_id}.0*"))


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


def same_weights(a: Path, b: Path) -> bool:
    first, second = weights(a), weights(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


OLDER = "older"
"""The scancelled job, whose id comes again after a reset of the cluster."""


def hold_save(site: Path) -> list[str]:
    """Hold the save a stop signal asks for until ``<marker>.release``: the same in both jobs."""
    return [
        "+callbacks.hold._target_=user_callbacks.HoldSave",
        f"+callbacks.hold.marker={site / OLDER}.save",
    ]


@pytest.fixture(scope="module")
def cancelled(site: Path) -> tuple[str, Path]:
    """Job 1, cancelled (scancel) in its first epoch: its id and its run."""
    with turn():
        return _cancel_job_1(site)


def _cancel_job_1(site: Path) -> tuple[str, Path]:
    reset_cluster()
    hold, marker = pause(site, OLDER, epoch=0)
    job_id = submit(site, OLDER, *hold, *hold_save(site))
    Path(f"{site / OLDER}.save.release").touch()  # this job's save goes through
    hold_then(site, OLDER, job_id, marker, ["scancel", job_id], "SIGTERM received")
    wait("exit 143", lambda: "exit code 143" in output(site, OLDER, job_id))
    ended(job_id, "CANCELLED")
    (run,) = runs(site, job_id)
    return job_id, run


def test_scancel_saves_and_the_job_ends_cancelled_not_requeued(
    cancelled: tuple[str, Path],
) -> None:
    job_id, run = cancelled
    assert job(job_id)["Restarts"] == "0"
    assert (run / "checkpoints" / "interrupted.ckpt").is_file()
    assert not (run / "metrics.json").exists()


@pytest.fixture(scope="module")
def reference(site: Path) -> Path:
    """An uninterrupted 2-node run: the weights every interrupted run must end with."""
    with turn():
        job_id = submit(site, "reference")
        ended(job_id)
    (run,) = runs(site, job_id)
    return run


def test_two_nodes_train_one_run(site: Path, reference: Path) -> None:
    assert metrics(reference)["num_nodes"] == 2 and metrics(reference)["global_step"] == STEPS
    assert "MEMBER: 2/2" in (reference / "train_rank1.log").read_text()
    out = output(site, "reference", reference.name.split("_slurm-")[1].split(".")[0])
    assert out.count("Run directory:") == 1  # rank 0 says it; rank 1 trains quietly


@pytest.mark.parametrize(
    ("how", "send", "got", "code"),
    [
        ("usr1", ["scancel", "-s", "USR1"], "SIGUSR1 received", 138),
        ("requeue", ["scontrol", "requeue"], "SIGTERM received", 143),
    ],
)
def test_a_requeued_job_resumes_and_ends_with_the_weights_of_an_uninterrupted_run(
    site: Path, reference: Path, how: str, send: list[str], got: str, code: int
) -> None:
    hold, marker = pause(site, how)
    job_id = submit(site, how, *hold)
    hold_then(site, how, job_id, marker, [*send, job_id], got)
    assert ended(job_id)["Restarts"] == "1"
    first, again = runs(site, job_id)
    saved = first / "checkpoints" / "interrupted.ckpt"
    assert f"exit code {code}" in output(site, how, job_id)
    assert metrics(again)["resumed_from"] == str(saved)
    assert metrics(again)["global_step"] == STEPS
    assert again.name == f"{first.name}-requeue1"
    assert same_weights(again, reference)


def test_the_time_limit_saves_requeues_and_the_job_resumes_exactly(
    site: Path, reference: Path
) -> None:
    # --time=1: SLURM sends SIGUSR1 10 s before the minute is over; a resumed attempt that
    # meets the limit again is requeued again, and the chain ends where the reference did.
    hold, marker = pause(site, "limit")
    job_id = submit(site, "limit", *hold, options=("--time=1", "--signal=SIGUSR1@10"))
    wait("job paused", marker.exists)
    wait("SIGUSR1 at the limit", lambda: "SIGUSR1 received" in output(site, "limit", job_id))
    Path(f"{marker}.release").touch()
    assert int(ended(job_id)["Restarts"]) >= 1
    done = runs(site, job_id)[-1]
    assert metrics(done)["global_step"] == STEPS
    assert same_weights(done, reference)


def test_a_reused_job_id_gets_its_own_run_and_never_resumes_from_the_older_job(
    site: Path, reference: Path, cancelled: tuple[str, Path]
) -> None:
    # The controller's state is reset: it hands out job 1 again, while the older job 1's run
    # (stopped, with interrupted.ckpt, the same command) is still there. The new job is requeued
    # before it saved anything (its save is held until SLURM kills it): it starts afresh.
    older_id, older = cancelled
    reset_cluster()
    for stale in site.glob(f"{OLDER}.*"):
        stale.unlink()
    hold, marker = pause(site, OLDER, epoch=0)
    name = f"{OLDER}-again"
    job_id = submit(site, name, *hold, *hold_save(site))
    assert job_id == older_id == "1"
    hold_then(site, name, job_id, marker, ["scontrol", "requeue", job_id], "SIGTERM received")
    assert ended(job_id)["Restarts"] == "1"
    first, again = [run for run in runs(site, job_id) if run != older]
    assert not list((first / "checkpoints").glob("*.ckpt"))  # killed while its save was held
    assert metrics(again)["resumed_from"] is None
    assert metrics(again)["global_step"] == STEPS
    assert same_weights(again, reference)
    line = f"1 run(s) in {again.parent} ({older.name}...) are of an earlier job with this id"
    assert line in (again / "train.log").read_text()
    assert (older / "checkpoints" / "interrupted.ckpt").is_file()  # left as it was


def test_a_sweep_job_that_reaches_its_time_limit_resumes_in_its_folder_exactly(site: Path) -> None:
    # Two jobs through hydra/launcher=slurm (submitit), the same training: job #0 pauses until
    # SLURM's SIGUSR2 before its one-minute limit, saves, is requeued and resumes; job #1 runs
    # straight through. Both end with the same weights.
    sweep = site / "sweep"
    marker = site / "sweep.pause"
    command = [
        sys.executable, "-m", "project.train", "-m", "hydra/launcher=slurm",
        "hydra.launcher.timeout_min=1", "hydra.launcher.signal_delay_s=10",
        "hydra.launcher.array_parallelism=2", f"hydra.sweep.dir={sweep}", *TRAIN,
        "trainer.devices=1", "trainer.num_nodes=1", f"paths.log_dir={site / 'logs'}",
        "+callbacks.pause._target_=user_callbacks.Pause", "+callbacks.pause.at=train",
        f"+callbacks.pause.marker={marker}", "+callbacks.pause.epoch=1,99",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=site, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait("sweep job #0 paused", marker.exists)
        logs = lambda: "".join(p.read_text() for p in sweep.glob(".submitit/*/*_log.*"))  # noqa: E731
        wait("SIGUSR2 before the time limit", lambda: "SIGUSR2 received" in logs())
        Path(f"{marker}.release").touch()
        out, _ = process.communicate(timeout=DEADLINE_S)
    finally:
        process.kill()
    assert process.returncode == 0, out[-3000:]
    assert out.count("Bypassing sacct error") <= 1, out[-3000:]  # no accounting: said once
    stopped, straight = sweep / "0", sweep / "1"
    saved = stopped / "checkpoints" / "interrupted.ckpt"
    assert metrics(stopped)["resumed_from"] == str(saved)
    assert metrics(straight)["resumed_from"] is None
    assert metrics(stopped)["global_step"] == metrics(straight)["global_step"]
    assert same_weights(stopped, straight)
