"""The GPU sampler in a process of its own, so that the training process does no NVML work.

Why a process: a sampling thread takes the GIL from the training thread around each NVML call,
which costs short steps measurably. The child is forked per rank before NVML is opened, runs a
:class:`~runkit.gpu_stats.sampler.GpuSampler`, and answers the trainer over a pipe at phase
boundaries only. It dies with its parent and ignores the signals the trainer handles. Every wait
on it is bounded: a child that dies or hangs costs one warning, and sampling goes on in a thread.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import warnings
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from runkit.gpu_stats.sampler import GpuReader, GpuSampler
from runkit.gpus import nvml
from runkit.processes import die_with_parent

log = logging.getLogger(__name__)

WATCH_S = 1.0
"""How often the child checks that its parent is still there when no request comes."""


class SamplerUnavailable(RuntimeError):
    """No sampler process here: the reason, in one line (the callback falls back to a thread)."""


class ProcessSampler:
    """:class:`GpuSampler`'s interface, served by a child process forked by :meth:`fork`.

    Fork it *before* this process opens NVML, :meth:`attach` the readers this process probed
    (what the callback reports, and what a fallback thread reads), then :meth:`start`.
    """

    reply_timeout_s = 2.0
    """Longest wait for one answer of the child: a hung child costs this, once."""
    start_timeout_s = 20.0
    """Longest wait for the child to open NVML (seconds on a large node without persistence)."""

    def __init__(self, process: Any, conn: Any, interval_s: float) -> None:
        self.readers: list[GpuReader] = []
        self.interval_s = interval_s
        self.phase: str | None = None
        self._process, self._conn = process, conn
        self._fallback: GpuSampler | None = None
        self._energy_j: dict[str, float] = {}  # the child's last totals
        self._stopped = False

    @classmethod
    def fork(
        cls, gpus: Sequence[tuple[str, str]], groups: Sequence[str], interval_s: float
    ) -> ProcessSampler:
        """Fork the child for ``gpus`` (``(label, NVML UUID)`` pairs), reading ``groups``."""
        try:
            context = multiprocessing.get_context("fork")
        except ValueError as err:
            raise SamplerUnavailable(f"this platform cannot fork ({err})") from err
        mine, theirs = context.Pipe(duplex=True)
        args = (theirs, mine, os.getpid(), list(gpus), list(groups), interval_s)
        process = context.Process(target=_child, args=args, name="gpu-stats", daemon=True)
        try:
            with warnings.catch_warnings():  # 3.12+: "use of fork() may lead to deadlocks"
                warnings.simplefilter("ignore", DeprecationWarning)
                process.start()
        except Exception as err:  # a daemonic trainer, no memory, a process limit ...
            mine.close()
            theirs.close()
            raise SamplerUnavailable(f"{type(err).__name__}: {err}") from err
        theirs.close()
        return cls(process, mine, interval_s)

    @property
    def pid(self) -> int | None:
        """The child's PID (None after a fallback to a thread)."""
        return None if self._process is None else self._process.pid

    @property
    def alive(self) -> list[GpuReader]:
        return self._fallback.alive if self._fallback is not None else self.readers

    def attach(self, readers: Sequence[GpuReader]) -> None:
        self.readers = list(readers)

    def start(self) -> None:
        """Wait until the child has opened its GPUs; :class:`SamplerUnavailable` if it does not."""
        answer = self._receive(self.start_timeout_s)
        if answer != "ready":
            self._end_child()
            reason = answer if isinstance(answer, str) else f"ended ({self._exit_text()})"
            raise SamplerUnavailable(f"the sampler process did not start: {reason}")

    def _exit_text(self) -> str:
        code = None if self._process is None else self._process.exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _receive(self, timeout_s: float) -> Any:
        """The child's next answer (its log records logged here); None when none comes."""
        try:
            if not self._conn.poll(timeout_s):
                return None
            answer, records = self._conn.recv()
        except (EOFError, OSError):
            return None
        for name, level, message in records:
            logging.getLogger(name).log(level, "%s", message)
        return answer

    def _call(self, op: str, *args: Any, reply: bool = True) -> Any:
        """Have the child run ``GpuSampler.op(*args)``; with ``reply``, its result. A child that
        is gone or silent: one warning, and sampling continues in a thread here (None)."""
        try:
            self._conn.send((op, args, reply))
        except (OSError, ValueError):
            return self._fail("has ended")
        if not reply:
            return None
        answer = self._receive(self.reply_timeout_s)
        if answer is None:
            alive = self._process.is_alive()
            return self._fail(
                f"did not answer within {self.reply_timeout_s:g} s" if alive else "has ended"
            )
        return answer

    def _fail(self, what: str) -> None:
        pid = self.pid
        self._end_child()
        log.warning(
            "gpu_stats: the sampler process (pid %s) %s (%s); this phase's GPU figures are lost "
            "and sampling continues in a thread of the training process",
            *(pid, what, self._exit_text()),
        )
        self._process = None
        if self.readers and not self._stopped:
            self._fallback = GpuSampler(self.readers, self.interval_s)
            self._fallback.set_phase(self.phase)
            self._fallback.start()

    def _end_child(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
        if self._process is not None and self._process.is_alive():
            with contextlib.suppress(OSError):
                self._process.kill()
            self._process.join(timeout=5.0)

    def set_phase(self, phase: str | None, reset: bool = True) -> None:
        self.phase = phase
        if self._fallback is not None:
            self._fallback.set_phase(phase, reset)
        elif self._conn is not None:
            self._call("set_phase", phase, reset, reply=False)

    def report(self, phase: str | None) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        """As :meth:`GpuSampler.report`: one round trip. Energy counted before a fallback goes on."""
        if self._fallback is None and self._conn is not None:
            answer = self._call("report", phase)
            if answer is not None:
                figures, self._energy_j = answer
                ours = {r.label for r in self.readers}
                return {k: v for k, v in figures.items() if k in ours}, dict(self._energy_j)
        if self._fallback is None:
            return {}, dict(self._energy_j)
        figures, energy = self._fallback.report(phase)
        return figures, {
            k: self._energy_j.get(k, 0.0) + energy.get(k, 0.0) for k in {*energy, *self._energy_j}
        }

    def stop(self) -> None:
        """End the child (bounded waits, quietly) or the fallback thread; safe to call again."""
        self._stopped = True
        if self._fallback is not None:
            self._fallback.stop()
        if self._conn is not None:
            with contextlib.suppress(OSError, ValueError):
                self._conn.send(("stop", (), True))
                self._receive(self.reply_timeout_s)
        if self._process is not None:
            self._process.join(timeout=self.reply_timeout_s)
        self._end_child()


class _Collect(logging.Handler):
    """The child's log records, kept to travel with its next answer."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))

    def drain(self) -> list[tuple[str, int, str]]:
        out, self.records = self.records, []
        return out


def _tie_to_parent(parent_pid: int) -> None:
    """Die with the parent, yield the CPU to it, and leave it the signals it handles."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl: nobody to serve
        os._exit(0)
    with contextlib.suppress(OSError, AttributeError):
        os.nice(19)  # where cores are shared, training goes first
    for name in ("SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    for name in ("SIGINT", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def _child(
    conn: Any,
    parent_end: Any,
    parent_pid: int,
    gpus: list[tuple[str, str]],
    groups: list[str],
    interval_s: float,
) -> None:
    _tie_to_parent(parent_pid)
    parent_end.close()
    collect = _Collect()
    package = logging.getLogger("runkit.gpu_stats")
    package.handlers = [collect]
    package.propagate = False  # the trainer logs them, once, when they arrive
    serve(conn, gpus, groups, interval_s, collect, parent_pid)


def serve(
    conn: Any,
    gpus: Sequence[tuple[str, str]],
    groups: Sequence[str],
    interval_s: float,
    collect: _Collect,
    parent_pid: int,
) -> None:
    """Open the GPUs and sample them, say "ready" (or why not), then answer the trainer's
    requests in order until it says stop, its pipe closes or ``parent_pid`` is gone."""
    with ExitStack() as stack:
        try:
            lib = stack.enter_context(nvml.nvml_session())
            readers = []
            for label, uuid in gpus:
                found = nvml.find_handle(lib, uuid)
                if found is None:
                    continue  # the training process names it
                reader = GpuReader(lib, found[0], label, groups)
                stack.callback(reader.close)
                reader.pid = parent_pid  # process memory: the trainer's, not ours
                reader.probe()
                readers.append(reader)
            sampler = GpuSampler(readers, interval_s, parallel=True)
            stack.callback(sampler.stop)  # before the readers close (last in, first out)
            sampler.start()
        except Exception as err:
            with contextlib.suppress(OSError):
                conn.send((f"{type(err).__name__}: {err}", collect.drain()))
            return
        conn.send(("ready", collect.drain()))
        while True:
            if not conn.poll(WATCH_S):
                if os.getppid() != parent_pid:
                    return
                continue
            try:
                op, args, reply = conn.recv()
                result = getattr(sampler, op)(*args)
                if reply:
                    conn.send((result, collect.drain()))
            except (EOFError, OSError):
                return
            if op == "stop":
                return
