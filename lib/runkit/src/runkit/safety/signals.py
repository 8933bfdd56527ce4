"""Stop signals (:data:`STOP_SIGNALS`): recorded at once, acted on at a safe point.

A handler that does real work wherever Python happens to be (inside a gloo collective) hangs DDP
jobs, so the handler only records the signal; :mod:`runkit.safety.interrupts` acts on it at a
batch boundary where the ranks agree, or the run ends; the process exits ``128 + signal``.
A watcher thread hears every delivery (:func:`signal.set_wakeup_fd`) even while the main thread
is in C++: a second stop signal quits at once without saving, and a distributed rank stuck
``STUCK_GRACE_S`` after the signal quits too. One stop often arrives as several deliveries (a
group's Ctrl-C, GNU ``timeout``, ``PR_SET_PDEATHSIG`` per thread): every stop signal within
``STOP_REPEAT_S`` of the first, or after the parent died, is the same stop. Forked children
(DataLoader workers) are left out of the stop. Standard library only: the CLI installs the
handlers before torch loads.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

CHILD_GRACE_S = 30.0  # how long a stopping rank 0 waits for the DDP workers it launched
STUCK_GRACE_S = 10.0  # how long a rank may stay stuck after a stop signal before it quits
STOP_REPEAT_S = 1.0  # stop signals this soon after the first are the same stop delivered again


@dataclass
class StopRequest:
    """What this process knows about a stop, and what the last line says about it."""

    received: int | None = None  # the first stop signal, acted on at the next safe point
    agreed: int | None = None  # the stop every rank agreed on (runkit.safety.interrupts)
    phase: str = "startup"  # what the run is doing (fit, test, export...)
    phase_done: bool = False  # whether that phase's files are written
    detail: str = ""  # what the stop did (saved a checkpoint, requeued the job)
    quiet: bool = False  # a DDP worker: rank 0 speaks for the job
    children: list[subprocess.Popen] = field(default_factory=list)  # waited for before exit
    active: bool = False  # whether stop_on_signal handles the signals now
    received_at: float = 0.0  # time.monotonic() of the first stop signal
    parent: int = 0  # the parent when the run began; another one means it died
    failed: bool = False  # the block ended in an exception: its own line and code follow


request = StopRequest()

STOP_SIGNALS: dict[int, Callable[[], bool]] = {
    # whether the signal is a stop in this process; the library README's table says what each does
    signal.SIGINT: lambda: True,
    signal.SIGTERM: lambda: True,
    signal.SIGHUP: lambda: signal.getsignal(signal.SIGHUP) != signal.SIG_IGN,  # not nohup
    signal.SIGUSR1: lambda: slurm_job_id() is not None,  # --signal=SIGUSR1@90
    signal.SIGUSR2: lambda: os.environ.get("SUBMITIT_EXECUTOR") == "slurm",
}
WARNINGS = (signal.SIGUSR1, signal.SIGUSR2)  # SLURM's notice: its SIGTERM after is the same stop


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals of :data:`STOP_SIGNALS` that are stops in this process now."""
    return tuple(signum for signum, applies in STOP_SIGNALS.items() if applies())


@contextmanager
def stop_on_signal(until_exit: bool = False) -> Iterator[StopRequest]:
    """Record stop signals for the block; a stop not acted on ends it in ``128 + N``.

    ``until_exit`` (the CLI): a signal while the interpreter shuts down after the block still
    ends in one line and ``128 + N``. Outside the main thread the block runs unchanged.
    """
    global request
    if threading.current_thread() is not threading.main_thread() or request.active:
        yield request
        return
    previous = {signum: signal.getsignal(signum) for signum in stop_signals()}
    request = StopRequest(active=True, quiet=not rank_zero(), parent=os.getppid())
    _before_the_run.clear()
    _before_the_run.update(previous)
    if until_exit:
        atexit.unregister(_at_exit)
        atexit.register(_at_exit)  # runs after the hooks torch and Lightning register
    _set(dict.fromkeys(previous, _record))
    watcher = _Watcher(request)
    try:
        yield request
    except BaseException:
        request.failed = True
        raise
    finally:
        request.active = False
        watcher.close()
        _set(dict.fromkeys(previous, _after_the_run) if until_exit else previous)
    if request.received is not None and not _started_by_rank0():
        exit_stopped(request.received)  # the work finished but a signal came


