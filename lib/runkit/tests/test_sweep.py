"""``hydra/launcher=parallel``: jobs at once, GPU claims between them, stops, resumes, summaries."""

from __future__ import annotations

import csv
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CliRunner, clean_env, user_config_dir
from runkit.errors import RunError
from runkit.run import sweep
from runkit.run.sweep import Attempt

TESTS = Path(__file__).resolve().parent
TINY = (
    "trainer.max_epochs=2",
    "+trainer.limit_train_batches=3",
    "+trainer.limit_val_batches=1",
    "+trainer.limit_test_batches=1",
    "data.batch_size=64",
    "callbacks.progress_bar.refresh_rate=0",
)


def test_a_job_command_runs_one_job_in_its_folder_and_the_jobs_own_values_win() -> None:
    command = sweep.job_command(
        ["python", "-m", "tinyapp.train"],
        ["model.optimizer.lr=0.1", "select_gpus=first"],
        ["hydra/launcher=parallel", "hydra.mode=MULTIRUN", "hydra.sweep.dir=/s"],
        {"select_gpus": "least_used", "gpu_wait_s": 60},
        Path("/s/a b é/3"),
        3,
    )
    assert command == [
        "python", "-m", "tinyapp.train", "model.optimizer.lr=0.1",
        "select_gpus=first",  # the job's own value, not the launcher's
        "gpu_wait_s=60", "hydra/launcher=parallel", "hydra.sweep.dir=/s",
        'hydra.run.dir="/s/a b é/3"', "hydra.job.num=3", "hydra.job.id=3", "hydra.mode=RUN",
    ]  # fmt: skip


@pytest.mark.parametrize("value", [0, -2, 1.5, "four", True])
def test_n_jobs_must_be_a_positive_integer(value) -> None:
    with pytest.raises(RunError, match=rf"hydra.launcher.n_jobs={value!r} is invalid; expected"):
        sweep.check_n_jobs(value)
    assert sweep.check_n_jobs(None) is None and sweep.check_n_jobs(3) == 3


def test_n_jobs_defaults_to_the_visible_gpus(use_fake) -> None:
    from runkit.testing.fake_nvml import FakeGpu, FakeNvml

    assert sweep.default_n_jobs({}) == 1  # no NVML in this process: no GPU
    use_fake(FakeNvml([FakeGpu(), FakeGpu(), FakeGpu()]))
    assert sweep.default_n_jobs({}) == 3
    assert sweep.default_n_jobs({"CUDA_VISIBLE_DEVICES": "0,2"}) == 2


def test_a_damaged_state_file_is_one_line_and_a_job_follows_its_sweep(tmp_path: Path) -> None:
    (tmp_path / sweep.STATE_FILE).write_text('{"attempts": [{"num": ')
    with pytest.raises(RunError, match=r"sweep_state.json' is damaged .*another hydra.sweep.dir"):
        sweep.load_attempts(tmp_path)
    env = {sweep.PARENT_ENV: str(os.getppid())}
    sweep.follow_sweep_parent(env)  # its parent: the job goes on
    assert sweep.PARENT_ENV not in env  # and its own DDP ranks follow it, not the sweep
    with pytest.raises(SystemExit) as stopped:
        sweep.follow_sweep_parent({sweep.PARENT_ENV: "1"})  # the sweep is gone already
    assert stopped.value.code == 128 + signal.SIGTERM


