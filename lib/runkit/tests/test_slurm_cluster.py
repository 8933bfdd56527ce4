"""``scripts/slurm/train.sbatch`` on a one-host cluster (``scripts/slurm/cluster.sh start``);
rank 0 pauses at a known batch until the test has signalled, nothing is timed."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
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
SBATCH, CLUSTER = (
    TESTS.parents[2] / "scripts" / "slurm" / n for n in ("train.sbatch", "cluster.sh")
)
CONF = Path(os.environ.get("RUNKIT_SLURM_DIR", "/tmp/runkit-slurm")) / "slurm.conf"
# 2 ranks x 629 samples / 128 a batch: 5 steps an epoch, 10 in all; bit-identical on the CPU.
TRAIN = ("trainer.accelerator=cpu", "trainer.deterministic=true", "trainer.max_epochs=2",
         "model.scheduler.T_max=2", "data.batch_size=128", "callbacks.progress_bar.refresh_rate=0",
         "test=false", "export_weights=false")  # fmt: skip
STEPS = 10
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}
SITE = Path()  # the submit directory, set by the ``site`` fixture
OLDER = "older"  # the scancelled job, whose id comes again after a reset of the cluster


def env() -> dict[str, str]:
    return clean_env(SLURM_CONF=str(CONF), PYTHONPATH=str(TESTS), OMP_NUM_THREADS="1")


def slurm(*command: str) -> str:
    done = subprocess.run(command, cwd=SITE, env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(command)}: {done.stderr}"
    return done.stdout


@pytest.fixture(scope="module", autouse=True)
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A submit directory for train.sbatch; no cluster: a skip, a failure under CI."""
    global SITE
    sinfo = CONF.is_file() and shutil.which("sinfo") and ["sinfo", "-h"]
    if not sinfo or subprocess.run(sinfo, env=env(), capture_output=True).returncode:
        message = f"no SLURM cluster ({CONF}); start one with sudo {CLUSTER} start"
        pytest.fail(message) if os.environ.get("CI") == "true" else pytest.skip(message)
    SITE = tmp_path_factory.mktemp("slurm")
    (SITE / ".venv").symlink_to(sys.prefix)
    (SITE / "logs" / "slurm").mkdir(parents=True)
    return SITE


