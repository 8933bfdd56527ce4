"""What every benchmark here shares: interleaved A/B repeats, medians and spread, the machine.

The machines these run on are shared and noisy, so no script prints an absolute time as a
verdict. Each compares two arms measured in the same process (or the same run), interleaved
A, B, B, A, ... so that a slow minute hurts both arms alike, and reports the median of the
per-repeat ratios together with their spread.

Also the small Lightning callbacks the benchmarks add to the template's own run through its
config (``+callbacks.<name>._target_=_common.<Class>``, with ``benchmarks/`` on ``PYTHONPATH``):
they record timestamps only, so they add no work of their own to what they measure.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pickle
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent

# The clocks append here: a run started through ``project.train.train(cfg)`` builds its own
# callback objects from the config, so the benchmark reads the stamps from this module instead.
EPOCH_STAMPS: list[tuple[float, float]] = []
# Wall-clock durations of training steps, start of one batch to the start of the next (the last
# batch of each epoch, followed by validation, is left out), of the run being measured.
STEP_TIMES: list[float] = []
FIRST_STEP_ENV = "RUNKIT_BENCH_FIRST_STEP"
# Set by run_all.py: every ratio line printed is also appended here as one JSON object.
RESULTS_ENV = "RUNKIT_BENCH_RESULTS"


_WAITED: Any = None  # in a run of side_by_side: the seconds it has waited for its turns


def clock() -> float:
    """``time.perf_counter()``, less the seconds this run waited for its turns when it runs
    :func:`side_by_side` (a shared value its controller raises while the run is stopped): the
    wall time the run held the machine. Read twice around the clock, so that a stop between the
    reads cannot mix one turn's waiting with another's time."""
    if _WAITED is None:
        return time.perf_counter()
    while True:
        waited = _WAITED.value
        now = time.perf_counter()
        if _WAITED.value == waited:
            return now - waited


def stamp() -> tuple[float, float]:
    """(:func:`clock` seconds, CPU seconds of this process, all threads) at this moment.

    The CPU time is what the process itself did: on a machine shared with other busy processes it
    barely moves when the scheduler parks this one, so its ratios are steadier than wall time
    (for a single-threaded CPU run they measure the same work).
    """
    return clock(), time.process_time()


def epoch_clock() -> Any:
    """A Lightning callback appending to :data:`EPOCH_STAMPS` at each training epoch start and at
    the end of training.

    The interval between two starts is one whole epoch cycle: the training steps, the validation
    pass and the epoch-end hooks (logging, checkpoints, progress bar). Built by a function so
    that importing this module does not import Lightning (``startup.py`` must not).
    """
    from lightning.pytorch import Callback

    class _Clock(Callback):
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            EPOCH_STAMPS.append(stamp())
            self.batch_start: float | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            now = clock()
            if getattr(self, "batch_start", None) is not None:
                STEP_TIMES.append(now - self.batch_start)
            self.batch_start = now

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            EPOCH_STAMPS.append(stamp())

    return _Clock()


EPOCH_FILE_ENV = "RUNKIT_BENCH_EPOCH_FILE"


def epoch_clock_file() -> Any:
    """Like :func:`epoch_clock`, for a run in another process (``python -m project.train``):
    rank 0 appends ``time.time()`` and its CPU time (``time.process_time()``) to the file named
    by ``$RUNKIT_BENCH_EPOCH_FILE`` at each training epoch start and at the end of training."""
    from lightning.pytorch import Callback

    class _FileClock(Callback):
        def _write(self, trainer: Any) -> None:
            if trainer.is_global_zero:
                with open(os.environ[EPOCH_FILE_ENV], "a") as handle:
                    handle.write(f"{time.time():.6f} {time.process_time():.6f}\n")

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self._write(trainer)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._write(trainer)

    return _FileClock()


def first_step_stamp() -> Any:
    """A Lightning callback that, at the first training batch, writes ``time.time()`` to the file
    named by ``$RUNKIT_BENCH_FIRST_STEP`` and ends the process at once (exit code 0).

    ``startup.py`` adds it to a real ``python -m project.train`` run to time the way from the
    shell to the first step; ending there keeps the benchmark short and leaves no checkpoint.
    """
    from lightning.pytorch import Callback

    class _FirstStep(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            Path(os.environ[FIRST_STEP_ENV]).write_text(f"{time.time():.6f}\n")
            sys.stdout.flush()
            os._exit(0)

    return _FirstStep()


@dataclass
class Arms:
    """Measurements of named arms, appended repeat by repeat."""

    names: Sequence[str]
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def median(self, name: str) -> float:
        return statistics.median(self.values[name])

    def ratios(self, numerator: str, *denominators: str) -> list[float]:
        """Per-repeat ratios: repeat i of one arm over repeat i of the other, or over the
        geometric mean of repeat i of several (a baseline measured more than once)."""
        columns = [self.values[name] for name in denominators]
        return [
            value / math.prod(row) ** (1 / len(row))
            for value, *row in zip(self.values[numerator], *columns, strict=True)
        ]


def _fork(run: Callable[..., Any], args: tuple, result_path: str, first: Any = None) -> int:
    """Fork a child that calls ``first()`` (when given), then ``run(*args)``, writes the pickled
    result to ``result_path`` and leaves without the parent's exit (status 1, the traceback on
    stderr, when either raises); returns its PID."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    status = 0
    try:
        if first is not None:
            first()
        Path(result_path).write_bytes(pickle.dumps(run(*args)))
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _result_file() -> str:
    handle, path = tempfile.mkstemp(prefix="benchmark-run-", suffix=".pickle")
    os.close(handle)
    return path