def test_the_summary_has_a_row_per_job_with_all_its_attempts(tmp_path: Path) -> None:
    def run(name: str, acc: float | None = None) -> str:
        (tmp_path / name).mkdir()
        if acc is not None:
            record = {"metrics": {"val/acc": acc}, "monitor": "val/acc", "best_score": acc + 0.1}
            record["energy"] = {"energy_j": 12.5}
            (tmp_path / name / "metrics.json").write_text(json.dumps(record))
        return str(tmp_path / name)

    attempts = [
        Attempt(0, ["lr=0.1", "e=2"], run("0", 0.5), "l0", "finished", 0, 10, 30),
        Attempt(1, ["lr=0.2", "e=2"], run("1"), "l1", "interrupted", 143, 10, 15),
        Attempt(2, ["lr=0.3", "e=2"], run("2"), "l2", "failed", 1, 11, 12),
        Attempt(1, ["lr=0.2", "e=2"], run("1-attempt2", 0.7), "l", "finished", 0, 40, 50),
    ]
    rows = sweep.job_rows(attempts, not_started=[["lr=0.4", "e=2"]])
    table = list(csv.DictReader(sweep.write_summary(tmp_path, rows).open()))
    assert [(r["job"], r["status"], r["attempts"]) for r in table] == [
        ("0", "finished", "1"),
        ("1", "finished", "2"),
        ("2", "failed", "1"),
        ("", "not started", ""),
    ]
    second = table[1]
    assert second["overrides"] == "lr=0.2 e=2" and second["val/acc"] == "0.7"
    assert float(second["best"]) == pytest.approx(0.8) and second["energy_j"] == "12.5"
    assert float(second["wall_s"]) == 15.0 and second["dir"].endswith("1-attempt2")
    assert sweep.varying(rows) == ["lr=0.1", "lr=0.2", "lr=0.3", "lr=0.4"]


def state(sweep_dir: Path) -> list[dict]:
    return json.loads((sweep_dir / sweep.STATE_FILE).read_text())["attempts"]


