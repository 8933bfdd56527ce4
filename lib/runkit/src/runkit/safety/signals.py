"""Stop signals (Ctrl-C, SIGTERM, SLURM's SIGUSR1): recorded at once, acted on at a safe point.

A handler that does real work wherever Python happens to be (inside a gloo collective, say)
hangs DDP jobs: Lightning 2.6's SIGTERM handler broadcasts a tensor from inside the handler and
forwards the signal to the workers, so ranks enter mismatched collectives and wait forever. Here
the handler only records the signal. The run acts on it where every rank is at the same point:
at a batch boundary inside Lightning's loops, where the ranks agree with one tiny all-reduce
(:mod:`runkit.safety.interrupts`), or when the run ends. Either way the process exits
with ``128 + signal`` (130 for Ctrl-C, 143 for SIGTERM) after one line saying so.

Two things Python's own signal handling cannot do are done by a watcher thread, which hears
every signal through :func:`signal.set_wakeup_fd` even while the main thread is blocked in C++:

* A second Ctrl-C (or SIGTERM) quits at once, without saving, exit ``128 + signal``, in any
  phase, the first signal's save included. After SLURM's SIGUSR1 a SIGTERM does not: it comes
  while the save SIGUSR1 asked for is under way.
* In a distributed run, a rank whose main thread is stuck in a collective (waiting for a rank
  that never comes, where Python runs no handler) cannot reach the next safe point. When the
  handler has not run ``STUCK_GRACE_S`` after the signal, or the main thread has been waiting in
  one ``torch.distributed`` call that long since, the rank says so in one line and exits
  ``128 + signal`` without saving; the last complete checkpoint stays.

Standard library only: the CLI installs the handlers before torch and Lightning load, so a DDP
worker signalled while it starts up is covered too.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

CHILD_GRACE_S = 30.0
"""How long a stopping rank 0 waits for the DDP workers it launched before killing them."""
STUCK_GRACE_S = 10.0
"""How long a rank of a distributed run may stay stuck after a stop signal before it quits."""


@dataclass
class StopRequest:
    """What this process knows about a stop: the signal it got and what the ranks agreed on."""

    received: int | None = None
    """The first stop signal this process received, acted on at the next safe point."""
    agreed: int | None = None
    """The stop every rank agreed on (set by :mod:`~runkit.safety.interrupts`)."""
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
def stop_on_signal(until_exit: bool = False) -> Iterator[StopRequest]:
    """Record stop signals for the length of the block; a stop not acted on ends it in 128 + N.

    ``until_exit`` (the CLI, whose process ends after the block): a signal after the block,
    while the interpreter shuts down, still ends in one line and ``128 + N`` rather than in a
    bare death by the signal. Outside the main thread (where handlers cannot be set) the block
    runs unchanged.
    """
    global request
    if threading.current_thread() is not threading.main_thread() or request.active:
        yield request
        return
    previous = {signum: signal.getsignal(signum) for signum in stop_signals()}
    request = StopRequest(active=True, quiet=not rank_zero())  # a fresh one per run
    for signum in previous:
        signal.signal(signum, _record)
    watcher = _Watcher(request)
    try:
        yield request
    finally:
        request.active = False
        watcher.close()
        for signum, handler in previous.items():
            if until_exit:
                handler = _after_the_run
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    if request.received is not None and not _started_by_rank0():
        # The work finished but a signal came: say so in the exit code.
        exit_stopped(request.received)


def _after_the_run(signum: int, frame: FrameType | None) -> None:
    """A stop signal while the finished process shuts down: its files are all written."""
    if request.quiet:
        os._exit(128 + signum)
    quit_now(signum, "received after the run had finished (its files are complete)")


def _record(signum: int, frame: FrameType | None) -> None:
    if request.received is not None:
        if _quits_at_once(request.received, signum):
            quit_now(signum, "again: quitting at once, without saving")
        return
    request.received = signum
    again = " (Ctrl-C again quits at once, without saving)" if signum == signal.SIGINT else ""
    _say(f"\n{signal.Signals(signum).name} received: stopping at the next safe point{again}")


def _quits_at_once(first: int, again: int) -> bool:
    """A second stop signal quits at once, unless it is the SIGTERM that follows SLURM's
    SIGUSR1 warning (the save asked for is under way; SLURM's SIGKILL comes anyway)."""
    return first != signal.SIGUSR1 or again == signal.SIGUSR1


_quitting = threading.Lock()


def quit_now(signum: int, why: str) -> None:
    """Say in one line why this process stops without saving, and exit ``128 + signum`` now.

    ``os._exit``: from the watcher thread, and past any code the main thread is stuck in. The
    GPU claims (flock) go with the process; files being written stay temporaries, never a
    half-written checkpoint under a real name.
    """
    if not _quitting.acquire(blocking=False):
        return  # the other thread is saying it already
    code = 128 + int(signum)
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK")
    where = f"rank {rank}: " if rank not in (None, "", "0") else ""
    with contextlib.suppress(Exception):
        print(
            f"\nerror: {where}{signal.Signals(signum).name} {why}; exit code {code}",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
    for child in request.children:
        with contextlib.suppress(Exception):
            child.kill()
    os._exit(code)


class _Watcher:
    """Hears every signal (:func:`signal.set_wakeup_fd`), even while the main thread is in C++.

    Quits at once on a second stop signal, and in a distributed run when the main thread stays
    stuck after the first one (see the module docstring). Does nothing where a wakeup file
    descriptor cannot be set.
    """

    def __init__(self, stop: StopRequest) -> None:
        self.stop, self.first_at = stop, 0.0
        self._waiting: tuple[Any, float] | None = None  # (the main thread's frame, since when)
        self._reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer = writer
        try:
            self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main thread, or a platform without it
            self._previous_fd = None
            self.close()
            return
        # Here, not in the thread: a block that ends at once closes the socket before the thread
        # runs, and settimeout on a closed socket would end the thread with a traceback.
        self._reader.settimeout(0.5)
        self._thread = threading.Thread(target=self._run, name="signal-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._previous_fd is not None:
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(self._previous_fd)
            self._previous_fd = None
        for end in (self._writer, self._reader):
            with contextlib.suppress(OSError):
                end.close()

    def _run(self) -> None:
        stops = {int(s) for s in stop_signals()}
        first: int | None = None
        while True:
            try:
                data = self._reader.recv(64)
            except TimeoutError:
                data = b""
            except OSError:
                return  # closed: the run is over
            for signum in (b for b in data if b in stops):
                if first is None:
                    first, self.first_at = signum, time.monotonic()
                elif _quits_at_once(first, signum):
                    quit_now(signum, "again: quitting at once, without saving")
            if first is not None and _distributed():
                self._check_stuck(first)

    def _check_stuck(self, signum: int) -> None:
        now = time.monotonic()
        if self.stop.received is None and now - self.first_at > STUCK_GRACE_S:
            quit_now(
                signum,
                f"received, but this rank stayed stuck in native code for {STUCK_GRACE_S:.0f} s "
                "(a collective waiting for another rank?); stopping without saving",
            )
        call = _main_thread_in_torch_distributed()
        if call is None:
            self._waiting = None
            return
        if self._waiting is None or self._waiting[0] != call:
            self._waiting = (call, now)
        elif now - self._waiting[1] > STUCK_GRACE_S:
            quit_now(
                signum,
                f"received, but this rank waited {STUCK_GRACE_S:.0f} s in torch.distributed."
                f"{call[0]} for another rank; stopping without saving",
            )


def _main_thread_in_torch_distributed() -> tuple[str, int, int] | None:
    """``(function, frame id, instruction)`` when the main thread's innermost Python frame is a
    ``torch.distributed`` function (a collective, blocked in C++ until every rank is there)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None or f"torch{os.sep}distributed{os.sep}" not in frame.f_code.co_filename:
        return None
    return (frame.f_code.co_name, id(frame), frame.f_lasti)


def _distributed() -> bool:
    """Whether this process is one rank of several (a launcher's variables or torch say so)."""
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        return True
    dist = sys.modules.get("torch.distributed")  # never imported here: this module is stdlib-only
    try:
        return bool(dist and dist.is_initialized() and dist.get_world_size() > 1)
    except Exception:
        return False


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
