"""Sweeps with DDP through Hydra's own launcher: each job's two ranks run that job only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import CliRunner
from runkit.errors import RunError
from runkit.run import launch

TINY = ("trainer=ddp_sim", "trainer.max_epochs=1", "+trainer.limit_train_batches=2",
        "+trainer.limit_val_batches=1", "+trainer.limit_test_batches=1",
        "callbacks.progress_bar.refresh_rate=0")  # fmt: skip


def test_a_job_runs_as_a_single_run_and_returns_its_objective() -> None:
    argv = ["-m", "-cd", "my configs", "--config-name=exp", "model.optimizer.lr=0.01,0.1"]
    assert launch.single_job_argv("t.py", ["lr=0.01"], ["hydra.mode=MULTIRUN", "x=1"], argv) == [
        "t.py", "--config-dir", "my configs", "--config-name", "exp", "lr=0.01", "x=1",
        "hydra.mode=RUN",
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
    (sweep,) = (log_dir / "train" / "multiruns").iterdir()
    return {int(p.name): p for p in sweep.iterdir() if p.name.isdigit()}


def ran_alone(num: int, job: Path) -> list[str]:
    # the job's overrides; its DDP child ran this job and no other
    drawn = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
    log = (job / "train_ddp_process_1.log").read_text().splitlines()
    (line,) = [line for line in log if "runs sweep job" in line]
    assert line.split("runs sweep job ", 1)[1] == f"#{num}: " + " ".join(drawn)
    return drawn


@pytest.mark.slow
def test_grid_sweep_with_ddp_survives_failed_jobs(cli: CliRunner, log_dir: Path) -> None:
    # Jobs: lr x max_epochs. max_epochs=0 fails in the task before any child starts (RunError);
    # lr=0.02 fails on both ranks after the children started (a user callback's ValueError).
    result = cli(
        "train", "-m", "model.optimizer.lr=0.02,0.01", "trainer.max_epochs=1,0",
        "data.batch_size=256", "+callbacks.boom._target_=user_callbacks.FailAtStart",
        "+callbacks.boom.lr=0.02", *TINY[:1], *TINY[2:],
        env={"PYTHONPATH": str(Path(__file__).resolve().parent)}, timeout=500,
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
    pytest.importorskip(
        "hydra_plugins.hydra_optuna_sweeper", reason="pip install 'project[optuna]'"
    )
    result = cli(
        "train", "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.seed=7", "data.batch_size=choice(128,256)", *TINY, timeout=500,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    jobs = job_dirs(log_dir)
    assert sorted(jobs) == [0, 1] and all((j / "metrics.json").is_file() for j in jobs.values())
    draws = [ran_alone(num, job) for num, job in jobs.items()]
    assert all(any(o.startswith("model.optimizer.lr=") for o in d) for d in draws)
    assert draws[0] != draws[1]  # two different trials, each seen identically by both its ranks
    (sweep,) = (log_dir / "train" / "multiruns").iterdir()
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert 0.0 <= best["best_value"] <= 1.0
