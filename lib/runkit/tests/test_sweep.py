"""Sweeps through Hydra's own launcher with DDP, and through ``hydra/launcher=parallel``."""

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
import yaml
from omegaconf import OmegaConf

from conftest import CliRunner, clean_env, run_python, user_config_dir
from runkit.errors import RunError
from runkit.run import launch, sweep
from runkit.run.sweep import Attempt
from runkit.safety import writes
from runkit.safety.writes import FileWriteError

TESTS = Path(__file__).resolve().parent
TINY = ("trainer.max_epochs=2", "+trainer.limit_train_batches=3", "+trainer.limit_val_batches=1",
        "+trainer.limit_test_batches=1", "data.batch_size=64",
        "callbacks.progress_bar.refresh_rate=0")  # fmt: skip
DDP_TINY = ("trainer=ddp_sim", "trainer.max_epochs=1", "+trainer.limit_train_batches=2",
            "+trainer.limit_val_batches=1", "+trainer.limit_test_batches=1",
            "callbacks.progress_bar.refresh_rate=0")  # fmt: skip


def test_a_job_command_runs_one_job_in_its_folder_and_the_jobs_own_values_win() -> None:
    command = launch.job_command(
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
    before = list(sys.argv)
    with launch.job_scope():  # outside Hydra: nothing changes
        assert sys.argv == before
    metrics = {"val/acc": 0.75, "val/loss": 0.5}

    def objective(key: str | None) -> object:
        return launch.sweep_objective(OmegaConf.create({"optimized_metric": key}), metrics)

    assert objective(None) is metrics and repr(objective("val/acc")) == "0.75"
    with pytest.raises(RunError, match=r"optimized_metric='val/ac' is not a metric .* val/acc"):
        objective("val/ac")


def job_dirs(log_dir: Path) -> dict[int, Path]:
    (folder,) = (log_dir / "train" / "multiruns").iterdir()
    return {int(p.name): p for p in folder.iterdir() if p.name.isdigit()}


def ran_alone(num: int, job: Path) -> list[str]:
    # the job's overrides; its DDP child ran this job and no other
    drawn = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
    log = (job / "train_ddp_process_1.log").read_text().splitlines()
    (line,) = [line for line in log if "runs sweep job" in line]
    assert line.split("runs sweep job ", 1)[1] == f"#{num}: " + " ".join(drawn)
    return drawn


@pytest.mark.slow
def test_grid_sweep_with_ddp_survives_failed_jobs(
    cli: CliRunner, log_dir: Path, tmp_path: Path
) -> None:
    # Jobs: lr x max_epochs. max_epochs=0 fails in the task before any child starts (RunError);
    # lr=0.02 fails on both ranks after the children started (a user callback's ValueError).
    user_config_dir(tmp_path / "my configs")  # the DDP children need it too
    result = cli(
        "train", "-m", "--config-dir", "my configs", "model=mine", "model.optimizer.lr=0.02,0.01",
        "trainer.max_epochs=1,0", "data.batch_size=256", f"paths.log_dir={log_dir}",
        "+callbacks.boom._target_=user_callbacks.FailAtStart", "+callbacks.boom.lr=0.02",
        *DDP_TINY[:1], *DDP_TINY[2:], timeout=500,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0  # the failed jobs, after all of them ran
    assert output.count("Launching 4 jobs locally") == 1, output[-3000:]  # no child re-swept
    assert "trainer.max_epochs=0 is invalid" in result.stderr
    assert "user callback: refusing lr=0.02" in output
    jobs = job_dirs(log_dir)
    assert {n for n, job in jobs.items() if (job / "metrics.json").is_file()} == {2}
    for num in (0, 2):  # every job that launched a child
        ran_alone(num, jobs[num])
    ok = jobs[2]  # after both failures: one folder, the job's values, its own duration
    assert len(list(ok.rglob("config.yaml"))) == 2  # config.yaml + .hydra/config.yaml
    assert OmegaConf.load(ok / "config.yaml").model.optimizer.lr == 0.01
    summary = json.loads((ok / "metrics.json").read_text())
    span = (ok / "metrics.json").stat().st_mtime - (ok / ".hydra").stat().st_mtime
    assert summary["devices"] == 2 and 0 < summary["wall_seconds"] <= span + 0.5


@pytest.mark.slow
def test_optuna_sweep_gives_both_ranks_the_same_draw(cli: CliRunner, log_dir: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    result = cli(
        "train", "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.seed=7", "data.batch_size=choice(128,256)", *DDP_TINY, timeout=500,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    jobs = job_dirs(log_dir)
    assert sorted(jobs) == [0, 1] and all((j / "metrics.json").is_file() for j in jobs.values())
    draws = [ran_alone(num, job) for num, job in jobs.items()]
    assert all(any(o.startswith("model.optimizer.lr=") for o in d) for d in draws)
    assert draws[0] != draws[1]  # two different trials, each seen identically by both its ranks
    (folder,) = (log_dir / "train" / "multiruns").iterdir()
    best = yaml.safe_load((folder / "optimization_results.yaml").read_text())
    assert 0.0 <= best["best_value"] <= 1.0


def test_n_jobs_is_a_positive_integer_and_defaults_to_the_visible_gpus(use_fake) -> None:
    from runkit.testing.fake_nvml import FakeGpu, FakeNvml

    for value in (0, -2, 1.5, "four", True):
        with pytest.raises(RunError, match=rf"n_jobs={value!r} is invalid; expected a positive"):
            sweep.check_n_jobs(value)
    assert sweep.check_n_jobs(None) is None and sweep.check_n_jobs(3) == 3
    assert sweep.default_n_jobs({}) == 1  # no NVML in this process: no GPU
    use_fake(FakeNvml([FakeGpu(), FakeGpu(), FakeGpu()]))
    assert sweep.default_n_jobs({}) == 3
    assert sweep.default_n_jobs({"CUDA_VISIBLE_DEVICES": "0,2"}) == 2


def test_the_launcher_imports_no_torch() -> None:  # Hydra imports it in every command
    done = run_python(
        "import sys, runkit.run.sweep; print(sorted({'torch', 'lightning'} & set(sys.modules)))"
    )
    assert done.stdout.strip() == "[]", done.stderr[-3000:]


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
    (tmp_path / "1-attempt2").mkdir()
    record = {"metrics": {"val/acc": 0.7}, "monitor": "val/acc", "best_score": 0.8}
    record["energy"] = {"energy_j": 12.5}
    (tmp_path / "1-attempt2" / "metrics.json").write_text(json.dumps(record))
    attempts = [
        Attempt(1, ["lr=0.2", "e=2"], str(tmp_path / "1"), "l1", "interrupted", 143, 10, 15),
        Attempt(2, ["lr=0.3", "e=2"], str(tmp_path / "2"), "l2", "failed", 1, 11, 12),
        Attempt(1, ["lr=0.2", "e=2"], str(tmp_path / "1-attempt2"), "l", "finished", 0, 40, 50),
    ]
    rows = sweep.job_rows(attempts, not_started=[["lr=0.4", "e=2"]])
    dead = tmp_path / f".summary.csv.{2**22 + 1}-{writes._HOST}-0badc0de.tmp"  # a killed sweep's
    dead.write_text("half")
    first, failed, later = csv.DictReader(sweep.write_summary(tmp_path, rows).open())
    assert not dead.exists()
    blocked = tmp_path / "1-attempt2" / "metrics.json"  # a file where the sweep folder should be
    with pytest.raises(FileWriteError) as info:
        sweep.write_summary(blocked, rows)
    assert str(info.value) == (
        f"could not write {str(blocked / 'summary.csv')!r}: File exists; nothing was written"
    )
    assert [first[k] for k in ("job", "status", "attempts", "overrides", "val/acc")] == [
        "1", "finished", "2", "lr=0.2 e=2", "0.7"
    ]  # fmt: skip
    assert float(first["best"]) == 0.8 and first["energy_j"] == "12.5"
    assert float(first["wall_s"]) == 15.0 and first["dir"].endswith("1-attempt2")
    assert (failed["status"], later["job"], later["status"]) == ("failed", "", "not started")
    assert sweep.varying(rows) == ["lr=0.2", "lr=0.3", "lr=0.4"]


def state(sweep_dir: Path) -> list[dict]:
    return json.loads((sweep_dir / sweep.STATE_FILE).read_text())["attempts"]


def wait_for(check, proc: subprocess.Popen) -> None:
    deadline = time.time() + 300
    while not check():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)


def all_gone(pids: list[int], timeout: float = 0) -> bool:
    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
        except OSError:
            return True

    deadline = time.time() + timeout
    while not all(map(gone, pids)) and time.time() < deadline:
        time.sleep(0.1)
    return all(map(gone, pids))


@pytest.mark.slow
def test_jobs_never_share_a_gpu_and_a_waiting_job_takes_the_first_freed(tmp_path: Path) -> None:
    # 3 jobs at once on 2 fake GPUs. The 2 s job asks once the other two hold both GPUs, so it
    # waits in its claim loop; the 1 s job lets go first, 5 s before the 6 s job.
    command = [
        sys.executable, "-m", "sweep_app", "-m", "hydra/launcher=runkit_parallel",
        "+hydra.launcher.job_overrides.select_gpus=least_used",
        "+hydra.launcher.job_overrides.gpu_wait_s=600", f"gpu_lock_dir={tmp_path / 'locks'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.launcher.n_jobs=3", "hold_s=1,6,2",
        "late_hold_s=2", "after_claims=2",
    ]  # fmt: skip
    env = clean_env(RUNKIT_NVML_BACKEND="runkit.testing.fake_nvml:create",
                    RUNKIT_FAKE_NVML=json.dumps({"gpus": 2}), PYTHONPATH=str(TESTS))  # fmt: skip
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "0 job(s) skipped (finished earlier), 0 resumed, 3 started" in done.stdout
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


def summary(folder: Path) -> list[dict]:
    return list(csv.DictReader((folder / "summary.csv").open()))


@pytest.mark.slow
def test_a_stopped_sweep_reruns_only_the_rest_and_a_failing_job_does_not_stop_the_others(
    log_dir: Path, tmp_path: Path
) -> None:
    # #0 finishes, #1 is stopped in its second epoch, #2 never starts; all get the user's code.
    # The rerun resumes #1 and starts #2 at once; #2 fails at train start, #1 finishes all the same.
    folder, marker = tmp_path / "sweep dir é", tmp_path / "paused"
    user_config_dir(tmp_path / "my configs")
    command = [
        sys.executable, "-m", "tinyapp.train", "-m", "--config-dir", "my configs", "model=mine",
        "hydra/launcher=parallel", "hydra.launcher.n_jobs=1",
        "model.optimizer.lr=0.01,0.02,0.03", *TINY,
        "+callbacks.pause._target_=user_callbacks.PauseAtLr", "+callbacks.pause.at=train",
        f"+callbacks.pause.marker={marker}", "+callbacks.pause.lr=0.02",
        "+callbacks.pause.epoch=1", "+callbacks.boom._target_=user_callbacks.FailAtStart",
        "+callbacks.boom.lr=0.03", f"paths.log_dir={log_dir}", f'hydra.sweep.dir="{folder}"',
    ]  # fmt: skip
    how = {"env": clean_env(PYTHONPATH=str(TESTS)), "cwd": tmp_path, "text": True}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **how)
    wait_for(marker.exists, proc)
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received" in (folder / "logs" / "1.log").read_text(), proc)
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

    command[command.index("hydra.launcher.n_jobs=1")] = "hydra.launcher.n_jobs=3"
    again = subprocess.run(command, capture_output=True, timeout=500, **how)
    assert again.returncode == 1, (again.stdout + again.stderr)[-3000:]
    assert "1 job(s) skipped (finished earlier), 1 resumed, 1 started" in again.stdout
    assert (
        "error: 1 of 3 sweep job(s) failed: #2 (exit 1: ValueError: user callback: refusing "
        "lr=0.03); their logs are in "
    ) in again.stderr
    assert (folder / "0" / "metrics.json").stat().st_mtime_ns == finished_at
    runs = sorted(p.name for p in folder.iterdir() if (p / ".hydra").is_dir())
    assert runs == ["0", "1", "1-attempt2", "2"]
    resumed = json.loads((folder / "1-attempt2" / "metrics.json").read_text())
    assert resumed["resumed_from"] == str(folder / "1" / "checkpoints" / "interrupted.ckpt")
    assert resumed["epochs"] == 2
    for job in ("0", "1-attempt2", "2"):  # #2 too: its config is written before it fails
        config = (folder / job / "config.yaml").read_text()
        assert "_target_: tinyapp.models.MLP" in config, job  # model=mine, my configs'
    rows = summary(folder)
    assert [(r["status"], r["attempts"]) for r in rows] == [
        ("finished", "1"), ("finished", "2"), ("failed", "1")
    ]  # fmt: skip
    assert all(0 <= float(rows[n]["test/acc"]) <= 1 for n in (0, 1))
    assert (folder / "summary.png").is_file()


@pytest.mark.slow
def test_an_optuna_search_continues_its_study_from_the_sweep_folder(
    cli: CliRunner, tmp_path: Path
) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    folder = tmp_path / "search"
    args = ("-m", "hparams_search=optuna", "hydra/launcher=parallel", f"hydra.sweep.dir={folder}",
            *TINY, "hydra.sweeper.n_trials=1")  # fmt: skip
    first = cli("train", *args, timeout=500)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    # another seed: the same one would draw the first trial's values again
    again = cli("train", *args, "hydra.sweeper.sampler.seed=8", timeout=500)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "Using an existing study" in again.stdout + again.stderr
    assert "0 job(s) skipped (finished earlier), 0 resumed, 1 started" in again.stdout

    import optuna

    study = optuna.load_study(study_name="train", storage=f"sqlite:///{folder}/optuna.db")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 2
    rows = summary(folder)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "finished"), ("1", "finished")]
    assert rows[0]["overrides"] != rows[1]["overrides"]  # two different draws, two folders


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
    # both jobs train at once: 300 epochs outlast the test
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
        wait_for(
            lambda: len(list(log_dir.glob("train/multiruns/*/*/checkpoints/last.ckpt"))) == 2, proc
        )
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
