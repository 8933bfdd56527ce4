"""The GPU sampler in a process of its own, so that the training process does no NVML work.

Why a process: a sampling thread takes the GIL from the training thread around each NVML call,
which costs short steps measurably. The child is forked per rank before NVML is opened, reuses
:class:`~runkit.gpu_stats.sampler.GpuSampler`, and talks to the trainer over a pipe at phase
boundaries only. It dies with its parent (``PR_SET_PDEATHSIG``, a closed pipe, a changed parent
PID); it ignores SIGINT, SIGUSR1 and SIGUSR2, which the trainer handles. Every wait on it is
bounded: a child that dies or hangs costs one warning, and sampling goes on in a thread.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
import warnings
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from runkit.gpu_stats.sampler import GpuReader, GpuSampler, Later
from runkit.gpus import nvml
from runkit.processes import die_with_parent

log = logging.getLogger(__name__)

WATCH_S = 1.0
"""How often the child checks that its parent is still there when no request comes."""
_TIMEOUT, _GONE = object(), object()  # what _receive gives instead of an answer


class SamplerUnavailable(RuntimeError):
    """No sampler process here: the reason, in one line (the callback falls back to a thread)."""


class ProcessSampler:
    """:class:`~runkit.gpu_stats.sampler.GpuSampler`'s interface, served by a child process.

    Create it with :meth:`fork` *before* this process opens NVML, then :meth:`attach` the
    readers this process probed (their identities and boards are what the callback reports; they
    are read only after a fallback to a thread), then :meth:`start`.
    """

    reply_timeout_s = 2.0
    """Longest wait for one answer of the child: a hung child costs this, once."""
    start_timeout_s = 20.0
    """Longest wait for the child to open NVML and take its first sample (``nvmlInit`` on a
    large node without persistence mode can take seconds)."""

    def __init__(self, process: Any, conn: Any, interval_s: float) -> None:
        self.readers: list[GpuReader] = []
        self.interval_s = interval_s
        self.phase: str | None = None
        self._process = process
        self._conn = conn
        self._seq = 0
        self._labels: list[str] = []
        self._energy_j: Any = None  # the child's energy totals, shared memory (fork sets both)
        self._unclaimed: dict[int, Any] = {}  # answers to requests whose reply is awaited later
        self._later: set[int] = set()  # those requests
        self._fallback: GpuSampler | None = None
        self._energy_before_fallback: dict[str, float] = {}
        self._stopped = False

    # ------------------------------------------------------------------ start
    @classmethod
    def fork(
        cls,
        gpus: Sequence[tuple[str, str]],
        groups: Sequence[str],
        interval_s: float,
    ) -> ProcessSampler:
        """Fork the child for ``gpus`` (``(label, NVML UUID)`` pairs), reading ``groups``.

        Raises :class:`SamplerUnavailable` where no process can be forked.
        """
        try:
            context = multiprocessing.get_context("fork")
        except ValueError as err:
            raise SamplerUnavailable(f"this platform cannot fork ({err})") from err
        mine, theirs = context.Pipe(duplex=True)
        # Each GPU's energy total (J), written by the child after every reading and read here
        # without a round trip (a validation's end reads it while the child may be busy).
        energy_j = context.RawArray("d", [math.nan] * len(gpus))
        process = context.Process(
            target=_child_main,
            args=(theirs, mine, os.getpid(), list(gpus), list(groups), interval_s, energy_j),
            name="gpu-stats-sampler",
            daemon=True,
        )
        try:
            with warnings.catch_warnings():  # 3.12+: "use of fork() may lead to deadlocks"
                warnings.simplefilter("ignore", DeprecationWarning)
                process.start()
        except Exception as err:  # a daemonic trainer, no memory, a process limit ...
            mine.close()
            theirs.close()
            raise SamplerUnavailable(f"{type(err).__name__}: {err}") from err
        theirs.close()
        sampler = cls(process, mine, interval_s)
        sampler._labels, sampler._energy_j = [label for label, _uuid in gpus], energy_j
        return sampler

    @property
    def pid(self) -> int | None:
        """The child's PID (None after a fallback to a thread)."""
        return None if self._process is None else self._process.pid

    def attach(self, readers: Sequence[GpuReader]) -> None:
        """The readers this process opened: figures are kept for their labels only."""
        self.readers = list(readers)

    def start(self) -> None:
        """Wait until the child has opened its GPUs and taken its first sample.

        Raises :class:`SamplerUnavailable` (and ends the child) when it does not in time.
        """
        answer = self._receive(0, self.start_timeout_s)
        if not (isinstance(answer, tuple) and answer and answer[0] == "ready"):
            self._end_child()
            if answer is _TIMEOUT:
                reason = f"no answer within {self.start_timeout_s:g} s"
            elif isinstance(answer, tuple) and answer[0] == "error":
                reason = answer[1]
            else:
                reason = f"ended ({self._exit_text()})"
            raise SamplerUnavailable(f"the sampler process did not start: {reason}")

    # ------------------------------------------------------------------ the pipe
    def _exit_text(self) -> str:
        code = None if self._process is None else self._process.exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _receive(self, seq: int, timeout_s: float) -> Any:
        """The answer to request ``seq``, ``_TIMEOUT``, or ``_GONE`` if the child is gone.
        Answers to requests awaited later are kept for them; answers to earlier requests that
        timed out are dropped; logs are passed on. With ``timeout_s`` 0: what has arrived."""
        if seq in self._unclaimed:
            return self._unclaimed.pop(seq)
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                return _TIMEOUT
            try:
                got, result, records = self._conn.recv()
            except (EOFError, OSError):
                return _GONE
            _relog(records)
            if got == seq:
                return result
            if got in self._later:
                self._unclaimed[got] = result

    def _send(self, op: str, *args: Any, reply: bool = True) -> int | None:
        """Send ``op`` to the child; the number of its answer with ``reply``. ``None`` when the
        child is gone (one warning, a fallback to a thread)."""
        if self._conn is None:
            return None
        self._seq += 1
        try:
            self._conn.send((self._seq if reply else None, op, args))
        except (OSError, ValueError):
            self._fail("has ended")
            return None
        return self._seq

    def _answer(self, seq: int | None) -> Any:
        """The child's answer to request ``seq``; ``None`` on failure (as :meth:`_send`)."""
        self._later.discard(seq)
        if seq in self._unclaimed:
            return self._unclaimed.pop(seq)
        if seq is None or self._conn is None:
            return None
        answer = self._receive(seq, self.reply_timeout_s)
        if answer is _TIMEOUT:
            self._fail(f"did not answer within {self.reply_timeout_s:g} s")
            return None
        if answer is _GONE:
            self._fail("has ended")
            return None
        return answer

    def _request(self, op: str, *args: Any, reply: bool = True) -> Any:
        """Send ``op`` to the child; with ``reply``, wait for its answer (as :meth:`_answer`)."""
        seq = self._send(op, *args, reply=reply)
        return self._answer(seq) if reply else None

    def _fail(self, what: str) -> None:
        """One warning; the child is ended and sampling goes on in a thread of this process."""
        pid = self.pid
        self._end_child()
        log.warning(
            "gpu_stats: the sampler process (pid %s) %s (%s); this phase's GPU figures are lost "
            "and sampling continues in a thread of the training process",
            pid,
            what,
            self._exit_text(),
        )
        self._energy_before_fallback = self._child_energy_j()
        if self.readers and not self._stopped:
            self._fallback = GpuSampler(self.readers, self.interval_s)
            self._fallback.set_phase(self.phase, reset=True, sample=False)
            self._fallback.start()
        self._process = None

    def _end_child(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
        process = self._process
        if process is not None and process.is_alive():
            with contextlib.suppress(OSError):
                process.kill()
            process.join(timeout=5.0)

    # ------------------------------------------------------------------ GpuSampler's interface
    @property
    def alive(self) -> list[GpuReader]:
        return self._fallback.alive if self._fallback is not None else self.readers

    def set_phase(self, phase: str | None, *, reset: bool = True, sample: bool = True) -> None:
        """As :meth:`GpuSampler.set_phase`; without ``sample`` it does not wait for the child."""
        self.phase = phase
        if self._fallback is not None:
            self._fallback.set_phase(phase, reset=reset, sample=sample)
        else:
            self._request("set_phase", phase, reset, sample, reply=sample)

    def sample_now(self) -> None:
        if self._fallback is not None:
            self._fallback.sample_now()
        else:
            self._request("sample_now")

    def sample_soon(self) -> None:
        """Have the child's sampling thread take its next sample now, without waiting for it: a
        phase that just began (each validation, each training epoch) may end before the next
        interval, and this reading, begun in the phase, counts for it."""
        if self._fallback is None:
            self._request("wake", reply=False)

    def has_samples(self, phase: str) -> bool:
        if self._fallback is not None:
            return self._fallback.has_samples(phase)
        return bool(self._request("has_samples", phase))

    def collect(self, phase: str, *, sample: bool = True) -> dict[str, dict[str, float]]:
        if self._fallback is not None:
            return self._fallback.collect(phase, sample=sample)
        return self._figures(self._request("collect", phase, sample))

    def summaries(self, phase: str) -> dict[str, dict[str, float]]:
        """``phase``'s figures so far, after one sample if it has none yet: one round trip."""
        if self._fallback is not None:
            return self._fallback.summaries(phase)
        return self._figures(self._request("summaries", phase))

    def summaries_later(self, phase: str) -> Later:
        """:meth:`summaries` of ``phase`` as it is now, handed over when the child has them. The
        child closes the phase (the reading begun in it, or one more) while the training goes
        on, so that a phase shorter than one reading (a validation) waits for none."""
        if self._fallback is not None:
            return self._fallback.summaries_later(phase)
        seq = self._send("summaries later", phase)
        self._later.add(seq)
        return Later(lambda: self._figures(self._answer(seq)), lambda: self._answered(seq))

    def _answered(self, seq: int | None) -> bool:
        """Whether the answer to ``seq`` is here (or will never come), without waiting."""
        if seq in self._unclaimed or self._conn is None:
            return True
        answer = self._receive(seq, 0.0)
        if answer is not _TIMEOUT and answer is not _GONE:
            self._unclaimed[seq] = answer
        return answer is not _TIMEOUT  # gone: the figures are lost, at once

    def _figures(self, answer: Any) -> dict[str, dict[str, float]]:
        if answer is None:
            return {}
        ours = {r.label for r in self.readers}
        return {label: values for label, values in answer.items() if label in ours}

    def _child_energy_j(self) -> dict[str, float]:
        if self._energy_j is None:
            return {}
        return {
            label: joules
            for label, joules in zip(self._labels, self._energy_j, strict=True)
            if not math.isnan(joules)
        }

    def energy_totals_j(self) -> dict[str, float]:
        """Each GPU's energy since the first sample, as of the child's latest reading (read from
        memory shared with it, no round trip), in joules."""
        if self._fallback is None:
            return self._child_energy_j()
        totals = dict(self._energy_before_fallback)
        for label, joules in self._fallback.energy_totals_j().items():
            totals[label] = totals.get(label, 0.0) + joules
        return totals

    def stop(self) -> None:
        """End the child (bounded waits, quietly) or the fallback thread; safe to call again."""
        self._stopped = True
        if self._fallback is not None:
            self._fallback.stop()
        if self._conn is not None:
            self._seq += 1
            with contextlib.suppress(OSError, ValueError):
                self._conn.send((self._seq, "stop", ()))
                self._receive(self._seq, self.reply_timeout_s)
        if self._process is not None:
            self._process.join(timeout=self.reply_timeout_s)
            self._end_child()


# --------------------------------------------------------------------------- in the child
def _relog(records: Sequence[tuple[str, int, str]]) -> None:
    """Log in this process what the child logged (tests and log files see one stream)."""
    for name, level, message in records:
        logging.getLogger(name).log(level, "%s", message)


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
    """Die with the parent (PR_SET_PDEATHSIG on Linux), yield the CPU to it, and leave it the
    signals it handles."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl: nobody to serve
        os._exit(0)
    # The lowest CPU priority: where cores are shared, training goes first; the sampler needs a
    # few percent of a core at most, and its answers come while the trainer waits for them.
    with contextlib.suppress(OSError, AttributeError):
        os.nice(19)
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    for name in ("SIGINT", "SIGUSR1", "SIGUSR2"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


def _child_main(
    conn: Any,
    parent_end: Any,
    parent_pid: int,
    gpus: list[tuple[str, str]],
    groups: list[str],
    interval_s: float,
    energy_j: Any,
) -> None:
    _tie_to_parent(parent_pid)
    parent_end.close()
    collect = _Collect()
    package = logging.getLogger("runkit.gpu_stats")
    package.handlers = [collect]
    package.propagate = False  # the trainer logs them, once, when they arrive
    _open_and_serve(conn, gpus, groups, interval_s, energy_j, collect, parent_pid, parent_pid)


def _open_and_serve(
    conn: Any,
    gpus: list[tuple[str, str]],
    groups: list[str],
    interval_s: float,
    energy_j: Any,
    collect: _Collect,
    trainer_pid: int,
    parent_pid: int,
) -> None:
    """Open the GPUs and start the sampler, tell the trainer "ready" (or why not), then serve it
    (:func:`_serve`). ``trainer_pid``: whose memory on the GPUs is read; ``parent_pid``: the
    process whose end ends the serving (both the trainer's, in the child)."""
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
                reader.pid = trainer_pid  # process memory: the trainer's, not ours
                reader.probe()
                readers.append(reader)
            labels = [label for label, _uuid in gpus]
            sampler = _started_sampler(readers, labels, interval_s, energy_j)
            stack.callback(sampler.stop)  # before the readers close (last in, first out)
        except Exception as err:
            with contextlib.suppress(OSError):
                conn.send((0, ("error", f"{type(err).__name__}: {err}"), collect.drain()))
            return
        conn.send((0, ("ready",), collect.drain()))
        _serve(conn, sampler, parent_pid, collect)


def _started_sampler(
    readers: Sequence[GpuReader], labels: Sequence[str], interval_s: float, energy_j: Any
) -> GpuSampler:
    """The child's sampler, running: it reads its GPUs side by side, writes each GPU's energy
    total into ``energy_j`` at the GPU's place in ``labels``, and has taken a first sample, which
    primes the counters before anyone switches a phase."""
    position = {label: i for i, label in enumerate(labels)}

    def publish(label: str, joules: float) -> None:
        energy_j[position[label]] = joules

    sampler = GpuSampler(readers, interval_s, parallel=True, on_energy=publish)
    try:
        sampler.sample_now()
        sampler.start(first_sample=False)
    except BaseException:
        sampler.stop()
        raise
    return sampler


def _serve(conn: Any, sampler: GpuSampler, parent_pid: int, collect: _Collect) -> None:
    """Answer the trainer's requests until it says stop, its pipe closes or it is gone.

    Requests are taken in order, and none waits for a reading here: "summaries later" (a phase
    closed by the trainer, which may need the reading under way or one more) is answered from
    a thread of its own, so the requests behind it (the next phase's, the epoch's figures) are
    answered meanwhile; the trainer matches answers to requests by number.
    """
    sending = threading.Lock()

    def answer(seq: int, result: Any) -> bool:
        with sending:
            try:
                conn.send((seq, result, collect.drain()))
            except OSError:
                return False
        return True

    def summaries_later(seq: int, phase: str) -> None:
        threading.Thread(
            target=lambda: answer(seq, sampler.summaries(phase)),
            name="gpu-stats-close",
            daemon=True,
        ).start()

    handlers = {
        "set_phase": lambda phase, reset, sample: sampler.set_phase(
            phase, reset=reset, sample=sample
        ),
        "sample_now": sampler.sample_now,
        "wake": sampler.wake,
        "has_samples": sampler.has_samples,
        "collect": lambda phase, sample: sampler.collect(phase, sample=sample),
        "summaries": sampler.summaries,
        "stop": sampler.stop,
    }
    while True:
        if not conn.poll(WATCH_S):
            if os.getppid() != parent_pid:
                return
            continue
        try:
            seq, op, args = conn.recv()
        except (EOFError, OSError):
            return
        if op == "summaries later":
            summaries_later(seq, *args)
            continue
        result = handlers[op](*args)
        if seq is not None and not answer(seq, result):
            return
        if op == "stop":
            return