def _after_the_run(signum: int, frame: FrameType | None) -> None:
    """A stop signal as the finished process shuts down (after a failed run: ignored)."""
    if request.received is not None:
        if _second_request(request, signum, time.monotonic()):
            quit_now(signum, "again: quitting at once")
    elif request.quiet and not request.failed:
        os._exit(128 + signum)
    elif not request.failed:
        quit_now(signum, "received after the run had finished (its files are complete)")


def _at_exit() -> None:
    """Past the last point where Python runs a handler the stop signals are ignored."""
    _set(dict.fromkeys(stop_signals(), signal.SIG_IGN))


def _record(signum: int, frame: FrameType | None) -> None:
    """The handler: the first stop signal is recorded (the watcher judges any repeat)."""
    if request.received is not None:
        return
    request.received, request.received_at = signum, request.received_at or time.monotonic()
    _drop_closed_outputs()
    again = " (Ctrl-C again quits at once, without saving)" if signum == signal.SIGINT else ""
    _say(f"\n{signal.Signals(signum).name} received: stopping at the next safe point{again}")


def _second_request(stop: StopRequest, signum: int, now: float) -> bool:
    """Whether ``signum`` at ``now`` asks again (after SLURM's warning: only the warning)."""
    first = stop.received
    same = now - stop.received_at < STOP_REPEAT_S or stop.parent not in (0, os.getppid())
    return first is not None and not same and (first not in WARNINGS or signum == first)


_quitting = threading.Lock()


def quit_now(signum: int, why: str) -> None:
    """One line on why this process stops without saving; ``os._exit(128 + signum)``."""
    if not _quitting.acquire(blocking=False):
        return  # the other thread is saying it already
    code = 128 + int(signum)
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK")
    where = f"rank {rank}: " if rank not in (None, "", "0") else ""
    _write_line(f"\nerror: {where}{signal.Signals(signum).name} {why}; exit code {code}")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    for child in request.children:
        with contextlib.suppress(Exception):
            child.kill()
    os._exit(code)


class _Watcher:
    """Hears every signal through a wakeup socket; quits on a second request or a stuck rank."""

    def __init__(self, stop: StopRequest) -> None:
        self.stop, self.first_at = stop, 0.0  # first_at: when the first stop signal came
        self._waiting: tuple[Any, float] | None = None  # (the main thread's call, since when)
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._reader.settimeout(0.5)  # wakes to check a stuck rank, and to see the block ended
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno())
        threading.Thread(target=self._run, name="signal-watch", daemon=True).start()

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        self._writer.close()
        self._reader.close()

    def _run(self) -> None:
        stops = {int(s) for s in stop_signals()}
        while True:
            try:
                data = self._reader.recv(64)
            except TimeoutError:
                data = b""
            except OSError:
                return  # closed: the run is over
            now = time.monotonic()
            for signum in (b for b in data if b in stops):
                if not self.first_at:
                    self.first_at, self.first = now, signum
                    self.stop.received_at = self.stop.received_at or now
                elif _second_request(self.stop, signum, now):
                    quit_now(signum, "again: quitting at once, without saving")
            if self.first_at and _distributed():
                self._check_stuck(self.first, now)

    def _check_stuck(self, signum: int, now: float) -> None:
        """Quit when the handler has not run, or one torch.distributed call lasts, past the grace."""
        if self.stop.received is None and now - self.first_at > STUCK_GRACE_S:
            quit_now(
                signum,
                f"received, but this rank stayed stuck in native code for {STUCK_GRACE_S:.0f} s "
                "(a collective waiting for another rank?); stopping without saving",
            )
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        if frame is None or f"torch{os.sep}distributed{os.sep}" not in frame.f_code.co_filename:
            self._waiting = None
            return
        call = (frame.f_code.co_name, id(frame), frame.f_lasti)
        if self._waiting is None or self._waiting[0] != call:
            self._waiting = (call, now)
        elif now - self._waiting[1] > STUCK_GRACE_S:
            quit_now(
                signum,
                f"received, but this rank waited {STUCK_GRACE_S:.0f} s in torch.distributed."
                f"{call[0]} for another rank; stopping without saving",
            )


