"""Sweeps that fill one machine (``hydra/launcher=runkit_parallel``): each job a process of its
own, every attempt recorded in ``sweep_state.json``, so the same command resumes the sweep."""

from __future__ import annotations

import contextlib
import csv
import ctypes
import fcntl
import io
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.launcher import Launcher

from runkit.errors import RunError
from runkit.quoting import config_options, hydra_value
from runkit.run.launch import job_command, newest_checkpoint
from runkit.safety import signals
from runkit.safety.writes import atomic_write

log = logging.getLogger(__name__)

STATE_FILE = "sweep_state.json"
PARENT_ENV = "RUNKIT_SWEEP_PARENT"  # set for each job: the sweep's pid, which the job follows
POLL_S = 0.2  # how often the launcher looks at its jobs and at the stop signal
STOP_GRACE_S = 600.0  # after a stop signal, how long the jobs may take to save before a kill
_CAUSE = re.compile(r"^(error: |[\w.]*(Error|Exception|Interrupt)\b: )")
FIXED = ["job", "status", "overrides", "attempts", "monitor", "best", "wall_s", "energy_j", "dir"]


@dataclass
class Attempt:
    """One process of one job, as ``sweep_state.json`` records it."""

    num: int
    overrides: list[str]  # the job's own, without what the launcher added
    dir: str
    log: str
    status: str = "running"  # running, finished, interrupted (by a signal), failed
    exit_code: int | None = None
    started: float = field(default_factory=time.time)
    ended: float | None = None
    resumed_from: str | None = None
    pid: int | None = None
    cause: str | None = None  # a failed attempt's last line that names why


def load_attempts(sweep_dir: Path) -> list[Attempt]:
    path = sweep_dir / STATE_FILE
    try:
        return [Attempt(**a) for a in json.loads(path.read_text(encoding="utf-8"))["attempts"]]
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise RunError(
            f"{str(path)!r} is damaged ({type(err).__name__}: {err}); it records the "
            "jobs of this sweep: restore it, or start a new sweep in another hydra.sweep.dir"
        ) from None


def finished(attempt: Attempt) -> bool:
    """Whether its run wrote ``metrics.json`` (its record may say "running" after a kill -9)."""
    return (Path(attempt.dir) / "metrics.json").is_file()


