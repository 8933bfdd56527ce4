"""Stop signals: recorded at once, acted on at a safe point the ranks agree on.

A handler doing real work inside a gloo collective hangs DDP jobs, so it only records the signal.
A watcher thread hears every delivery even while the main thread is in C++: a second request quits
at once, as does a rank stuck past the grace. Standard library only (installed before torch).
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
    return tuple(signum for signum, applies in STOP_SIGNALS.items() if applies())


@contextmanager
def stop_on_signal(until_exit: bool = False) -> Iterator[StopRequest]:
    """Record stop signals for the block (``until_exit``: and after); an unhandled one: 128 + N."""
    global request, _before_the_run
    if threading.current_thread() is not threading.main_thread() or request.active:
        yield request
        return
    previous = _before_the_run = {signum: signal.getsignal(signum) for signum in stop_signals()}
    request = StopRequest(active=True, quiet=not rank_zero(), parent=os.getppid())
    if until_exit:
        atexit.unregister(_at_exit)
        atexit.register(_at_exit)  # runs after the hooks torch and Lightning register
    _set(dict.fromkeys(previous, _record))
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    reader.settimeout(0.5)  # wakes to check a stuck rank, and to see the block ended
    wakeup = signal.set_wakeup_fd(writer.fileno())
    threading.Thread(
        target=_watch, args=(request, reader), name="signal-watch", daemon=True
    ).start()
    try:
        yield request
    except BaseException:
        request.failed = True
        raise
    finally:
        request.active = False
        signal.set_wakeup_fd(wakeup)
        writer.close()
        reader.close()
        _set(dict.fromkeys(previous, _after_the_run) if until_exit else previous)
    # Lightning's launcher's DDP worker (not torchrun's) leaves the report to rank 0.
    worker = os.environ.get("LOCAL_RANK", "0") not in ("", "0")
    if request.received is not None and not (worker and "TORCHELASTIC_RUN_ID" not in os.environ):
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
    if request.received is not None:
        return
    request.received, request.received_at = signum, request.received_at or time.monotonic()
    _drop_closed_outputs()
    again = " (Ctrl-C again quits at once, without saving)" if signum == signal.SIGINT else ""
    if not request.quiet:
        _write_line(
            f"\n{signal.Signals(signum).name} received: stopping at the next safe point{again}"
        )


def _second_request(stop: StopRequest, signum: int, now: float) -> bool:
    """Not within ``STOP_REPEAT_S``, after the parent died, nor SLURM's SIGTERM after its warning."""
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


def _watch(stop: StopRequest, reader: socket.socket) -> None:
    stops, first, first_at, waiting = {int(s) for s in stop_signals()}, 0, 0.0, None
    while True:
        try:
            data = reader.recv(64)
        except TimeoutError:
            data = b""
        except OSError:
            return  # closed: the run is over
        now = time.monotonic()
        for signum in (b for b in data if b in stops):
            if not first:
                first, first_at = signum, now
                stop.received_at = stop.received_at or now
            elif _second_request(stop, signum, now):
                quit_now(signum, "again: quitting at once, without saving")
        if first and _distributed():
            waiting = _check_stuck(stop, first, now - first_at, waiting, now)


def _check_stuck(stop: StopRequest, signum: int, since: float, waiting: Any, now: float) -> Any:
    """Quit when the handler has not run ``since`` the signal, or one torch.distributed call has
    lasted, past the grace; returns the call the main thread waits in and since when."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    call = None
    if frame is not None and f"torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename:
        call = (frame.f_code.co_name, id(frame), frame.f_lasti)
        waiting = waiting if waiting and waiting[0] == call else (call, now)
    where = "in native code" if stop.received is None and since > STUCK_GRACE_S else None
    if call and now - waiting[1] > STUCK_GRACE_S and not where:
        where = f"in torch.distributed.{call[0]}"
    if where:
        quit_now(
            signum,
            f"received, but this rank stayed stuck {where} for {STUCK_GRACE_S:.0f} s (waiting "
            "for another rank?); stopping without saving",
        )
    return waiting if call else None


def _distributed() -> bool:
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        return True
    dist = sys.modules.get("torch.distributed")  # never imported here: stdlib only
    try:
        return bool(dist and dist.is_initialized() and dist.get_world_size() > 1)
    except Exception:
        return False


def exit_stopped(signum: int) -> None:
    for child in request.children:
        try:
            child.wait(timeout=CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    request.children = []
    code, phase = 128 + int(signum), request.phase
    when = f"after {phase} had finished (its files are written)" if request.phase_done else ""
    _drop_closed_outputs()
    name = signal.Signals(signum).name
    line = f"stopped by {name} {when or f'during {phase}'}{request.detail}; exit code {code}"
    if not request.quiet:  # on stderr and in the run's log files (a closed terminal's run)
        _write_line(line)
        record = logging.LogRecord(__name__, logging.WARNING, __file__, 0, line, None, None)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)
    raise SystemExit(code)


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


def _in_forked_child() -> None:
    """A child forked during a run gets the handlers from before it back (not a DataLoader's)."""
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
    before=_before_fork,
    after_in_parent=lambda: (
        _fork.mask is None or signal.pthread_sigmask(signal.SIG_SETMASK, _fork.mask)
    ),
    after_in_child=_in_forked_child,
)


def slurm_job_id(env: Mapping[str, str] = os.environ) -> str | None:
    """``None`` outside a SLURM batch job (and in ``bash``/``interactive`` ones)."""
    job = env.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9]+", job) or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    return job


def rank_zero(env: Mapping[str, str] = os.environ) -> bool:
    return all(
        env.get(v, "0") in ("", "0") for v in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")
    )
