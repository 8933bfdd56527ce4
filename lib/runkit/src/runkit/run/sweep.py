"""Sweeps that fill one machine: up to ``n_jobs`` jobs at once, each a process of its own, resumable.

``python -m <package>.train -m hydra/launcher=parallel model.optimizer.lr=0.1,0.01,0.001``

**One job, one process, one single run.** Each job is started as
``python -m <entry> <the job's overrides> hydra.run.dir=<its folder> hydra.mode=RUN``, so what a
single run guarantees holds for every job unchanged: its GPU claims, its DDP ranks, its signal
handling and 128+N exit, its one-line errors. Every job is added ``select_gpus=least_used`` and a
long ``gpu_wait_s`` (the preset's ``job_overrides``; a job's own value wins), so jobs take free
GPUs through the claims (:mod:`runkit.gpus.claims`) and wait while all are taken.

Why not hydra-joblib-launcher: its loky workers are long-lived processes that run jobs one after
another inside them, so a job inherits the previous job's CUDA context, signal handlers and
``sys.argv`` (which Lightning re-runs for DDP ranks), a SIGTERM to the sweep reaches no worker,
and a worker killed mid-job takes the pool's other jobs' results with it.

**Stopping.** Ctrl-C or SIGTERM to the sweep goes to every running job (each saves its
``interrupted.ckpt`` and exits 128+N, as single runs do), no new job starts, and the sweep exits
128+N once they have. Jobs run in sessions of their own and end themselves if the sweep dies
without a word (``kill -9``): each asks the kernel for SIGTERM when its parent dies
(:func:`follow_sweep_parent`), so no job process outlives the sweep.

**Resuming.** The launcher records each attempt of each job in ``<sweep dir>/sweep_state.json``.
Rerunning the same command with ``hydra.sweep.dir=<that sweep>`` skips the jobs that finished
(their ``metrics.json``), continues the interrupted ones from their newest checkpoint in a new
attempt folder (``<num>-attempt<k>``: a run directory is written by one run), starts the rest,
and says how many of each in one line. A lock in the sweep folder keeps two sweeps out of it.

**Summary.** When the sweep ends (stopped or not), ``summary.csv`` (:mod:`runkit.run.sweep_summary`)
holds every job's overrides, status, monitored best, final metrics, wall time and GPU energy; the
same is printed as a table and drawn in ``summary.png``.

Imports stay light (no torch, no Lightning): Hydra imports this module whenever it lists plugins.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runkit.errors import RunError
from runkit.processes import die_with_parent
from runkit.quoting import config_options, hydra_value

log = logging.getLogger(__name__)

STATE_FILE = "sweep_state.json"
LOCK_FILE = ".sweep.lock"
PARENT_ENV = "RUNKIT_SWEEP_PARENT"
"""Set for each job: the sweep's pid, which the job follows (:func:`follow_sweep_parent`)."""
POLL_S = 0.2
"""How often the launcher looks at its jobs and at the stop signal."""
STOP_GRACE_S = 600.0
"""After a stop signal, how long the launcher waits for its jobs to save before killing them."""


@dataclass
class Attempt:
    """One process of one job of the sweep, as ``sweep_state.json`` records it."""

    num: int
    overrides: list[str]
    """The job's own overrides (the sweep's values), without what the launcher added."""
    dir: str
    log: str
    status: str = "running"
    """running, finished, interrupted (stopped by a signal), failed."""
    exit_code: int | None = None
    started: float = field(default_factory=time.time)
    ended: float | None = None
    resumed_from: str | None = None
    pid: int | None = None
    cause: str | None = None
    """A failed attempt's last line that names why."""


class SweepState:
    """Every attempt of every job of one sweep folder, kept in ``sweep_state.json``."""

    def __init__(self, sweep_dir: Path) -> None:
        self.sweep_dir = sweep_dir
        self.path = sweep_dir / STATE_FILE
        self.attempts: list[Attempt] = []
        if self.path.exists():
            self.attempts = _read_attempts(self.path)

    def of(self, overrides: Sequence[str]) -> list[Attempt]:
        return [a for a in self.attempts if a.overrides == list(overrides)]

    def used_nums(self) -> set[int]:
        return {a.num for a in self.attempts}

    def save(self) -> None:
        payload = {"attempts": [asdict(a) for a in self.attempts]}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)


