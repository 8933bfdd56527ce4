"""Stop signals (:data:`STOP_SIGNALS`): recorded at once, acted on at a safe point.

A handler that does real work wherever Python happens to be (inside a gloo collective, say)
hangs DDP jobs: Lightning 2.6's SIGTERM handler broadcasts a tensor from inside the handler and
forwards the signal to the workers, so ranks enter mismatched collectives and wait forever. Here
the handler only records the signal. The run acts on it where every rank is at the same point:
at a batch boundary inside Lightning's loops, where the ranks agree with one tiny all-reduce
(:mod:`runkit.safety.interrupts`), or when the run ends. Either way the process exits
with ``128 + signal`` (130 for Ctrl-C, 143 for SIGTERM) after one line saying so.

Two things Python's own signal handling cannot do are done by a watcher thread, which hears
every signal through :func:`signal.set_wakeup_fd` even while the main thread is blocked in C++:

* A second Ctrl-C (or another stop signal) quits at once, without saving, exit ``128 + signal``,
  in any phase, the first signal's save included. After SLURM's warning only that signal again
  does: SLURM's SIGTERM comes while the save the warning asked for is under way.
* In a distributed run, a rank whose main thread is stuck in a collective (waiting for a rank
  that never comes, where Python runs no handler) cannot reach the next safe point. When the
  handler has not run ``STUCK_GRACE_S`` after the signal, or the main thread has been waiting in
  one ``torch.distributed`` call that long since, the rank says so in one line and exits
  ``128 + signal`` without saving; the last complete checkpoint stays.

**One stop per event.** One stop often arrives as several deliveries: a terminal's Ctrl-C and
``kill -TERM -<pgid>`` reach every process of the group, GNU ``timeout`` signals its child and
then the child's group, the kernel sends ``PR_SET_PDEATHSIG`` once per thread of a dying parent.
The rule: a process counts only the signals it was sent itself, and every stop signal within
``STOP_REPEAT_S`` of the first, or after the process's parent died, is that same stop. So forked
children (DataLoader workers) get no share of this process's wakeup descriptor and are left out
of the stop (see :func:`_in_forked_child`), and a second request means a person asking again
after the first line was printed, which takes longer than ``STOP_REPEAT_S``.

Standard library only: the CLI installs the handlers before torch and Lightning load, so a DDP
worker signalled while it starts up is covered too.
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
from typing import Any, NamedTuple

CHILD_GRACE_S = 30.0
"""How long a stopping rank 0 waits for the DDP workers it launched before killing them."""
STUCK_GRACE_S = 10.0
"""How long a rank of a distributed run may stay stuck after a stop signal before it quits."""
STOP_REPEAT_S = 1.0
"""Stop signals this soon after the first are the same stop delivered again (module docstring):
deliveries of one event come within milliseconds, a person's second Ctrl-C after the first line."""


@dataclass
class StopRequest:
    """What this process knows about a stop: the signal it got and what the ranks agreed on."""

    received: int | None = None
    """The first stop signal this process received, acted on at the next safe point."""
    agreed: int | None = None
    """The stop every rank agreed on (set by :mod:`~runkit.safety.interrupts`)."""
    phase: str = "startup"
    """What the run is doing (fit, test, export...), for the last line."""
    phase_done: bool = False
    """Whether that phase has finished (its files are written), for the last line."""
    detail: str = ""
    """What the stop did (saved a checkpoint, requeued the job), for the last line."""
    quiet: bool = False
    """A DDP worker: rank 0 says what happens, once for the job."""
    children: list[subprocess.Popen] = field(default_factory=list)
    """DDP workers this process launched, waited for before it exits."""
    active: bool = False
    """Whether :func:`stop_on_signal` handles the signals now."""
    received_at: float = 0.0
    """``time.monotonic()`` when the first stop signal came."""
    watched: bool = False
    """Whether the watcher thread hears every delivery (it then judges the repeats)."""
    parent: int = 0
    """This process's parent when the run began; another one means it died (PR_SET_PDEATHSIG)."""
    failed: bool = False
    """Whether the block ended in an exception: its one line and exit code are on their way."""


