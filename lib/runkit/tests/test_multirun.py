"""Sweeps with DDP: each job's two ranks run that job only, in that job's folder.

The children's own log files name the job they ran (``Rank 1 runs sweep job #N: <overrides>``),
so the tests compare them with each job's ``.hydra/overrides.yaml``: a child that re-ran the
sweep, or ran other values than rank 0 (an adaptive sweeper's draw), fails here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import CliRunner
from runkit.errors import RunError
from runkit.run import launch

TINY = (
    "trainer=ddp_sim",
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=2",
    "+trainer.limit_val_batches=1",
    "+trainer.limit_test_batches=1",
    "callbacks.progress_bar.refresh_rate=0",
)


def test_single_job_argv_drops_the_sweep_and_keeps_hydra_overrides_and_config_options() -> None:
    argv = launch.single_job_argv(
        "train.py",
        ["model.optimizer.lr=0.01", "data.batch_size=64"],
        ["hydra.mode=MULTIRUN", "hydra.sweep.dir=/x"],
        ["-m", "-cd", "my configs", "--config-name=exp", "model.optimizer.lr=0.01,0.1"],
    )
    assert argv == [
        "train.py", "--config-dir", "my configs", "--config-name", "exp",
        "model.optimizer.lr=0.01", "data.batch_size=64", "hydra.sweep.dir=/x", "hydra.mode=RUN",
    ]  # fmt: skip


def test_sweep_objective_returns_the_named_metric_as_a_float() -> None:
    metrics = {"val/acc": 0.75, "val/loss": 0.5}
    assert launch.sweep_objective(OmegaConf.create({"optimized_metric": None}), metrics) is metrics
    value = launch.sweep_objective(OmegaConf.create({"optimized_metric": "val/acc"}), metrics)
    assert value == 0.75 and isinstance(value, float)
    with pytest.raises(RunError, match=r"optimized_metric='val/ac' is not a metric .* val/acc"):
        launch.sweep_objective(OmegaConf.create({"optimized_metric": "val/ac"}), metrics)


def test_job_scope_does_nothing_outside_hydra() -> None:
    before = list(os.sys.argv)
    with launch.job_scope():
        assert os.sys.argv == before


def job_dirs(log_dir: Path) -> dict[int, Path]:
    (sweep,) = (log_dir / "train" / "multiruns").iterdir()
    return {int(p.name): p for p in sweep.iterdir() if p.name.isdigit()}


def child_job_line(job: Path) -> str:
    log = (job / "train_ddp_process_1.log").read_text().splitlines()
    (line,) = [line for line in log if "runs sweep job" in line]  # one job ran in this child
    return line.split("runs sweep job ", 1)[1]


def overrides(job: Path) -> list[str]:
    return yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())


@pytest.mark.slow
def test_grid_sweep_with_ddp_survives_failed_jobs(cli: CliRunner, log_dir: Path) -> None:
    # Jobs: lr x max_epochs. max_epochs=0 fails in the task before any child starts (RunError);
    # lr=0.02 fails on both ranks after the children started (a user callback's ValueError).
    result = cli(
        "train", "-m", "model.optimizer.lr=0.01,0.02,0.001", "trainer.max_epochs=1,0",
        "data.batch_size=256", "+callbacks.boom._target_=user_callbacks.FailAtStart",
        "+callbacks.boom.lr=0.02", *TINY[:1], *TINY[2:],
        env={"PYTHONPATH": str(Path(__file__).resolve().parent)}, timeout=500,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0  # Hydra reports the failed jobs at the end
    assert output.count("Launching 6 jobs locally") == 1, output[-3000:]  # no child re-swept
    assert "trainer.max_epochs=0 is invalid" in result.stderr
    assert "user callback: refusing lr=0.02" in output

    jobs = job_dirs(log_dir)
    succeeded = {num for num, job in jobs.items() if (job / "metrics.json").is_file()}
    assert succeeded == {0, 4}, sorted(jobs)  # (0.01, 1) and (0.001, 1): after both failures
    for num in (0, 2, 4):  # every job that launched a child: the child ran that job and no other
        assert child_job_line(jobs[num]) == f"#{num}: " + " ".join(overrides(jobs[num]))
    for num in succeeded:
        job = jobs[num]
        assert len(list(job.rglob("config.yaml"))) == 2  # config.yaml + .hydra/config.yaml
        summary = json.loads((job / "metrics.json").read_text())
        assert summary["devices"] == 2
    lrs = {OmegaConf.load(jobs[n] / "config.yaml").model.optimizer.lr for n in succeeded}
    assert lrs == {0.01, 0.001}


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
    assert sorted(jobs) == [0, 1]
    draws = []
    for num, job in jobs.items():
        drawn = overrides(job)
        assert any(o.startswith("model.optimizer.lr=") for o in drawn)
        assert child_job_line(job) == f"#{num}: " + " ".join(drawn)
        assert (job / "metrics.json").is_file()
        draws.append(tuple(o for o in drawn if o.startswith(("model.", "data."))))
    assert draws[0] != draws[1]  # two different trials, each seen identically by both its ranks
    (sweep,) = (log_dir / "train" / "multiruns").iterdir()
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert 0.0 <= best["best_value"] <= 1.0
