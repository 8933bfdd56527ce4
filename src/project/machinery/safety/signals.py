"""Stop signals (Ctrl-C, SIGTERM, SLURM's SIGUSR1): recorded at once, acted on at a safe point.

A handler that does real work wherever Python happens to be (inside a gloo collective, say)
hangs DDP jobs: Lightning 2.6's SIGTERM handler broadcasts a tensor from inside the handler and
forwards the signal to the workers, so ranks enter mismatched collectives and wait forever. Here
the handler only records the signal. The run acts on it where every rank is at the same point:
at a batch boundary inside Lightning's loops, where the ranks agree with one tiny all-reduce
(:mod:`project.machinery.safety.interrupts`), or when the run ends. Either way the process exits
with ``128 + signal`` (130 for Ctrl-C, 143 for SIGTERM) after one line saying so. A second
Ctrl-C quits at once.

Standard library only: the CLI installs the handlers before torch and Lightning load, so a DDP
worker signalled while it starts up is covered too.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType

CHILD_GRACE_S = 30.0
"""How long a stopping rank 0 waits for the DDP workers it launched before killing them."""


@dataclass
class StopRequest:
    """What this process knows about a stop: the signal it got and what the ranks agreed on."""

    received: int | None = None
    """The first stop signal this process received, acted on at the next safe point."""
    agreed: int | None = None
    """The stop every rank agreed on (set by :mod:`~project.machinery.safety.interrupts`)."""
    phase: str = "startup"
    """What the run is doing (fit, test, export...), for the last line."""
    detail: str = ""
    """What the stop did (saved a checkpoint, requeued the job), for the last line."""
    quiet: bool = False
    """A DDP worker: rank 0 says what happens, once for the job."""
    children: list[subprocess.Popen] = field(default_factory=list)
    """DDP workers this process launched, waited for before it exits."""
    active: bool = False
    """Whether :func:`stop_on_signal` handles the signals now."""


request = StopRequest()
"""This process's request; :func:`stop_on_signal` replaces it at the start of every run."""


def stop_signals() -> tuple[signal.Signals, ...]:
    """Ctrl-C and SIGTERM; inside a SLURM job also SIGUSR1 (``#SBATCH --signal=SIGUSR1@90``)."""
    usr1 = (signal.SIGUSR1,) if slurm_job_id() else ()
    return (signal.SIGINT, signal.SIGTERM, *usr1)


@contextmanager
def stop_on_signal() -> Iterator[StopRequest]:
    """Record stop signals for the length of the block; a stop not acted on ends it in 128 + N.

    Outside the main thread (where handlers cannot be set) the block runs unchanged.
    """
    global request
    if threading.current_thread() is not threading.main_thread() or request.active:
        yield request
        return
    previous = {signum: signal.getsignal(signum) for signum in stop_signals()}
    request = StopRequest(active=True, quiet=not rank_zero())  # a fresh one per run
    for signum in previous:
        signal.signal(signum, _record)
    try:
        yield request
    finally:
        request.active = False
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    if request.received is not None and not _started_by_rank0():
        # The work finished but a signal came: say so in the exit code.
        exit_stopped(request.received)


def _record(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT and request.received is not None:
        raise KeyboardInterrupt  # Ctrl-C again: quit now, without saving
    if request.received is not None:
        return
    request.received = signum
    again = " (Ctrl-C again quits at once, without saving)" if signum == signal.SIGINT else ""
    _say(f"\n{signal.Signals(signum).name} received: stopping at the next safe point{again}")


def exit_stopped(signum: int) -> None:
    """Collect the workers, say in one line that the run stopped and why, exit ``128 + signum``."""
    for child in request.children:
        try:
            child.wait(timeout=CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    request.children = []
    code = 128 + int(signum)
    name = signal.Signals(signum).name
    _say(f"stopped by {name} during {request.phase}{request.detail}; exit code {code}")
    raise SystemExit(code)


def _say(text: str) -> None:
    if request.quiet:
        return
    with contextlib.suppress(RuntimeError, OSError):  # a reentrant write (handler), a closed stream
        print(text, file=sys.stderr, flush=True)


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """This SLURM job's id; ``None`` outside a batch job (and in ``bash``/``interactive`` ones)."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9]+", job) or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    return job


def rank_zero(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is global rank 0 (or the only process), from the launch variables."""
    env = os.environ if environ is None else environ
    ranks = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")
    return all(env.get(var, "0") in ("", "0") for var in ranks)


def _started_by_rank0(environ: Mapping[str, str] | None = None) -> bool:
    """A DDP worker that Lightning's launcher in rank 0 started (torchrun's set their own
    ``TORCHELASTIC_RUN_ID``): its exit code is read only by rank 0, which kills the whole job
    when a worker exits non-zero; rank 0 reports the signal instead."""
    env = os.environ if environ is None else environ
    return env.get("LOCAL_RANK", "0") not in ("", "0") and "TORCHELASTIC_RUN_ID" not in env