request = StopRequest()
"""This process's request; :func:`stop_on_signal` replaces it at the start of every run."""


class Stop(NamedTuple):
    """A stop signal: when it is one, and whether it warns of an end to come."""

    when: Callable[[], bool]
    """Whether the signal is a stop in this process (else it keeps its own handling)."""
    warns: bool = False
    """SLURM's notice before the time limit: the SIGTERM after it is the same stop (the save it
    asked for is under way), not a second request to quit at once."""


STOP_SIGNALS = {
    # The library README's table of stop signals says what each does.
    signal.SIGINT: Stop(lambda: True),  # Ctrl-C
    signal.SIGTERM: Stop(lambda: True),  # kill, SLURM's end, Kubernetes, systemd, docker stop
    signal.SIGHUP: Stop(lambda: signal.getsignal(signal.SIGHUP) != signal.SIG_IGN),  # not nohup
    signal.SIGUSR1: Stop(lambda: slurm_job_id() is not None, warns=True),  # --signal=SIGUSR1@90
    # hydra/launcher=slurm: submitit's notice; its handler requeues after the save (run.launch)
    signal.SIGUSR2: Stop(lambda: os.environ.get("SUBMITIT_EXECUTOR") == "slurm", warns=True),
}
"""Every stop signal; one more is one more line."""


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals of :data:`STOP_SIGNALS` that are stops in this process now."""
    return tuple(signum for signum, stop in STOP_SIGNALS.items() if stop.when())


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
    request = StopRequest(active=True, quiet=not rank_zero(), parent=os.getppid())
    _before_the_run.clear()
    _before_the_run.update(previous)
    if until_exit:
        atexit.unregister(_at_exit)  # once per process
        atexit.register(_at_exit)  # early: runs after the hooks torch and Lightning register
    for signum in previous:
        signal.signal(signum, _record)
    watcher = _Watcher(request)
    try:
        yield request
    except BaseException:
        request.failed = True
        raise
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


_AFTER_THE_RUN = "received after the run had finished (its files are complete)"


def _after_the_run(signum: int, frame: FrameType | None) -> None:
    """A stop signal while the finished process shuts down: its files are all written.

    After a run that failed, the signal is ignored, as from :func:`_at_exit` on: the error's one
    line is printed after the block and the process exits with its code. A launcher tearing the
    group down over that error (torchrun SIGTERMs the other ranks when one exits 2) would
    otherwise add a second line saying the run had finished, or end the process before its own.
    """
    if request.received is not None:  # the run was stopped: its line and 128 + N are given
        if _second_request(request, signum, time.monotonic()):
            quit_now(signum, "again: quitting at once")
        return
    if request.failed:
        return
    if request.quiet:
        os._exit(128 + signum)
    quit_now(signum, _AFTER_THE_RUN)


def _at_exit() -> None:
    """The last point where Python still runs a handler (a signal that came on another thread is
    handled here, as this is Python code). Past it the interpreter tears down and resets the
    handlers, so that a stop signal ended the process silently, by the signal. From here on the
    stop signals are ignored instead (process-wide): the run's files are complete, and the
    process exits with the run's own exit code."""
    for signum in stop_signals():
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, signal.SIG_IGN)


def _record(signum: int, frame: FrameType | None) -> None:
    now = time.monotonic()
    if request.received is not None:
        # The watcher, when there is one, saw every delivery as it came and judges repeats; here
        # two deliveries may show as one call, and late (the main thread was in C++).
        if not request.watched and _second_request(request, signum, now):
            quit_now(signum, "again: quitting at once, without saving")
        return
    request.received, request.received_at = signum, request.received_at or now
    _drop_closed_outputs()
    again = " (Ctrl-C again quits at once, without saving)" if signum == signal.SIGINT else ""
    _say(f"\n{signal.Signals(signum).name} received: stopping at the next safe point{again}")


