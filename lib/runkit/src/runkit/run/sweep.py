"""Sweeps that fill one machine: up to ``n_jobs`` jobs at once, each a process of its own, resumable.

Each job runs as ``python -m <entry> <its overrides> hydra.run.dir=<its folder> hydra.mode=RUN``,
so a single run's guarantees (GPU claims, DDP, stops, one-line errors) hold for every job; the
preset adds ``select_gpus=least_used`` and a long ``gpu_wait_s``. hydra-joblib-launcher reuses
worker processes across jobs (CUDA context, handlers and ``sys.argv`` carry over, a SIGTERM
reaches no job). A stop signal goes to every running job (each saves and exits 128+N), no new
job starts, and the sweep exits 128+N; jobs get SIGTERM from the kernel when the sweep dies.
``sweep_state.json`` records every attempt: the same command with ``hydra.sweep.dir`` skips the
finished jobs, resumes the interrupted ones in ``<num>-attempt<k>`` and starts the rest.
``summary.csv`` (:mod:`runkit.run.sweep_summary`) sums up every job. Imports stay light.
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
from runkit.safety import signals

log = logging.getLogger(__name__)

STATE_FILE = "sweep_state.json"
LOCK_FILE = ".sweep.lock"
PARENT_ENV = "RUNKIT_SWEEP_PARENT"  # set for each job: the sweep's pid, which the job follows
POLL_S = 0.2  # how often the launcher looks at its jobs and at the stop signal
STOP_GRACE_S = 600.0  # after a stop signal, how long the jobs may take to save before a kill


@dataclass
class Attempt:
    """One process of one job of the sweep, as ``sweep_state.json`` records it."""

    num: int
    overrides: list[str]  # the job's own overrides, without what the launcher added
    dir: str
    log: str
    status: str = "running"  # running, finished, interrupted (by a signal), failed
    exit_code: int | None = None
    started: float = field(default_factory=time.time)
    ended: float | None = None
    resumed_from: str | None = None
    pid: int | None = None
    cause: str | None = None  # a failed attempt's last line that names why


class SweepState:
    """Every attempt of every job of one sweep folder, kept in ``sweep_state.json``."""

    def __init__(self, sweep_dir: Path) -> None:
        self.path = sweep_dir / STATE_FILE
        self.attempts: list[Attempt] = []
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                self.attempts = [Attempt(**entry) for entry in data["attempts"]]
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
                raise RunError(
                    f"{str(self.path)!r} is damaged ({type(err).__name__}: {err}); it records the "
                    "jobs of this sweep: restore it, or start a new sweep in another hydra.sweep.dir"
                ) from None

    def of(self, overrides: Sequence[str]) -> list[Attempt]:
        return [a for a in self.attempts if a.overrides == list(overrides)]

    def save(self) -> None:
        payload = {"attempts": [asdict(a) for a in self.attempts]}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)


def finished(attempt: Attempt) -> bool:
    """Whether the attempt's run wrote ``metrics.json`` (a kill -9 of the sweep leaves "running"
    in the record of a job that went on to finish)."""
    return (Path(attempt.dir) / "metrics.json").is_file()


def newest_checkpoint(attempts: Sequence[Attempt]) -> Path | None:
    """The newest complete checkpoint any attempt of a job saved."""
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
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
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
    """The command of one job: ``entry``, the job's overrides, the ``extra`` ones it does not
    set itself, the sweep's ``hydra.*`` overrides, its folder and number."""
    own = {_key(o) for o in overrides}
    added = [f"{key}={hydra_value(value)}" for key, value in extra.items() if key not in own]
    mine = ("hydra.mode", "hydra.run.dir", "hydra.job.num", "hydra.job.id")
    kept = [o for o in hydra_overrides if _key(o) not in mine]
    return [
        *entry, *overrides, *added, *kept, f"hydra.run.dir={hydra_value(str(run_dir))}",
        f"hydra.job.num={num}", f"hydra.job.id={num}", "hydra.mode=RUN",
    ]  # fmt: skip


def entry_command() -> list[str]:
    """How to start this program again (``python -m <module>`` or its script), with the
    command line's config options: a job finds the same configs."""
    options = config_options(sys.argv[1:])
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return [sys.executable, "-m", spec.name.removesuffix(".__main__"), *options]
    return [sys.executable, os.path.abspath(sys.argv[0]), *options]


def follow_sweep_parent(environ: MutableMapping[str, str] | None = None) -> None:
    """In a job of a parallel sweep: get SIGTERM from the kernel when the sweep dies (it then
    saves as on any SIGTERM); a sweep already gone ends the job at once."""
    env = os.environ if environ is None else environ
    parent = env.pop(PARENT_ENV, None)  # the job's own DDP ranks follow the job, not the sweep
    if not parent:
        return
    die_with_parent(signal.SIGTERM)
    if str(os.getppid()) != parent:
        print(f"error: the sweep (pid {parent}) ended before this job started", file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM)


@dataclass
class _Running:
    attempt: Attempt
    proc: subprocess.Popen
    handle: Any
    index: int