def all_gone(pids: list[int], timeout: float = 0) -> bool:

    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
        except OSError:
            return True

    deadline = time.time() + timeout
    while not all(gone(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    return all(gone(pid) for pid in pids)


@pytest.mark.slow
def test_jobs_never_share_a_gpu_and_a_waiting_job_takes_the_first_freed(tmp_path: Path) -> None:
    # 3 jobs at once on 2 fake GPUs. The 15 s job asks once the other two hold both GPUs, so it
    # waits in its claim loop; the 1 s job lets go first, 7 s before the 8 s job.
    command = [
        sys.executable, "-m", "sweep_app", "-m", "hydra/launcher=runkit_parallel",
        "+hydra.launcher.job_overrides.select_gpus=least_used",
        "+hydra.launcher.job_overrides.gpu_wait_s=600", f"gpu_lock_dir={tmp_path / 'locks'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.launcher.n_jobs=3", "hold_s=1,8,15",
        "late_hold_s=15", "after_claims=2",
    ]  # fmt: skip
    env = clean_env(RUNKIT_NVML_BACKEND="runkit.testing.fake_nvml:create",
                    RUNKIT_FAKE_NVML=json.dumps({"gpus": 2}), PYTHONPATH=str(TESTS))  # fmt: skip
    done = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    assert "0 job(s) skipped (finished earlier), 0 resumed, 3 started" in out
    folder = tmp_path / "sweep"
    jobs = short, long, late = [json.loads((folder / n / "claims.json").read_text()) for n in "012"]
    for gpu in (0, 1):
        spans = sorted((j["claimed"], j["released"]) for j in jobs if j["gpus"] == [gpu])
        for (_, released), (claimed, _) in itertools.pairwise(spans):
            assert claimed >= released  # one holder at a time
    assert short["gpus"] != long["gpus"]
    assert late["gpus"] == short["gpus"]  # the first GPU freed
    assert short["released"] <= late["claimed"] < long["released"]  # as soon as it was freed
    attempts = state(folder)
    assert max(a["started"] for a in attempts) < min(a["ended"] for a in attempts)  # all at once


# ------------------------------------------------------------- real training through the CLI


def summary(folder: Path) -> list[dict]:
    return list(csv.DictReader((folder / "summary.csv").open()))


@pytest.mark.slow
def test_jobs_run_at_the_same_time_and_a_failing_job_does_not_stop_the_others(
    cli: CliRunner, log_dir: Path, tmp_path: Path
) -> None:
    # lr=0.02 fails at train start; the other two meet there (Rendezvous): they must run at once
    result = cli(
        "train", "-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2",
        "model.optimizer.lr=0.01,0.02,0.03", *TINY,
        "+callbacks.boom._target_=user_callbacks.FailAtStart", "+callbacks.boom.lr=0.02",
        "+callbacks.meet._target_=user_callbacks.Rendezvous",
        f"+callbacks.meet.folder={tmp_path / 'meet'}", "+callbacks.meet.parties=2",
        "+callbacks.meet.skip_lr=0.02",
        env={"PYTHONPATH": str(TESTS)}, timeout=500,
    )  # fmt: skip
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    assert (
        "error: 1 of 3 sweep job(s) failed: #1 (exit 1: ValueError: user callback: refusing "
        "lr=0.02); their logs are in "
    ) in result.stderr
    (folder,) = (log_dir / "train" / "multiruns").iterdir()
    rows = summary(folder)
    assert [(r["job"], r["status"]) for r in rows] == [
        ("0", "finished"),
        ("1", "failed"),
        ("2", "finished"),
    ]
    assert all(float(rows[n]["test/acc"]) >= 0 and float(rows[n]["best"]) >= 0 for n in (0, 2))
    first, _, third = state(folder)
    assert third["started"] < first["ended"]  # they overlapped
    assert (folder / "summary.png").is_file()


@pytest.mark.slow
def test_a_stopped_sweep_reruns_into_the_rest_without_repeating_a_finished_job(
    log_dir: Path, tmp_path: Path
) -> None:
    # #0 finishes, #1 is stopped in its second epoch, #2 never starts; all get the user's code
    folder, marker = tmp_path / "sweep dir é", tmp_path / "paused"
    user_config_dir(tmp_path / "my configs")
    command = [
        sys.executable, "-m", "tinyapp.train", "-m", "--config-dir", "my configs", "model=mine",
        "hydra/launcher=parallel", "hydra.launcher.n_jobs=1", "model.optimizer.lr=0.01,0.02,0.03",
        *TINY, "+callbacks.pause._target_=user_callbacks.PauseAtLr", "+callbacks.pause.at=train",
        f"+callbacks.pause.marker={marker}", "+callbacks.pause.lr=0.02",
        "+callbacks.pause.epoch=1", f"paths.log_dir={log_dir}", f'hydra.sweep.dir="{folder}"',
    ]  # fmt: skip
    how = {"env": clean_env(PYTHONPATH=str(TESTS)), "cwd": tmp_path, "text": True}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **how)
    deadline = time.time() + 300
    while not marker.exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)  # the job has the signal (it waits in the pause, where handlers run)
    Path(f"{marker}.release").touch()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, (out + err)[-3000:]
    assert "stopped by SIGTERM during sweep; rerun the same command with hydra.sweep.dir=" in err
    rows = summary(folder)
    assert [r["status"] for r in rows] == ["finished", "interrupted", "not started"]
    assert (folder / "1" / "checkpoints" / "interrupted.ckpt").is_file()
    assert not (folder / "1" / "metrics.json").exists()
    # best: the stopped job's from its checkpoint, the finished one's from metrics.json
    assert rows[1]["monitor"] == rows[0]["monitor"] == "val/acc"
    assert 0 <= float(rows[1]["best"]) <= 1 and 0 <= float(rows[0]["best"]) <= 1
    assert (folder / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (folder / "summary.png").unlink()
    assert all_gone([a["pid"] for a in state(folder)])
    finished_at = (folder / "0" / "metrics.json").stat().st_mtime_ns

    again = subprocess.run(command, capture_output=True, timeout=500, **how)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "1 job(s) skipped (finished earlier), 1 resumed, 1 started" in again.stdout
    assert (folder / "0" / "metrics.json").stat().st_mtime_ns == finished_at
    runs = sorted(p.name for p in folder.iterdir() if (p / ".hydra").is_dir())
    assert runs == ["0", "1", "1-attempt2", "2"]
    resumed = json.loads((folder / "1-attempt2" / "metrics.json").read_text())
    assert resumed["resumed_from"] == str(folder / "1" / "checkpoints" / "interrupted.ckpt")
    assert resumed["epochs"] == 2
    for job in ("0", "1-attempt2", "2"):
        config = (folder / job / "config.yaml").read_text()
        assert "_target_: tinyapp.models.MLP" in config, job  # model=mine, my configs'
    assert [(r["status"], r["attempts"]) for r in summary(folder)] == [
        ("finished", "1"),
        ("finished", "2"),
        ("finished", "1"),
    ]
    assert (folder / "summary.png").is_file()


@pytest.mark.slow
def test_an_optuna_search_continues_its_study_from_the_sweep_folder(
    cli: CliRunner, tmp_path: Path
) -> None:
    pytest.importorskip(
        "hydra_plugins.hydra_optuna_sweeper", reason="pip install 'project[optuna]'"
    )
    folder = tmp_path / "search"
    args = (
        "-m", "hparams_search=optuna", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2",
        "hydra.sweeper.n_jobs=2", f"hydra.sweep.dir={folder}", *TINY,
    )  # fmt: skip
    first = cli("train", *args, "hydra.sweeper.n_trials=2", timeout=500)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    # another seed: the same one would draw the first trial's values again
    seeded = ("hydra.sweeper.n_trials=1", "hydra.sweeper.sampler.seed=8")
    again = cli("train", *args, *seeded, timeout=500)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "Using an existing study" in again.stdout + again.stderr
    assert "0 job(s) skipped (finished earlier), 0 resumed, 1 started" in again.stdout

    import optuna

    study = optuna.load_study(study_name="train", storage=f"sqlite:///{folder}/optuna.db")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    rows = summary(folder)
    assert sorted(r["job"] for r in rows) == ["0", "1", "2"]
    assert all(r["status"] == "finished" for r in rows)
    assert len({r["overrides"] for r in rows}) == 3  # three different draws, three folders


@pytest.mark.slow  # CLI end to end, in a fresh interpreter
def test_a_bad_n_jobs_is_one_line_and_creates_nothing(cli: CliRunner, log_dir: Path) -> None:
    result = cli("train", "-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: hydra.launcher.n_jobs=0 is invalid; expected a positive integer (jobs at once) "
        "or null (one per visible GPU, 1 without a GPU)"
    ]
    assert not log_dir.exists()


@pytest.mark.slow
def test_kill_9_of_a_training_sweep_lets_every_running_job_save(
    log_dir: Path, tmp_path: Path
) -> None:
    command = [
        sys.executable, "-m", "tinyapp.train", "-m", "hydra/launcher=parallel",
        "hydra.launcher.n_jobs=2", "model.optimizer.lr=0.01,0.02", "trainer.max_epochs=300",
        "data.batch_size=64", "test=false", "callbacks.progress_bar.refresh_rate=0",
        f"paths.log_dir={log_dir}",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    pids: list[int] = []
    try:
        deadline = time.time() + 300
        while len(list(log_dir.glob("train/multiruns/*/*/checkpoints/last.ckpt"))) < 2:
            assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
            assert time.time() < deadline, "the jobs never finished an epoch"
            time.sleep(0.2)
        (folder,) = (log_dir / "train" / "multiruns").iterdir()
        attempts = state(folder)
        pids = [a["pid"] for a in attempts]
    finally:
        proc.kill()
        proc.wait()
    assert all_gone(pids, timeout=180), "a job did not stop within 180 s of the sweep's death"
    for attempt in attempts:
        log = Path(attempt["log"]).read_text()
        assert log.count("SIGTERM received") == 1, log[-3000:]
        assert "again: quitting" not in log and "Traceback" not in log, log[-3000:]
        assert (Path(attempt["dir"]) / "checkpoints" / "interrupted.ckpt").is_file(), log[-3000:]