def _second_request(stop: StopRequest, signum: int, now: float) -> bool:
    """Whether ``signum`` at ``now`` is a new request to quit, not the first stop delivered again
    (the rule in the module docstring)."""
    first = stop.received
    if first is None or _same_stop(stop, now):
        return False
    return _quits_at_once(first, signum)


def _same_stop(stop: StopRequest, now: float) -> bool:
    """Within ``STOP_REPEAT_S`` of the first signal, or once the parent died: the kernel sends
    ``PR_SET_PDEATHSIG`` again as each thread of the dead parent exits, seconds apart under load."""
    return now - stop.received_at < STOP_REPEAT_S or bool(
        stop.parent and os.getppid() != stop.parent
    )


def _quits_at_once(first: int, again: int) -> bool:
    """A second stop signal quits at once; after SLURM's warning only the warning again does
    (SLURM's SIGTERM comes while the save it asked for is under way; its SIGKILL comes anyway)."""
    return not STOP_SIGNALS[first].warns or again == first


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
    _write_line(f"\nerror: {where}{signal.Signals(signum).name} {why}; exit code {code}")
    with contextlib.suppress(Exception):
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
        stop.watched = True

    def close(self) -> None:
        self.stop.watched = False
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
            now = time.monotonic()
            for signum in (b for b in data if b in stops):
                if first is None:
                    first, self.first_at = signum, now
                    self.stop.received_at = self.stop.received_at or now
                elif not _same_stop(self.stop, now) and _quits_at_once(first, signum):
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
    when = f"during {request.phase}"
    if request.phase_done:
        when = f"after {request.phase} had finished (its files are written)"
    _drop_closed_outputs()
    _say(f"stopped by {name} {when}{request.detail}; exit code {code}", run_log=True)
    raise SystemExit(code)


def _say(text: str, run_log: bool = False) -> None:
    """Say ``text`` on stderr; ``run_log``: in the run's log files too (Hydra's ``train.log``),
    the one place that tells how a run whose terminal closed ended."""
    if request.quiet:
        return
    _write_line(text)
    if run_log:
        record = logging.LogRecord(__name__, logging.WARNING, __file__, 0, text, None, None)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)


def _drop_closed_outputs() -> None:
    """Point stdout and stderr at /dev/null when what they wrote to is gone (a closed terminal
    answers EIO, a pipe without its reader EPIPE): a stop then goes on to its save and its exit
    code instead of ending in the traceback (or Rich's exit 1) of the next line printed."""
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            poll = select.poll()
            poll.register(fd, 0)
            if any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0)):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)


def _write_line(text: str) -> None:
    """Print ``text`` to stderr, also from a handler that interrupted a write to stderr (Python's
    buffered stream refuses that reentrant write: the line went missing)."""
    try:
        print(text, file=sys.stderr, flush=True)
    except RuntimeError:
        with contextlib.suppress(OSError):
            os.write(2, f"{text}\n".encode(errors="replace"))
    except (OSError, ValueError):  # a closed stream
        pass


_before_the_run: dict[int, Any] = {}
"""The handlers :func:`stop_on_signal` replaced, which forked children get back."""


_fork = threading.local()
"""The forking thread's signal mask from before :func:`_before_fork`, put back after it."""


def _before_fork() -> None:
    """During a run, a child starts with the stop signals blocked (inherited from the forking
    thread): none lands before the child has its own stop handling (:func:`_in_forked_child`).
    A group's signal in that moment reached the parent's handler, in the child."""
    _fork.mask = None
    if request.active:
        with contextlib.suppress(ValueError, OSError):
            _fork.mask = signal.pthread_sigmask(signal.SIG_BLOCK, tuple(_before_the_run))