def in_own_process(run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)`` in a child forked for it; returns what it returns (pickled back).

    A user's run is a process of its own. Run one after the other in one process, arms share the
    heap and the garbage collector's state the earlier ones left, and a process-wide setting one
    arm makes (the template's ``keep_freed_memory``) reaches every arm after it. The caller
    trains nothing itself, so each child starts from the same state.
    """
    path = _result_file()
    try:
        _, status = os.waitpid(_fork(run, args, path), 0)
        if status != 0:
            raise SystemExit(f"{run.__name__} failed in its process (above); exit status {status}")
        return pickle.loads(Path(path).read_bytes())
    finally:
        Path(path).unlink(missing_ok=True)


def _first_turn(waited: Any) -> None:
    """In a run of :func:`side_by_side`: a process group of its own, stopped until its turn."""
    global _WAITED
    _WAITED = waited
    os.setpgid(0, 0)
    os.kill(os.getpid(), signal.SIGSTOP)


def side_by_side(runs: Sequence[tuple[Callable[..., Any], tuple]], slice_s: float) -> list:
    """Run ``fn(*args)`` for each of ``runs`` at once, each in a process group of its own, taking
    turns of ``slice_s`` seconds (the others stopped by SIGSTOP); returns each one's result.
    Inside a run, :func:`clock` counts only the seconds it held the machine.

    Why: the machines these run on change speed by +-10 % from one 10 ms to the next and by
    +-50 % over seconds (a pure Python loop, timed alone, nothing else running here: other
    tenants of the host). Arms run one after the other each meet a different machine, and a
    ratio of two 3 s runs spreads by +-30 %. Taking turns every few milliseconds, every arm meets
    the same machine: two identical arms of 5 s agree within 1-3 %. Each run is a process of its
    own (with its children, e.g. a sampler process, in its group), as a user's run is.

    A span a run times by ``time.perf_counter`` includes the others' turns; a timer or interval
    inside a run (``time.sleep``, a sampler's period) runs on in wall time while it is stopped.
    """
    from multiprocessing.sharedctypes import RawValue

    procs = []
    try:
        for fn, args in runs:
            path, waited = _result_file(), RawValue("d", 0.0)
            pid = _fork(fn, args, path, functools.partial(_first_turn, waited))
            with contextlib.suppress(PermissionError, ProcessLookupError):
                os.setpgid(pid, pid)  # also here: no race with the child's own call
            os.waitpid(pid, os.WUNTRACED)  # stopped, ready
            procs.append((pid, path, fn.__name__, waited))
        running = list(range(len(procs)))
        turn_ended: dict[int, float] = {}
        while running:
            for index in list(running):
                pid, path, name, waited = procs[index]
                start = time.perf_counter()
                if index in turn_ended:  # stopped since then: its clock() leaves that out
                    waited.value += start - turn_ended[index]
                os.killpg(pid, signal.SIGCONT)
                time.sleep(slice_s)
                with contextlib.suppress(ProcessLookupError):  # the group ended
                    os.killpg(pid, signal.SIGSTOP)
                _, status = os.waitpid(pid, os.WUNTRACED)  # stopped, or ended
                turn_ended[index] = time.perf_counter()
                if not os.WIFSTOPPED(status):
                    running.remove(index)
                    if os.waitstatus_to_exitcode(status) != 0:
                        raise SystemExit(f"{name} failed in its process (above)")
        return [pickle.loads(Path(path).read_bytes()) for _, path, *_ in procs]
    finally:
        for pid, path, *_ in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            Path(path).unlink(missing_ok=True)


def interleaved(repeats: int, arms: Sequence[str]) -> list[list[str]]:
    """The order of the arms in each repeat: rotated every repeat (A B C, B C A, C A B, ...).

    With two arms this is A B, B A, A B...: neither arm always runs first (warm caches) or
    second (a process that has been busy longer).
    """
    order = list(arms)
    return [order[r % len(order) :] + order[: r % len(order)] for r in range(repeats)]


def spread(values: Sequence[float]) -> tuple[float, float]:
    """(min, max) of a list of ratios: the run-to-run spread printed beside each median."""
    return min(values), max(values)


def ratio_line(label: str, ratios: Sequence[float], target: float | None = None) -> str:
    """``label  median  [min .. max]  target`` as one aligned line (and a JSON record, when
    ``$RUNKIT_BENCH_RESULTS`` names a file: the ratios :mod:`run_all` collects)."""
    low, high = spread(ratios)
    median = statistics.median(ratios)
    text = f"{label:<34} {median:7.3f}   [{low:.3f} .. {high:.3f}]"
    met = None if target is None else median >= target
    if target is not None:
        text += f"   target >= {target:g}: {'met' if met else 'NOT met'}"
    if os.environ.get(RESULTS_ENV):
        record = {
            "script": Path(sys.argv[0]).stem,
            "label": label.strip(),
            "median": round(median, 4),
            "min": round(low, 4),
            "max": round(high, 4),
            "repeats": len(ratios),
            "target": target,
            "met": met,
        }
        with open(os.environ[RESULTS_ENV], "a") as handle:
            handle.write(json.dumps(record) + "\n")
    return text


def machine_summary() -> str:
    """One line: CPU model and count, OS, Python, torch and Lightning versions (when importable)."""
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        fields = dict(
            line.split(":", 1) for line in out.splitlines() if ":" in line and line.strip()
        )
        cpu = fields.get("Model name", cpu).strip()
    except OSError:
        pass
    versions = []
    for name in ("torch", "lightning"):
        module = sys.modules.get(name)
        if module is not None:
            versions.append(f"{name} {module.__version__}")
    return (
        f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}" + (", " + ", ".join(versions) if versions else "")
    )


def quiet() -> None:
    """Silence the loggers and warnings that would drown the ratio table."""
    import logging
    import warnings

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "project"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took, by ``time.perf_counter``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def train_samples(cfg: Any) -> int:
    """Training samples per epoch of the composed config's data (the template's own split)."""
    from hydra.utils import instantiate

    data = instantiate(cfg.data)
    data.setup("fit")
    return len(data.train_set)