def _read_attempts(path: Path) -> list[Attempt]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return [Attempt(**entry) for entry in data["attempts"]]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise RunError(
            f"{str(path)!r} is damaged ({type(err).__name__}: {err}); it records the jobs of this "
            "sweep: restore it, or start a new sweep in another hydra.sweep.dir"
        ) from None


def finished(attempt: Attempt) -> bool:
    """Whether the attempt's run completed: it wrote ``metrics.json`` (a kill -9 of the sweep
    leaves "running" in the record of a job that went on to finish)."""
    return (Path(attempt.dir) / "metrics.json").is_file()


def newest_checkpoint(attempts: Sequence[Attempt]) -> Path | None:
    """The newest complete checkpoint any attempt of a job saved (``interrupted.ckpt``, ``last``;
    a file, or a sharded directory under ``trainer=fsdp``)."""
    from runkit.run.launch import complete_checkpoint

    found = [
        path
        for attempt in attempts
        for path in (Path(attempt.dir) / "checkpoints").glob("*.ckpt")
        if complete_checkpoint(path)
    ]
    return max(found, key=lambda p: (p.stat().st_mtime_ns, p.name)) if found else None


def read_metrics(run_dir: str | Path) -> dict[str, Any] | None:
    """A run's ``metrics.json``, or ``None`` when it is missing or damaged."""
    try:
        data = json.loads((Path(run_dir) / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def default_n_jobs(environ: Mapping[str, str] | None = None) -> int:
    """The number of GPUs this process may use (NVML and ``CUDA_VISIBLE_DEVICES``), or 1."""
    from runkit.gpus.inventory import IDENTITY, collect_inventory
    from runkit.gpus.records import TorchCuda

    inventory = collect_inventory(torch_info=TorchCuda(), env=environ, detail=IDENTITY)
    return max(1, len(inventory.visible))


def check_n_jobs(value: Any) -> int | None:
    """``hydra.launcher.n_jobs``: a positive integer, or null for one job per visible GPU."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RunError(
            f"hydra.launcher.n_jobs={value!r} is invalid; expected a positive integer (jobs at "
            "once) or null (one per visible GPU, 1 without a GPU)"
        )
    return value


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def job_command(
    entry: Sequence[str],
    overrides: Sequence[str],
    hydra_overrides: Sequence[str],
    extra: Mapping[str, Any],
    run_dir: Path,
    num: int,
) -> list[str]:
    """The command of one job: ``entry`` (``[python, -m, module]``), the job's overrides, the
    ``extra`` ones its own overrides do not set, the sweep's ``hydra.*`` overrides, its folder."""
    own = {_key(o) for o in overrides}
    added = [f"{key}={hydra_value(value)}" for key, value in extra.items() if key not in own]
    kept = [
        o
        for o in hydra_overrides
        if _key(o) not in ("hydra.mode", "hydra.run.dir", "hydra.job.num", "hydra.job.id")
    ]
    return [
        *entry,
        *overrides,
        *added,
        *kept,
        f"hydra.run.dir={hydra_value(str(run_dir))}",
        f"hydra.job.num={num}",
        f"hydra.job.id={num}",
        "hydra.mode=RUN",
    ]


def entry_command() -> list[str]:
    """How to start this program again: ``python -m <module>`` when run so, else its script,
    with the command line's config options (``--config-dir``...): a job finds the same configs."""
    options = config_options(sys.argv[1:])
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        module = spec.name.removesuffix(".__main__")
        return [sys.executable, "-m", module, *options]
    return [sys.executable, os.path.abspath(sys.argv[0]), *options]


def follow_sweep_parent(environ: MutableMapping[str, str] | None = None) -> None:
    """In a job of a parallel sweep: get SIGTERM from the kernel when the sweep process dies.

    The job then saves and exits as on any SIGTERM (PR_SET_PDEATHSIG, Linux). A sweep that died
    before this ran (the job's parent is then another process) ends the job at once. Elsewhere
    the job keeps running and finishes (macOS has no such request).
    """
    env = os.environ if environ is None else environ
    parent = env.pop(PARENT_ENV, None)  # the job's own DDP ranks follow the job, not the sweep
    if not parent:
        return
    die_with_parent(signal.SIGTERM)
    if str(os.getppid()) != parent:
        print(f"error: the sweep (pid {parent}) ended before this job started", file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM)


class _Running:
    def __init__(self, attempt: Attempt, proc: subprocess.Popen, handle: Any, index: int) -> None:
        self.attempt, self.proc, self.handle, self.index = attempt, proc, handle, index


class ParallelSweep:
    """Runs one batch of jobs a sweeper hands over, up to ``n_jobs`` at once (module docstring).

    Args:
        sweep_dir: the sweep's folder (``hydra.sweep.dir``).
        n_jobs: jobs at once.
        entry: the command that runs one job (:func:`entry_command`).
        hydra_overrides: the command line's ``hydra.*`` overrides, passed on to every job.
        job_overrides: added to every job whose own overrides do not set the key.
    """

    def __init__(
        self,
        sweep_dir: Path,
        n_jobs: int,
        entry: Sequence[str],
        hydra_overrides: Sequence[str],
        job_overrides: Mapping[str, Any],
    ) -> None:
        self.sweep_dir, self.n_jobs = sweep_dir, n_jobs
        self.entry, self.hydra_overrides = list(entry), list(hydra_overrides)
        self.job_overrides = dict(job_overrides)
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self.sweep_dir)
        self.state = SweepState(self.sweep_dir)
        self.counts = {"skipped": 0, "resumed": 0, "started": 0}

    def run(self, jobs: Sequence[tuple[list[str], Path, int]]) -> list[Attempt | None]:
        """Run ``jobs`` (overrides, the folder of a first attempt, number); for each, the attempt
        that ran or finished it (``None``: not started, the sweep was stopped first)."""
        from runkit.safety import signals

        results: list[Attempt | None] = [None] * len(jobs)
        pending: list[tuple[int, list[str], Path, int]] = []
        for index, (overrides, first_dir, num) in enumerate(jobs):
            earlier = self.state.of(overrides)
            done = next((a for a in earlier if finished(a)), None)
            if done is not None:
                if done.status != "finished":  # the sweep died before it saw the job finish
                    done.status, done.exit_code = "finished", 0
                results[index] = done
                self.counts["skipped"] += 1
                continue
            for attempt in earlier:
                if attempt.status == "running":  # the sweep was killed while it ran
                    attempt.status = "interrupted"
            pending.append((index, overrides, first_dir, num))
        running: list[_Running] = []
        stopping: int | None = None
        deadline = float("inf")
        try:
            while pending or running:
                received = signals.request.received
                if received is not None and stopping is None:
                    stopping, deadline = received, time.monotonic() + STOP_GRACE_S
                    for job in running:
                        _signal_group(job.proc, received)
                    log.info("Sweep: stopping %d running job(s); no new job starts", len(running))
                if stopping is not None:
                    pending = []
                    if time.monotonic() > deadline:
                        for job in running:
                            _signal_group(job.proc, signal.SIGKILL)
                while pending and len(running) < self.n_jobs:
                    index, overrides, first_dir, num = pending.pop(0)
                    running.append(self._start(index, overrides, first_dir, num))
                for job in list(running):
                    code = job.proc.poll()
                    if code is None:
                        continue
                    running.remove(job)
                    self._finish(job, code)
                    results[job.index] = job.attempt
                time.sleep(POLL_S)
        finally:
            for job in running:  # an exception in the launcher: no job outlives it
                _signal_group(job.proc, signal.SIGKILL)
                job.proc.wait()
                self._finish(job, job.proc.returncode)
            self.state.save()
        log.info(
            "Sweep: %d job(s) skipped (finished earlier), %d resumed, %d started",
            self.counts["skipped"],
            self.counts["resumed"],
            self.counts["started"],
        )
        return results

    def _start(self, index: int, overrides: list[str], first_dir: Path, num: int) -> _Running:
        from runkit.safety import signals

        earlier = self.state.of(overrides)
        used = self.state.used_nums()
        if not earlier and (num in used or first_dir.exists()):
            num = max(used | {num}) + 1  # another job has this number (an earlier sweep's draw)
            first_dir = first_dir.with_name(str(num))
        run_dir = (
            first_dir
            if not earlier
            else first_dir.with_name(f"{earlier[0].num}-attempt{len(earlier) + 1}")
        )
        num = earlier[0].num if earlier else num
        extra = dict(self.job_overrides)
        resume = newest_checkpoint(earlier)
        if resume is not None:
            extra["ckpt_path"] = str(resume)
            self.counts["resumed"] += 1
            log.info("Sweep job #%d resumes from %s", num, resume)
        else:
            self.counts["started"] += 1
        if resume is not None:  # the checkpoint wins over the job's own ckpt_path
            overrides_run = [o for o in overrides if _key(o) != "ckpt_path"]
        else:
            overrides_run = list(overrides)
        logs = self.sweep_dir / "logs"
        logs.mkdir(exist_ok=True)
        log_path = logs / f"{run_dir.name}.log"
        command = job_command(self.entry, overrides_run, self.hydra_overrides, extra, run_dir, num)
        attempt = Attempt(
            num,
            list(overrides),
            str(run_dir),
            str(log_path),
            resumed_from=str(resume) if resume is not None else None,
        )
        handle = open(log_path, "ab")  # noqa: SIM115 - closed in _finish
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        proc = subprocess.Popen(
            command, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        attempt.pid = proc.pid
        signals.request.children.append(proc)  # a second Ctrl-C kills them with the sweep
        self.state.attempts.append(attempt)
        self.state.save()
        log.info("Sweep job #%d started: %s (log: %s)", num, " ".join(overrides), log_path)
        return _Running(attempt, proc, handle, index)

    def _finish(self, job: _Running, code: int) -> None:
        from runkit.safety import signals

        job.handle.close()
        with contextlib.suppress(ValueError):
            signals.request.children.remove(job.proc)
        attempt = job.attempt
        attempt.exit_code, attempt.ended = code, time.time()
        if code == 0 and finished(attempt):
            attempt.status = "finished"
        elif code > 128 or code < 0:
            attempt.status = "interrupted"
        else:
            attempt.status = "failed"
        self.state.save()
        took = attempt.ended - attempt.started
        if attempt.status == "failed":
            attempt.cause = _last_line(Path(attempt.log))
            log.error(
                "Sweep job #%d failed (exit %s) after %.0f s: %s (log: %s)",
                attempt.num,
                code,
                took,
                attempt.cause,
                attempt.log,
            )
        else:
            log.info("Sweep job #%d %s after %.0f s", attempt.num, attempt.status, took)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


_CAUSE = re.compile(r"^(error: |[\w.]*(Error|Exception|Interrupt)\b: )")


def _last_line(path: Path) -> str:
    """The job's last line that names a cause (``error: ...``, a traceback's ``ValueError: ...``),
    else its last line."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return f"see {path}"
    causes = [line for line in lines if _CAUSE.match(line)]
    return (causes or lines or [""])[-1].strip()


def _lock(sweep_dir: Path) -> Any:
    """Hold the sweep folder for this process: a second sweep (or resume) in it fails in one line."""
    handle = open(sweep_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held until the process ends
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise RunError(
            f"hydra.sweep.dir={str(sweep_dir)!r} is in use by another sweep that is still "
            "running; wait for it, or pick another hydra.sweep.dir"
        ) from None
    return handle