def _after_fork_in_parent() -> None:
    if getattr(_fork, "mask", None) is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, _fork.mask)  # what came meanwhile is handled
        _fork.mask = None


def _in_forked_child() -> None:
    """In a child forked during a run: none of this process's stop handling.

    The child shares nothing it could count (its wakeup descriptor is cleared: its signals were
    bytes in the parent's watcher, each a "second" Ctrl-C) and gets the handlers from before the
    run back, then the stop signals (blocked by :func:`_before_fork`), so a forked helper stops
    as it would without this library. A DataLoader worker, which its parent ends when it stops,
    keeps them blocked and is left out of the stop (:func:`_dataloader_worker_stops`).
    """
    global request, _worker_stops
    mask, _fork.mask = getattr(_fork, "mask", None), None
    if _worker_stops:  # forked by a DataLoader worker: this child gets the stop signals back
        with contextlib.suppress(ValueError, OSError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _worker_stops)
        _worker_stops = ()
        return
    if not request.active:
        return
    request = StopRequest(quiet=True)
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
        for signum, handler in _before_the_run.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    # Only where torch is loaded (this module is stdlib-only) and the sender can be read.
    if "torch.utils.data._utils.signal_handling" in sys.modules and hasattr(signal, "sigwaitinfo"):
        from runkit import compat

        if compat.forked_for_a_dataloader_worker():
            compat.leave_dataloader_workers_out_of_stops(_dataloader_worker_stops)
            return
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


_worker_stops: tuple[int, ...] = ()
"""In a DataLoader worker: the stop signals it keeps blocked (:func:`_dataloader_worker_stops`)."""


def _dataloader_worker_stops() -> None:
    """In a DataLoader worker, after torch's handlers: its parent alone ends it.

    torch's own SIGTERM handler tells its parent's signal from the others (``si_pid``) and exits
    quietly on the parent's only: the worker ends when the parent shuts it down or exits
    (multiprocessing terminates its workers at exit). A group's stop signal killed the worker,
    which crashed the parent's stop; ignoring the stop signals kept the worker alive when its
    parent exited, and the parent waited for it forever. Python's handlers do not see the sender,
    so the stop signals stay blocked and a thread takes them with :func:`signal.sigwaitinfo`:
    the parent's SIGTERM ends the worker (exit 0, as torch's), any other stop signal is left to
    the parent, which stops and ends its workers. A program the worker starts inherits the
    blocked signals; a child it forks gets them back (:func:`_in_forked_child`).
    """
    global _worker_stops
    stops = tuple(_before_the_run)
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    _worker_stops = stops
    parent = os.getppid()

    def end_if_the_parents(got: Any) -> None:
        if got is not None and got.si_signo == signal.SIGTERM and got.si_pid == parent:
            os._exit(0)

    # Taken here first: a signal that came while the worker started (a group's, at the fork) is
    # pending, and a second SIGTERM, the parent's, would merge into it unseen (one of a kind is
    # kept pending, with the first sender's si_pid) until the thread below runs.
    while (got := signal.sigtimedwait(stops, 0)) is not None:
        end_if_the_parents(got)

    def take() -> None:
        while True:
            end_if_the_parents(signal.sigwaitinfo(stops))

    threading.Thread(target=take, name="dataloader-worker-stops", daemon=True).start()


if hasattr(os, "register_at_fork"):
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
    ranks = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")
    return all(env.get(var, "0") in ("", "0") for var in ranks)


def _started_by_rank0(environ: Mapping[str, str] | None = None) -> bool:
    """A DDP worker that Lightning's launcher in rank 0 started (torchrun's set their own
    ``TORCHELASTIC_RUN_ID``): its exit code is read only by rank 0, which kills the whole job
    when a worker exits non-zero; rank 0 reports the signal instead."""
    env = os.environ if environ is None else environ
    return env.get("LOCAL_RANK", "0") not in ("", "0") and "TORCHELASTIC_RUN_ID" not in env
