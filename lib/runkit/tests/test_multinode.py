"""Multi-node DDP through Lightning's cluster environments, simulated by torchrun on localhost."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint
from test_fsdp import ZOO, evaluates_as_trained

import prewarmed
from conftest import CliRunner, clean_env, free_port, last_line, train_on_two_torchrun_nodes
from runkit.errors import RunError
from runkit.run import launch
from runkit.run.launch import launched_externally, rank_suffix, requeued_checkpoint, run_id
from runkit.safety import checkpoints

TINY = ("trainer.max_epochs=1", "data.batch_size=256", "+trainer.limit_val_batches=1",
        "callbacks.progress_bar.refresh_rate=0")  # fmt: skip


def test_run_id_names_the_launch_so_every_rank_agrees() -> None:
    slurm = {"SLURM_JOB_ID": "812", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0"}
    assert run_id("%Y", slurm) == "slurm-812.0"
    assert run_id("%Y", {**slurm, "SLURM_RESTART_COUNT": "1"}) == "slurm-812.0-requeue1"
    assert run_id("%Y", {"TORCHELASTIC_RUN_ID": "abc", "WORLD_SIZE": "4"}) == "torchrun-abc"
    restarted = {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert run_id("%Y", restarted) == "torchrun-abc-restart2"
    # one task: the timestamp, naming the job for a requeue
    year, single = time.strftime("%Y"), {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "1"}
    assert run_id("%Y", single) == f"{year}_slurm-9"
    assert run_id("%Y", {**single, "SLURM_RESTART_COUNT": "2"}) == f"{year}_slurm-9-requeue2"
    for env in ({}, {**single, "SLURM_JOB_ID": "../x"}, {**single, "SLURM_JOB_NAME": "bash"}):
        assert run_id("%Y", env) == year
    assert run_id("%Y", {"LOCAL_RANK": "1", "WORLD_SIZE": "2"}) == year
    for env in ({"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "2"}):
        with pytest.raises(RunError, match=r"pass hydra.run.dir=<dir>"):
            run_id("%Y", env)


def test_rank_suffix_and_external_launch_detection() -> None:
    assert rank_suffix({}) == "" and rank_suffix({"RANK": "0"}) == ""
    assert rank_suffix({"RANK": "3"}) == "_rank3"
    assert rank_suffix({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}) == "_rank1"
    assert not launched_externally({})
    assert launched_externally({"TORCHELASTIC_RUN_ID": "x"})
    assert launched_externally({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2"})
    assert not launched_externally({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"})


def make_run(runs: Path, name: str, overrides: str = "a=1", checkpoint: str = "last.ckpt") -> Path:
    (runs / name / ".hydra").mkdir(parents=True)
    (runs / name / ".hydra" / "overrides.yaml").write_text(f"- {overrides}\n")
    (runs / name / "checkpoints").mkdir()
    torch.save({"global_step": 1}, runs / name / "checkpoints" / checkpoint)
    time.sleep(0.02)  # the next one is newer
    return (runs / name / "checkpoints" / checkpoint).resolve()


def test_a_requeued_job_resumes_from_the_newest_checkpoint_of_the_same_command(
    tmp_path: Path,
) -> None:
    make_run(tmp_path, "2026-01-01_00-00_slurm-812")
    stopped = make_run(tmp_path, "2026-01-01_01-00_slurm-812", checkpoint="interrupted.ckpt")
    make_run(tmp_path, "2026-01-01_02-00_slurm-812", "a=2")  # another command
    make_run(tmp_path, "2026-01-01_03-00_slurm-8123")  # another job
    make_run(tmp_path, "2026-01-01_04-00_slurm-812").write_bytes(b"PK\x03\x04 cut")  # newest, cut
    current = tmp_path / "2026-01-02_00-00_slurm-812-requeue1"
    current.mkdir()
    env = {"SLURM_JOB_ID": "812", "SLURM_RESTART_COUNT": "1"}
    assert requeued_checkpoint(current, ["a=1"], env) == stopped
    assert requeued_checkpoint(current, ["a=1"], {"SLURM_JOB_ID": "812"}) is None  # not requeued
    assert requeued_checkpoint(current, ["other=1"], env) is None


def test_a_restarted_torchrun_group_resumes_from_its_own_launch_only(tmp_path: Path) -> None:
    mine = make_run(tmp_path, "torchrun-x")
    make_run(tmp_path, "torchrun-xy")  # another launch, newer
    make_run(tmp_path, "torchrun-x-restart1", "a=2")  # another command
    (tmp_path / "torchrun-x" / "checkpoints" / "broken.ckpt").write_bytes(b"PK")  # cut short
    env = {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "2", "RANK": "0"}
    current = tmp_path / "torchrun-x-restart2"
    assert requeued_checkpoint(current, ["a=1"], env) == mine
    assert requeued_checkpoint(current, ["a=1"], {**env, "TORCHELASTIC_RESTART_COUNT": "0"}) is None
    (tmp_path / "torchrun-x" / "metrics.json").write_text("{}")  # that run finished: a rerun
    with pytest.raises(RunError, match=r"--rdzv-id=x has run to its end already.*new --rdzv-id"):
        requeued_checkpoint(current, ["a=1"], env)


@pytest.mark.slow
def test_multi_process_launch_without_a_run_id_fails_in_one_line(tmp_path: Path) -> None:
    env = clean_env(WORLD_SIZE="2", TORCHELASTIC_RUN_ID="none", RANK="0", LOCAL_RANK="0")
    result = prewarmed.run(
        [sys.executable, "-m", "tinyapp.train", f"paths.log_dir={tmp_path}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "pass hydra.run.dir=<dir>" in last_line(result.stderr)
    assert not list(tmp_path.rglob(".hydra"))


@pytest.mark.slow
def test_two_torchrun_nodes_share_one_run_and_fsdp_shards_a_foreign_module_over_both(
    cli: CliRunner, tmp_path: Path
) -> None:
    # one mesh of 2 shards, 2 steps of 128 a rank; the zoo's own configure_model makes the layers
    shutil.copytree(ZOO, tmp_path / "zoo", ignore=shutil.ignore_patterns("__pycache__"))
    log_dir = tmp_path / "logs"
    outputs = train_on_two_torchrun_nodes(
        tmp_path, "nodes-test", "--config-dir", "zoo/configs", "experiment=zoo_lazy",
        "trainer=fsdp", "trainer.num_nodes=2", "trainer.devices=1", "trainer.accelerator=cpu",
        "data.batch_size=128", f"paths.log_dir={log_dir}", *TINY[:1], *TINY[2:],
    )  # fmt: skip
    (run,) = (log_dir / "train" / "runs").iterdir()
    assert run.name == "torchrun-nodes-test"
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in (run / "train_rank1.log").read_text()
    summary = json.loads((run / "metrics.json").read_text())
    assert (summary["num_nodes"], summary["global_step"]) == (2, 2)
    assert "Run directory:" in outputs[0] and "Run directory:" not in outputs[1]
    last = run / "checkpoints" / "last.ckpt"
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(checkpoints.manifest_names(last))
    assert checkpoints.damaged_files(last) is None
    keys = torch.distributed.checkpoint.FileSystemReader(str(last)).read_metadata()
    assert "state_dict.layers.0.weight" in keys.state_dict_metadata  # its own layers, sharded
    exported = set(torch.load(run / "model.pth", weights_only=True))
    assert exported == {f"layers.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")}
    evaluates_as_trained(cli, run, log_dir, "trusted_targets=[zoo.,torch.]")


# DDP x2 on the CPU, bit-identical: 629 training samples per rank, 5 steps an epoch.
ELASTIC = ("trainer=multi_node", "trainer.num_nodes=1", "trainer.devices=2",
           "trainer.accelerator=cpu", "trainer.deterministic=true", "trainer.max_epochs=2",
           "model.scheduler.T_max=2", "data.batch_size=128",
           "callbacks.progress_bar.refresh_rate=0", "test=false", "export_weights=false")  # fmt: skip


def torchrun(
    cwd: Path, rdzv_id: str, *overrides: str, restarts: int = 1
) -> subprocess.CompletedProcess:
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--max-restarts={restarts}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
        "-m", "tinyapp.train", *ELASTIC, f"paths.log_dir={cwd / 'logs'}", *overrides,
    ]  # fmt: skip
    env = clean_env(OMP_NUM_THREADS="1")
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_torchrun_restarts_after_a_killed_worker_continue_the_run_exactly(tmp_path: Path) -> None:
    shutil.copy(Path(__file__).parent / "resume_zoo.py", tmp_path)  # the user's callback
    straight = subprocess.run(
        [sys.executable, "-m", "tinyapp.train", *ELASTIC, f"paths.log_dir={tmp_path / 'straight'}"],
        cwd=tmp_path, env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    (straight_run,) = (tmp_path / "straight" / "train" / "runs").iterdir()

    # kill -9 of rank 1 two batches into epoch 1: torchrun restarts both ranks, which resume.
    kill = ["+callbacks.kill._target_=resume_zoo.KillRank", "+callbacks.kill.rank=1"]
    kill += ["+callbacks.kill.epoch=1", "+callbacks.kill.batch=2"]
    killed = torchrun(tmp_path, "el", *kill)
    output = killed.stdout + killed.stderr
    assert killed.returncode == 0, output[-3000:]
    runs = tmp_path / "logs" / "train" / "runs"
    first, again = runs / "torchrun-el", runs / "torchrun-el-restart1"
    line = f"torchrun restarted the group (restart 1 of 1): resuming from {first.resolve()}"
    assert output.count(line) == 1, output[-3000:]
    weights = [
        torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        for run in (straight_run, again)
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert json.loads((again / "metrics.json").read_text())["global_step"] == 10

    # the same rendezvous id names a finished run: one line a rank, no C++ frames
    rerun = torchrun(tmp_path, "el", *kill, restarts=0)
    assert rerun.returncode != 0
    errors = [line for line in rerun.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, rerun.stderr[-3000:]
    assert all("give torchrun a new --rdzv-id (not el)" in line for line in errors)
    assert "frame #" not in rerun.stderr and "Exception raised from" not in rerun.stderr


@pytest.mark.parametrize(
    ("squeue", "writes"),
    [pytest.param("2026-01-02T03:04:05|(null)", True, id="first-attempt-writes-its-start"),
     pytest.param("2026-01-02T09:00:00|user words runkit-start=2026-01-02T03:04:05", False,
                  id="requeued-reads-it")],
)  # fmt: skip
def test_a_slurm_job_is_known_by_its_first_start_not_by_its_id_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    squeue: str, writes: bool,
) -> None:  # fmt: skip
    bin_dir, calls = tmp_path / "bin", tmp_path / "bin" / "calls"
    bin_dir.mkdir()
    for name, body in (("squeue", f"echo '{squeue}'"), ("scontrol", f'echo "$@" >> {calls}')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(launch, "_first_starts", {})
    env = dict(SLURM_JOB_ID="812", SLURM_NTASKS="2", SLURM_STEP_ID="0", SLURM_CLUSTER_NAME="c")
    assert run_id("%Y-%m-%d_%H-%M-%S", env) == "2026-01-02_03-04-05_slurm-812.0"
    requeued = {**env, "SLURM_RESTART_COUNT": "1"}
    assert run_id("%Y-%m-%d_%H-%M-%S", requeued) == "2026-01-02_03-04-05_slurm-812.0-requeue1"
    expected = "update job=812 comment=runkit-start=2026-01-02T03:04:05\n" if writes else None
    assert (calls.read_text() if calls.exists() else None) == expected

    # an older job's checkpoint of the same command is not this job's: it starts afresh
    runs, first = tmp_path / "runs", "2026-01-02T03:04:05"
    older = make_run(runs, "2025-12-01_00-00-00_slurm-812.0", checkpoint="interrupted.ckpt")
    own = make_run(runs, f"{first}_slurm-812.0").parent.parent
    (older.parent.parent / "slurm_job").write_text("c:812:2025-12-01T00:00:00")
    (own / "slurm_job").write_text(f"c:812:{first}")
    (own / "checkpoints" / "last.ckpt").unlink()
    current = runs / "x-requeue1"
    current.mkdir()
    with caplog.at_level(logging.INFO, logger=launch.log.name):
        assert requeued_checkpoint(current, ["a=1"], requeued) is None
    assert (current / "slurm_job").read_text() == f"c:812:{first}\n"
    line = (
        f"1 run(s) in {runs.resolve()} (2025-12-01_00-00-00_slurm-812.0...) are of an earlier job"
    )
    assert any(line in message for message in caplog.messages)
    # The job's own checkpoint, once it has one, is what it resumes from.
    torch.save({}, own / "checkpoints" / "last.ckpt")
    found = requeued_checkpoint(current, ["a=1"], requeued)
    assert found == (own / "checkpoints" / "last.ckpt").resolve()