def _distributed() -> bool:
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        return True
    dist = sys.modules.get("torch.distributed")  # never imported here: stdlib only
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
    when = f"during {request.phase}"
    if request.phase_done:
        when = f"after {request.phase} had finished (its files are written)"
    _drop_closed_outputs()
    name = signal.Signals(signum).name
    _say(f"stopped by {name} {when}{request.detail}; exit code {code}", run_log=True)
    raise SystemExit(code)


def _say(text: str, run_log: bool = False) -> None:
    """``text`` on stderr; ``run_log``: in the run's log files too (a closed terminal's run)."""
    if request.quiet:
        return
    _write_line(text)
    if run_log:
        record = logging.LogRecord(__name__, logging.WARNING, __file__, 0, text, None, None)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)


def _drop_closed_outputs() -> None:
    """stdout/stderr whose reader is gone go to /dev/null: the save goes on, no traceback."""
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            poll = select.poll()
            poll.register(fd, 0)
            if any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0)):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)


def _write_line(text: str) -> None:
    """Print to stderr, also from a handler that interrupted a write to stderr."""
    try:
        print(text, file=sys.stderr, flush=True)
    except RuntimeError:  # reentrant write refused by the buffered stream
        with contextlib.suppress(OSError):
            os.write(2, f"{text}\n".encode(errors="replace"))
    except (OSError, ValueError):
        pass


_before_the_run: dict[int, Any] = {}  # the handlers stop_on_signal replaced
_fork = threading.local()  # the forking thread's signal mask from before the fork
_worker_stops: tuple[int, ...] = ()  # in a DataLoader worker: the stop signals kept blocked


def _set(handlers: Mapping[int, Any]) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _before_fork() -> None:
    """During a run, a child starts with the stop signals blocked until its own handling is set."""
    _fork.mask = None
    if request.active:
        _fork.mask = signal.pthread_sigmask(signal.SIG_BLOCK, tuple(_before_the_run))


def _after_fork_in_parent() -> None:
    if _fork.mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, _fork.mask)


def _in_forked_child() -> None:
    """A child forked during a run gets the handlers from before it back, and its signals
    unblocked, but a DataLoader worker (:func:`_dataloader_worker_stops`)."""
    global request, _worker_stops
    if _worker_stops:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _worker_stops)
        _worker_stops = ()
    elif request.active:
        request = StopRequest(quiet=True)
        signal.set_wakeup_fd(-1)
        _set(_before_the_run)
        from runkit import compat

        if hasattr(signal, "sigwaitinfo") and compat.forked_for_a_dataloader_worker():
            _dataloader_worker_stops()  # not on macOS
        else:
            signal.pthread_sigmask(signal.SIG_SETMASK, _fork.mask)


def _dataloader_worker_stops() -> None:
    """A DataLoader worker keeps the stop signals blocked (a group's killed it and crashed the
    parent's stop) and a thread takes them: the parent's SIGTERM ends it (exit 0, as torch's)."""
    global _worker_stops
    stops = _worker_stops = tuple(_before_the_run)
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    parent = os.getppid()

    def take() -> None:
        while True:
            got = signal.sigwaitinfo(stops)
            if got.si_signo == signal.SIGTERM and got.si_pid == parent:
                os._exit(0)

    threading.Thread(target=take, daemon=True).start()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_in_forked_child
)


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
    return all(
        env.get(v, "0") in ("", "0") for v in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")
    )


def _started_by_rank0(environ: Mapping[str, str] | None = None) -> bool:
    """A DDP worker of Lightning's launcher (not torchrun's): rank 0 reports the signal."""
    env = os.environ if environ is None else environ
    return env.get("LOCAL_RANK", "0") not in ("", "0") and "TORCHELASTIC_RUN_ID" not in env