class ParallelSweep:
    """Runs the jobs a sweeper hands over, up to ``n_jobs`` at once, in ``sweep_dir``; ``entry``
    runs one job, ``hydra_overrides`` go to every job, ``job_overrides`` to those that do not
    set the key themselves."""

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
        """Run ``jobs`` (overrides, first folder, number); for each, the attempt that ran or
        finished it (``None``: the sweep was stopped first)."""
        results: list[Attempt | None] = [None] * len(jobs)
        pending = []
        for index, (overrides, first_dir, num) in enumerate(jobs):
            earlier = self.state.of(overrides)
            done = next((a for a in earlier if finished(a)), None)
            if done is not None:
                done.status, done.exit_code = "finished", 0
                results[index] = done
                self.counts["skipped"] += 1
                continue
            for attempt in earlier:
                if attempt.status == "running":  # the sweep was killed while it ran
                    attempt.status = "interrupted"
            pending.append((index, overrides, first_dir, num))
        running: list[_Running] = []
        try:
            self._loop(pending, running, results)
        finally:
            for job in running:  # an exception in the launcher: no job outlives it
                _signal_group(job.proc, signal.SIGKILL)
                self._finish(job, job.proc.wait())
            self.state.save()
        counts = self.counts
        log.info(
            "Sweep: %d job(s) skipped (finished earlier), %d resumed, %d started",
            counts["skipped"], counts["resumed"], counts["started"],
        )  # fmt: skip
        return results

    def _loop(self, pending: list, running: list[_Running], results: list) -> None:
        stopping, deadline = False, float("inf")
        while pending or running:
            received = signals.request.received
            if received is not None and not stopping:
                stopping, deadline = True, time.monotonic() + STOP_GRACE_S
                pending.clear()
                for job in running:
                    _signal_group(job.proc, received)
                log.info("Sweep: stopping %d running job(s); no new job starts", len(running))
            if time.monotonic() > deadline:
                for job in running:
                    _signal_group(job.proc, signal.SIGKILL)
            while pending and len(running) < self.n_jobs:
                running.append(self._start(*pending.pop(0)))
            for job in [j for j in running if j.proc.poll() is not None]:
                running.remove(job)
                self._finish(job, job.proc.returncode)
                results[job.index] = job.attempt
            time.sleep(POLL_S)

    def _start(self, index: int, overrides: list[str], first_dir: Path, num: int) -> _Running:
        earlier = self.state.of(overrides)
        if earlier:
            num = earlier[0].num
            run_dir = first_dir.with_name(f"{num}-attempt{len(earlier) + 1}")
        else:
            used = {a.num for a in self.state.attempts}
            if num in used or first_dir.exists():  # another job has it (an earlier sweep's draw)
                num = max(used | {num}) + 1
                first_dir = first_dir.with_name(str(num))
            run_dir = first_dir
        extra, own = dict(self.job_overrides), list(overrides)
        resume = newest_checkpoint(earlier)
        if resume is not None:  # the checkpoint wins over the job's own ckpt_path
            extra["ckpt_path"] = str(resume)
            own = [o for o in overrides if _key(o) != "ckpt_path"]
            log.info("Sweep job #%d resumes from %s", num, resume)
        self.counts["resumed" if resume is not None else "started"] += 1
        (self.sweep_dir / "logs").mkdir(exist_ok=True)
        log_path = self.sweep_dir / "logs" / f"{run_dir.name}.log"
        command = job_command(self.entry, own, self.hydra_overrides, extra, run_dir, num)
        resumed_from = str(resume) if resume is not None else None
        attempt = Attempt(
            num, list(overrides), str(run_dir), str(log_path), resumed_from=resumed_from
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
        job.handle.close()
        with contextlib.suppress(ValueError):
            signals.request.children.remove(job.proc)
        attempt = job.attempt
        attempt.exit_code, attempt.ended = code, time.time()
        if code == 0 and finished(attempt):
            attempt.status = "finished"
        else:
            attempt.status = "interrupted" if code > 128 or code < 0 else "failed"
        took = attempt.ended - attempt.started
        if attempt.status == "failed":
            attempt.cause = _last_line(Path(attempt.log))
            log.error(
                "Sweep job #%d failed (exit %s) after %.0f s: %s (log: %s)",
                attempt.num, code, took, attempt.cause, attempt.log,
            )  # fmt: skip
        else:
            log.info("Sweep job #%d %s after %.0f s", attempt.num, attempt.status, took)
        self.state.save()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


_CAUSE = re.compile(r"^(error: |[\w.]*(Error|Exception|Interrupt)\b: )")


def _last_line(path: Path) -> str:
    """The job's last line that names a cause (``error: ...``, ``ValueError: ...``), else its
    last line."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return f"see {path}"
    causes = [line for line in lines if _CAUSE.match(line)]
    return (causes or lines or [""])[-1].strip()


def _lock(sweep_dir: Path) -> Any:
    """Hold the sweep folder for this process: a second sweep in it fails in one line."""
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