def read_metrics(run_dir: str | Path) -> dict[str, Any]:
    """A run's ``metrics.json``; empty when it is missing or damaged."""
    try:
        data = json.loads((Path(run_dir) / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def default_n_jobs(environ: Mapping[str, str] | None = None) -> int:
    """The number of GPUs this process may use (NVML and ``CUDA_VISIBLE_DEVICES``), or 1."""
    from runkit.gpus.inventory import IDENTITY, TorchCuda, collect_inventory

    inventory = collect_inventory(torch_info=TorchCuda(), env=environ, detail=IDENTITY)
    return max(1, len(inventory.visible))


def check_n_jobs(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise RunError(
            f"hydra.launcher.n_jobs={value!r} is invalid; expected a positive integer (jobs at "
            "once) or null (one per visible GPU, 1 without a GPU)"
        )
    return value


def follow_sweep_parent(environ: MutableMapping[str, str] | None = None) -> None:
    """In a sweep's job: SIGTERM when the sweep dies; a sweep already gone ends the job at once."""
    env = os.environ if environ is None else environ
    parent = env.pop(PARENT_ENV, None)  # the job's own DDP ranks follow the job, not the sweep
    if not parent:
        return
    with contextlib.suppress(OSError, AttributeError):  # Linux's PR_SET_PDEATHSIG, elsewhere none
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
    if str(os.getppid()) != parent:
        print(f"error: the sweep (pid {parent}) ended before this job started", file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM)


ConfigStore.instance().store(
    group="hydra/launcher", name="runkit_parallel", provider="runkit", node={
        "_target_": "hydra_plugins.runkit_parallel_launcher.parallel_launcher.RunkitParallelLauncher",
        "n_jobs": None, "job_overrides": {},  # n_jobs null: one per visible GPU (1 without)
    },
)  # fmt: skip


class ParallelLauncher(Launcher):
    """Runs up to ``n_jobs`` jobs at once; ``job_overrides`` go to those that do not set the key."""

    def __init__(self, n_jobs: int | None = None, job_overrides: Mapping[str, Any] | None = None):
        self.n_jobs = check_n_jobs(n_jobs) or 0  # 0: one per visible GPU
        self.job_overrides = dict(job_overrides or {})
        self.attempts: list[Attempt] = []
        self.lock: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
        from hydra.core.utils import JobReturn, JobStatus, configure_log, setup_globals
        from omegaconf import open_dict

        from runkit.run.launch import FAILED_JOBS, sweep_objective

        hydra = self.config.hydra
        setup_globals()
        configure_log(hydra.hydra_logging, hydra.verbose)
        self.dir = Path(os.path.abspath(str(hydra.sweep.dir)))
        if self.lock is None:  # the first batch of jobs
            self._open(hydra)
        returns, jobs = [], []
        for num, overrides in enumerate(map(list, job_overrides), start=initial_job_idx):
            config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            with open_dict(config):
                config.hydra.job.id = config.hydra.job.num = num
            ret = JobReturn(overrides=overrides, cfg=config, hydra_cfg=config.hydra)
            ret.task_name, ret.status = str(config.hydra.job.name), JobStatus.COMPLETED
            returns.append(ret)
            jobs.append((overrides, self.dir / str(config.hydra.sweep.subdir), num))
        signals.request.phase = "sweep"
        failed = []
        attempts = self._run(jobs)
        for ret, attempt in zip(returns, attempts, strict=True):
            ret.working_dir, ret.return_value = attempt.dir if attempt else None, math.nan
            if attempt is not None and attempt.status == "finished":
                try:
                    metrics = read_metrics(attempt.dir).get("metrics")
                    ret.return_value = sweep_objective(ret.cfg, metrics)
                except RunError as err:
                    print(f"error: job #{attempt.num}: {err}", file=sys.stderr)
                    FAILED_JOBS.append(err.exit_code)
                continue
            if attempt is not None and attempt.status == "failed":
                failed.append(f"#{attempt.num} (exit {attempt.exit_code}: {attempt.cause})")
            FAILED_JOBS.append(1)  # failed, interrupted or never started: the sweep exits 1
        rows = job_rows(self.attempts, [j[0] for j, a in zip(jobs, attempts, strict=True) if not a])
        key = self.config.get("optimized_metric")
        print_table(rows, key)
        plot_summary(self.dir, rows, key)
        log.info("Sweep summary: %s", write_summary(self.dir, rows))
        if signals.request.received is not None:
            signals.request.detail = (
                f"; rerun the same command with hydra.sweep.dir={hydra_value(str(self.dir))} "
                "to finish the sweep"
            )
            signals.exit_stopped(signals.request.received)
        if failed:
            print(
                f"error: {len(failed)} of {len(jobs)} sweep job(s) failed: {', '.join(failed)}; "
                f"their logs are in {self.dir / 'logs'}",
                file=sys.stderr,
            )
        return returns

    def _open(self, hydra: Any) -> None:
        """Hold the sweep folder (a second sweep there fails in one line) and read its record."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lock = open(self.dir / ".sweep.lock", "a+")  # noqa: SIM115 - held until exit
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.lock.close()
            raise RunError(
                f"hydra.sweep.dir={str(self.dir)!r} is in use by another sweep that is still "
                "running; wait for it, or pick another hydra.sweep.dir"
            ) from None
        self.attempts = load_attempts(self.dir)
        self.n_jobs = self.n_jobs or default_n_jobs()
        self.hydra_overrides = [str(o) for o in hydra.overrides.hydra]
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # this program again
        program = (
            ["-m", spec.name.removesuffix(".__main__")]
            if spec is not None and spec.name
            else [os.path.abspath(sys.argv[0])]
        )
        self.entry = [sys.executable, *program, *config_options(sys.argv[1:])]
        log.info("Sweep: up to %d job(s) at once in %s", self.n_jobs, self.dir)

    def _run(self, jobs: Sequence[tuple[list[str], Path, int]]) -> list[Attempt | None]:
        """Per job (overrides, folder, number): the attempt that finished it, or ``None``."""
        results: list[Attempt | None] = [None] * len(jobs)
        pending, counts = [], {"skipped": 0, "resumed": 0, "started": 0}
        for index, job in enumerate(jobs):
            earlier = [a for a in self.attempts if a.overrides == job[0]]
            if (done := next((a for a in earlier if finished(a)), None)) is not None:
                done.status, done.exit_code, results[index] = "finished", 0, done
                counts["skipped"] += 1
                continue
            for attempt in earlier:
                if attempt.status == "running":  # the sweep was killed while it ran
                    attempt.status = "interrupted"
            pending.append((index, job))
        running: dict[subprocess.Popen, tuple[Attempt, int]] = {}
        deadline = math.inf
        try:
            while pending or running:
                received = signals.request.received
                if received is not None and deadline == math.inf:
                    deadline = time.monotonic() + STOP_GRACE_S
                    pending.clear()
                    log.info("Sweep: stopping %d running job(s); no new job starts", len(running))
                    for proc in running:
                        _signal_group(proc, received)
                if time.monotonic() > deadline:
                    for proc in running:
                        _signal_group(proc, signal.SIGKILL)
                while pending and len(running) < self.n_jobs:
                    index, job = pending.pop(0)
                    proc, attempt = self._start(*job, counts)
                    running[proc] = attempt, index
                for proc in [p for p in running if p.poll() is not None]:
                    attempt, index = running.pop(proc)
                    results[index] = self._finish(proc, attempt)
                time.sleep(POLL_S)
        finally:
            for proc, (attempt, _) in running.items():  # the launcher failed: no job outlives it
                _signal_group(proc, signal.SIGKILL)
                self._finish(proc, attempt)
            self._save()
        log.info(
            "Sweep: %d job(s) skipped (finished earlier), %d resumed, %d started", *counts.values()
        )
        return results

    def _start(
        self, overrides: list[str], run_dir: Path, num: int, counts: dict[str, int]
    ) -> tuple[subprocess.Popen, Attempt]:
        earlier = [a for a in self.attempts if a.overrides == overrides]
        used = {a.num for a in self.attempts}
        if earlier:
            num = earlier[0].num
            run_dir = run_dir.with_name(f"{num}-attempt{len(earlier) + 1}")
        elif num in used or run_dir.exists():  # another job has it (an earlier sweep's draw)
            num = max(used | {num}) + 1
            run_dir = run_dir.with_name(str(num))
        extra, own = dict(self.job_overrides), overrides
        resume = newest_checkpoint(a.dir for a in earlier)
        if resume is not None:  # the checkpoint wins over the job's own ckpt_path
            extra["ckpt_path"] = str(resume)
            own = [o for o in overrides if not o.lstrip("+~").startswith("ckpt_path=")]
            log.info("Sweep job #%d resumes from %s", num, resume)
        counts["resumed" if resume is not None else "started"] += 1
        (self.dir / "logs").mkdir(exist_ok=True)
        log_path = self.dir / "logs" / f"{run_dir.name}.log"
        command = job_command(self.entry, own, self.hydra_overrides, extra, run_dir, num)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, PARENT_ENV: str(os.getpid())},
            )  # fmt: skip
        signals.request.children.append(proc)  # a second Ctrl-C kills them with the sweep
        attempt = Attempt(num, overrides, str(run_dir), str(log_path), pid=proc.pid)
        attempt.resumed_from = str(resume) if resume is not None else None
        self.attempts.append(attempt)
        self._save()
        log.info("Sweep job #%d started: %s (log: %s)", num, " ".join(overrides), log_path)
        return proc, attempt

    def _finish(self, proc: subprocess.Popen, attempt: Attempt) -> Attempt:
        with contextlib.suppress(ValueError):
            signals.request.children.remove(proc)
        attempt.exit_code = code = proc.wait()
        attempt.ended = time.time()
        if code == 0 and finished(attempt):
            attempt.status = "finished"
        else:
            attempt.status = "interrupted" if code > 128 or code < 0 else "failed"
        took, said = attempt.ended - attempt.started, attempt.status
        if attempt.status == "failed":  # its last line naming a cause (error: ..., ValueError: ...)
            try:
                lines = Path(attempt.log).read_text("utf-8", "replace").strip().splitlines()
            except OSError:
                lines = [f"see {attempt.log}"]
            named = [line for line in lines if _CAUSE.match(line)]
            attempt.cause, said = (named or lines or [""])[-1].strip(), f"failed (exit {code})"
        cause = f": {attempt.cause} (log: {attempt.log})" if attempt.cause else ""
        level = logging.ERROR if attempt.cause else logging.INFO
        log.log(level, "Sweep job #%d %s after %.0f s%s", attempt.num, said, took, cause)
        self._save()
        return attempt

    def _save(self) -> None:
        payload = json.dumps({"attempts": [asdict(a) for a in self.attempts]}, indent=1)
        atomic_write(self.dir / STATE_FILE, payload + "\n")


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def job_rows(attempts: Sequence[Attempt], not_started: Sequence[Sequence[str]] = ()) -> list[dict]:
    """One row per job, in job order, then the jobs a stop kept back (``not_started``)."""
    by_job: dict[tuple[str, ...], list[Attempt]] = {}
    for attempt in attempts:
        by_job.setdefault(tuple(attempt.overrides), []).append(attempt)
    rows: list[dict] = []
    for overrides, tries in sorted(by_job.items(), key=lambda item: item[1][0].num):
        done = next((a for a in tries if finished(a)), None)
        last = done or tries[-1]
        data = read_metrics(last.dir)
        monitor, best = data.get("monitor") or "", data.get("best_score")
        if done is None:  # stopped or failed: no metrics.json, but its checkpoints know the best
            monitor, best = checkpoint_best(tries)
        rows.append({
            "job": tries[0].num, "status": "finished" if done else last.status,
            "overrides": " ".join(overrides), "attempts": len(tries), "monitor": monitor,
            "best": best, "wall_s": round(sum((a.ended or a.started) - a.started for a in tries), 1),
            "energy_j": (data.get("energy") or {}).get("energy_j"), "dir": last.dir,
            **dict(sorted((data.get("metrics") or {}).items())),
        })  # fmt: skip
    not_yet = [" ".join(o) for o in not_started if tuple(o) not in by_job]
    return rows + [{"job": "", "status": "not started", "overrides": o} for o in not_yet]


def checkpoint_best(attempts: Sequence[Attempt]) -> tuple[str, float | None]:
    """An unfinished job's monitored key and best score, from its newest checkpoint."""
    path = newest_checkpoint(a.dir for a in attempts)
    if path is None:
        return "", None
    from runkit.safety.checkpoints import load_file

    try:  # a sharded checkpoint keeps the callbacks' state in meta.pt, beside the shards
        data = load_file(path / "meta.pt" if path.is_dir() else path, mmap=True)
    except RunError as err:
        log.warning("No best score for the summary from %s: %s", path, err)
        return "", None
    for key, state in (data.get("callbacks") or {}).items():
        score = state.get("best_model_score") if isinstance(state, dict) else None
        if key.startswith("ModelCheckpoint") and score is not None:
            return str(state.get("monitor") or ""), float(score)
    return "", None


def write_summary(sweep_dir: Path, rows: Sequence[dict]) -> Path:
    fields = FIXED + sorted({k for row in rows for k in row} - set(FIXED))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=fields, restval="")
    writer.writeheader()
    writer.writerows(rows)
    return atomic_write(sweep_dir / "summary.csv", text.getvalue())


def varying(rows: Sequence[dict]) -> list[str]:
    """Each job's overrides minus those every job has: what tells the jobs apart."""
    lists = [row["overrides"].split(" ") for row in rows]
    common = set.intersection(*map(set, lists)) if len(lists) > 1 else set()
    return [" ".join(o for o in overrides if o not in common) for overrides in lists]


def print_table(rows: Sequence[dict], key: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Sweep summary")
    for name in filter(None, ("job", "status", "values", "best", key, "wall s", "energy J")):
        table.add_column(name)
    for row, values in zip(rows, varying(rows), strict=True):
        shown = [(n, 4) for n in ("best", key) if n] + [("wall_s", 0), ("energy_j", 0)]
        numbers = [f"{v:.{d}f}" if (v := _number(row.get(n))) is not None else "" for n, d in shown]
        table.add_row(str(row.get("job", "")), row["status"], values, *numbers)
    Console(width=max(100, Console().width)).print(table)


def plot_summary(sweep_dir: Path, rows: Sequence[dict], key: str | None) -> None:
    """``summary.png``: each job's ``key`` (else its best score) as a bar."""
    name = key if key and any(_number(row.get(key)) is not None for row in rows) else "best"
    points = [
        (label or f"#{row['job']}", _number(row.get(name)))
        for row, label in zip(rows, varying(rows), strict=True)
    ]
    points = [(label, value) for label, value in points if value is not None]
    if not points:
        return
    try:
        from matplotlib.figure import Figure
    except ImportError:
        log.info("summary.png needs matplotlib: pip install 'lightning-runkit[plot]'")
        return
    figure = Figure(figsize=(8, 0.5 * len(points) + 1.5))
    axes = figure.subplots()
    labels, values = zip(*points, strict=True)
    axes.barh(range(len(values)), values, tick_label=labels)
    axes.invert_yaxis()
    monitor = next((row["monitor"] for row in rows if row.get("monitor")), "")
    xlabel = name if name != "best" else f"best {monitor}".strip()
    axes.set(xlabel=xlabel, title=f"{len(points)} job(s) of {sweep_dir.name}")
    with warnings.catch_warnings():  # very long labels: the figure is still readable
        warnings.simplefilter("ignore")
        figure.tight_layout()
    atomic_write(sweep_dir / "summary.png", lambda out: figure.savefig(out, format="png", dpi=100))


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