@contextmanager
def turn() -> Iterator[None]:
    """The cluster to one test at a time (``tests/test_slurm.py`` takes the same lock)."""
    with open(CONF.parent / "tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(autouse=True)
def _one_at_a_time(site: Path) -> Iterator[None]:
    with turn():
        yield


def submit(name: str, *overrides: str, options: tuple[str, ...] = ()) -> str:
    """``sbatch`` train.sbatch on 2 nodes; the job's id."""
    nodes = ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0")
    out = slurm("sbatch", "--parsable", f"--job-name={name}", *nodes, *options, str(SBATCH),
                *TRAIN, f"paths.log_dir={SITE / 'logs'}", *overrides)  # fmt: skip
    return out.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", slurm("scontrol", "show", "job", job_id)))


def wait(what: str, check: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + 600
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}: not after 600 s"
        time.sleep(0.3)
    return found


def ended(job_id: str, state: str = "COMPLETED") -> dict[str, str]:
    info = wait(f"job {job_id} to end", lambda: (i := job(job_id))["JobState"] in FINAL and i)
    assert info["JobState"] == state, info
    return info


def output(name: str, job_id: str) -> str:
    path = SITE / "logs" / "slurm" / f"{name}-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def pause(name: str, epoch: int = 1) -> list[str]:
    """Hold rank 0 at its first batch of ``epoch`` until released."""
    return [f"+callbacks.pause.{k}" for k in ("_target_=user_callbacks.Pause", "at=train",
            f"epoch={epoch}", f"marker={SITE / name}.pause")]  # fmt: skip


def hold_then(name: str, job_id: str, send: list[str], got: str) -> None:
    """At the pause: ``send``, wait for ``got`` in the job's output, go on."""
    marker = SITE / f"{name}.pause"
    wait(f"job {job_id} paused", lambda: marker.exists() or job(job_id)["JobState"] in FINAL)
    assert marker.exists(), output(name, job_id)[-3000:]
    if send:
        slurm(*send, job_id)
    wait(f"'{got}' from job {job_id}", lambda: got in output(name, job_id))
    Path(f"{marker}.release").touch()


def runs(job_id: str) -> list[Path]:
    return sorted((SITE / "logs" / "train" / "runs").glob(f"*slurm-{job_id}.0*"))


def same_weights(a: Path, b: Path) -> bool:
    first, second = (torch.load(r / "checkpoints" / "last.ckpt")["state_dict"] for r in (a, b))
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def reset_and_submit_older(name: str) -> str:
    """Forget every job (the next is job 1 again), submit one that holds its save."""
    sudo = ["sudo", "-n"] if os.geteuid() else []
    subprocess.run([*sudo, "bash", str(CLUSTER), "reset"], check=True, timeout=300)
    save = [f"+callbacks.hold.marker={SITE / OLDER}.save"]
    return submit(name, *pause(name, 0), "+callbacks.hold._target_=user_callbacks.HoldSave", *save)


@pytest.fixture(scope="module")
def cancelled() -> tuple[str, Path]:
    with turn():
        job_id = reset_and_submit_older(OLDER)
        Path(f"{SITE / OLDER}.save.release").touch()  # this job's save goes through
        hold_then(OLDER, job_id, ["scancel"], "SIGTERM received")
        wait("exit 143", lambda: "exit code 143" in output(OLDER, job_id))
        ended(job_id, "CANCELLED")
    (run,) = runs(job_id)
    return job_id, run


def test_scancel_saves_and_the_job_ends_cancelled_not_requeued(cancelled: tuple[str, Path]) -> None:
    job_id, run = cancelled
    assert job(job_id)["Restarts"] == "0"
    assert (run / "checkpoints" / "interrupted.ckpt").is_file()
    assert not (run / "metrics.json").exists()


@pytest.fixture(scope="module")
def reference() -> Path:
    """An uninterrupted 2-node run: the weights every interrupted run ends with."""
    with turn():
        ended(job_id := submit("reference"))
    (run,) = runs(job_id)
    assert metrics(run)["num_nodes"] == 2 and metrics(run)["global_step"] == STEPS
    assert "MEMBER: 2/2" in (run / "train_rank1.log").read_text()
    assert output("reference", job_id).count("Run directory:") == 1  # rank 0's; rank 1 is quiet
    return run


@pytest.mark.parametrize(
    ("how", "send", "got", "options"),
    [
        ("usr1", ["scancel", "-s", "USR1"], "SIGUSR1 received", ()),
        ("requeue", ["scontrol", "requeue"], "SIGTERM received", ()),
        # SLURM's SIGUSR1 10 s before the time limit; an attempt meeting it again requeues again
        ("limit", [], "SIGUSR1 received", ("--time=1", "--signal=SIGUSR1@10")),
    ],
)
def test_a_requeued_job_resumes_and_ends_with_the_weights_of_an_uninterrupted_run(
    reference: Path, how: str, send: list[str], got: str, options: tuple[str, ...]
) -> None:
    job_id = submit(how, *pause(how), options=options)
    hold_then(how, job_id, send, got)
    restarts = int(ended(job_id)["Restarts"])
    assert restarts >= 1 if options else restarts == 1
    first, again, *_ = done = runs(job_id)
    code = 143 if "SIGTERM" in got else 138
    assert f"exit code {code}" in output(how, job_id)
    assert metrics(again)["resumed_from"] == str(first / "checkpoints" / "interrupted.ckpt")
    assert again.name == f"{first.name}-requeue1"
    assert metrics(done[-1])["global_step"] == STEPS and same_weights(done[-1], reference)


def test_a_reused_job_id_gets_its_own_run_and_never_resumes_from_the_older_job(
    reference: Path, cancelled: tuple[str, Path]
) -> None:
    # job 1 again beside the older job 1's stopped run; requeued before it saved: afresh
    older_id, older = cancelled
    for stale in SITE.glob(f"{OLDER}.*"):
        stale.unlink()
    job_id = reset_and_submit_older(name := f"{OLDER}-again")
    assert job_id == older_id == "1"
    hold_then(name, job_id, ["scontrol", "requeue"], "SIGTERM received")
    assert ended(job_id)["Restarts"] == "1"
    first, again = [run for run in runs(job_id) if run != older]
    assert not list((first / "checkpoints").glob("*.ckpt"))  # killed while its save was held
    assert metrics(again)["resumed_from"] is None and metrics(again)["global_step"] == STEPS
    assert same_weights(again, reference)
    line = f"1 run(s) in {again.parent} ({older.name}...) are of an earlier job with this id"
    assert line in (again / "train.log").read_text()
    assert (older / "checkpoints" / "interrupted.ckpt").is_file()  # left as it was


def test_a_sweep_job_that_reaches_its_time_limit_resumes_in_its_folder_exactly() -> None:
    # hydra/launcher=slurm: job #0 pauses until SIGUSR2 10 s before its limit, saves, is
    # requeued and resumes; job #1 runs straight through; both end with the same weights
    sweep, marker = SITE / "sweep", SITE / "sweep.pause"
    command = [
        sys.executable, "-m", "project.train", "-m", "hydra/launcher=slurm",
        "hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=10",
        "hydra.launcher.array_parallelism=2", f"hydra.sweep.dir={sweep}", *TRAIN,
        "trainer.devices=1", "trainer.num_nodes=1", f"paths.log_dir={SITE / 'logs'}",
        "+callbacks.pause._target_=user_callbacks.Pause", "+callbacks.pause.at=train",
        f"+callbacks.pause.marker={marker}", "+callbacks.pause.epoch=1,99",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=SITE, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait("sweep job #0 paused", lambda: marker.exists() or process.poll() is not None)
        assert marker.exists(), process.communicate()[0][-3000:]
        logs = lambda: "".join(p.read_text() for p in sweep.glob(".submitit/*/*_log.*"))  # noqa: E731
        wait("SIGUSR2 before the time limit", lambda: "SIGUSR2 received" in logs())
        Path(f"{marker}.release").touch()
        out, _ = process.communicate(timeout=600)
    finally:
        process.kill()
    assert process.returncode == 0, out[-3000:]
    assert out.count("Bypassing sacct error") <= 1, out[-3000:]  # no accounting: said once
    stopped, straight = sweep / "0", sweep / "1"
    assert metrics(stopped)["resumed_from"] == str(stopped / "checkpoints" / "interrupted.ckpt")
    assert metrics(straight)["resumed_from"] is None
    assert metrics(stopped)["global_step"] == metrics(straight)["global_step"]
    assert same_weights(stopped, straight)
