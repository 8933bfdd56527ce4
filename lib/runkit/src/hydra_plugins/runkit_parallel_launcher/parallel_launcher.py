"""Hydra's entry for :mod:`runkit.run.sweep`: ``hydra/launcher=runkit_parallel``.

Hydra finds launchers only in its ``hydra_plugins`` namespace. No ``from __future__ import
annotations``: Hydra loads this file outside ``sys.modules``, where dataclasses cannot resolve
string annotations.
"""

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.launcher import Launcher

from runkit.errors import RunError
from runkit.quoting import hydra_value
from runkit.run.sweep import (
    ParallelSweep,
    check_n_jobs,
    default_n_jobs,
    entry_command,
    read_metrics,
)

log = logging.getLogger(__name__)


@dataclass
class RunkitParallelLauncherConf:
    _target_: str = (
        "hydra_plugins.runkit_parallel_launcher.parallel_launcher.RunkitParallelLauncher"
    )
    n_jobs: Any = None  # jobs at once; null: one per visible GPU (1 without a GPU)
    job_overrides: dict[str, Any] = field(default_factory=dict)


ConfigStore.instance().store(
    group="hydra/launcher",
    name="runkit_parallel",
    node=RunkitParallelLauncherConf,
    provider="runkit",
)


class RunkitParallelLauncher(Launcher):
    """Up to ``n_jobs`` jobs of a sweep at once (``None``: one per visible GPU), each a process of
    its own; ``job_overrides`` are added to each job that does not set the key itself."""

    def __init__(self, n_jobs: int | None = None, job_overrides: Mapping[str, Any] | None = None):
        self.n_jobs = check_n_jobs(n_jobs)
        self.job_overrides = dict(job_overrides or {})
        self.config: Any = None
        self.hydra_context: Any = None
        self._sweep: ParallelSweep | None = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
        from hydra.core.utils import configure_log, setup_globals
        from omegaconf import open_dict

        from runkit.safety import signals

        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(os.path.abspath(str(self.config.hydra.sweep.dir)))
        if self._sweep is None:
            n_jobs = self.n_jobs or default_n_jobs()
            self._sweep = ParallelSweep(
                sweep_dir,
                n_jobs,
                entry_command(),
                [str(o) for o in self.config.hydra.overrides.hydra],
                self.job_overrides,
            )
            log.info("Sweep: up to %d job(s) at once in %s", n_jobs, sweep_dir)
        configs, jobs = [], []
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            loader = self.hydra_context.config_loader
            config = loader.load_sweep_config(self.config, list(overrides))
            with open_dict(config):
                config.hydra.job.id = config.hydra.job.num = num
            configs.append(config)
            jobs.append((list(overrides), sweep_dir / str(config.hydra.sweep.subdir), num))
        signals.request.phase = "sweep"
        attempts = self._sweep.run(jobs)
        failed: list[str] = []
        returns = [
            _job_return(config, overrides, attempt, failed)
            for config, (overrides, _, _), attempt in zip(configs, jobs, attempts, strict=True)
        ]

        self._summarise(sweep_dir, jobs, attempts)
        if signals.request.received is not None:
            signals.request.detail = (
                f"; rerun the same command with hydra.sweep.dir={hydra_value(str(sweep_dir))} "
                "to finish the sweep"
            )
            signals.exit_stopped(signals.request.received)
        if failed:
            print(
                f"error: {len(failed)} of {len(jobs)} sweep job(s) failed: {', '.join(failed)}; "
                "their logs are in " + str(sweep_dir / "logs"),
                file=sys.stderr,
            )
        return returns

    def _summarise(self, sweep_dir: Path, jobs: list[Any], attempts: list[Any]) -> None:
        from omegaconf import OmegaConf

        from runkit.run import sweep_summary

        assert self._sweep is not None
        not_started = [o for (o, _, _), a in zip(jobs, attempts, strict=True) if a is None]
        rows = sweep_summary.job_rows(self._sweep.state.attempts, not_started)
        path = sweep_summary.write_summary(sweep_dir, rows)
        key = OmegaConf.select(self.config, "optimized_metric", default=None)
        sweep_summary.print_table(rows, key)
        sweep_summary.plot_summary(sweep_dir, rows, key)
        log.info("Sweep summary: %s", path)


def _job_return(config: Any, overrides: list[str], attempt: Any, failed: list[str]) -> Any:
    """Hydra's record of one job: its objective, else why not (``failed`` collects failures)."""
    from hydra.core.utils import JobReturn, JobStatus

    from runkit.run.cli import ReportedJobError
    from runkit.run.launch import sweep_objective

    ret = JobReturn(overrides=overrides, cfg=config, hydra_cfg=config.hydra)
    ret.task_name = str(config.hydra.job.name)
    ret.working_dir = attempt.dir if attempt is not None else None
    metrics = (read_metrics(attempt.dir) or {}).get("metrics") if attempt else None
    if attempt is not None and attempt.status == "finished" and metrics is not None:
        try:
            ret.return_value = sweep_objective(config, metrics)
            ret.status = JobStatus.COMPLETED
        except RunError as err:
            print(f"error: job #{attempt.num}: {err}", file=sys.stderr)
            ret.return_value, ret.status = ReportedJobError(str(err)), JobStatus.FAILED
        return ret
    status = attempt.status if attempt is not None else "not started"
    if attempt is not None and attempt.status == "failed":
        failed.append(f"#{attempt.num} (exit {attempt.exit_code}: {attempt.cause})")
    ret.return_value = ReportedJobError(f"sweep job {status}", 1)
    ret.status = JobStatus.FAILED
    return ret
