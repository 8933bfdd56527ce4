"""Stop signals in every phase: ranks agree and exit 128+N, a second request quits, a repeat is one
stop, a dying rank ends the job, SLURM requeues; DDP on two CPU processes is one run. CLI runs are
held by ``user_callbacks``."""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import pty
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import Mock, call

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from conftest import clean_env, last_line, run_dirs, run_python
from runkit import compat
from runkit.safety import interrupts, signals

TESTS = Path(__file__).resolve().parent
QUIET = ("callbacks.progress_bar.refresh_rate=0",)
SMALL = ("trainer.max_epochs=1", "data.batch_size=256", *QUIET)
LONG = ("trainer.max_epochs=300", "data.batch_size=64", "test=false", *QUIET)
AGAIN = "again: quitting at once, without saving"
FIRST_CTRL_C = "SIGINT received: stopping at the next safe point"
STUCK = "received, but this rank stayed stuck {} for {} s (waiting for another rank?); stopping without saving"
EXPORTED = "stopped by {} after export had finished (its files are written); exit code {}"


@pytest.fixture
def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "SLURM_JOB_ID", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def until(found: Callable[[], object], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not found() and time.monotonic() < deadline:
        time.sleep(0.01)


def raises(error: BaseException) -> Callable:
    return lambda *args: (_ for _ in ()).throw(error)


def blocked() -> set[int]:
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


# ------------------------------------------------------------------------------------------------
# The mechanism, in this process or a fresh interpreter


@pytest.mark.parametrize(
    ("signum", "env", "hang_up", "code", "lines"),
    [
        (signal.SIGTERM, {}, signal.SIG_DFL, 143, ["SIGTERM received: stopping at the next safe point", EXPORTED.format("SIGTERM", 143)]),
        (signal.SIGINT, {}, signal.SIG_DFL, 130, [f"{FIRST_CTRL_C} (Ctrl-C again quits at once, without saving)", EXPORTED.format("SIGINT", 130)]),
        (signal.SIGHUP, {}, signal.SIG_DFL, 129, ["SIGHUP received: stopping at the next safe point", EXPORTED.format("SIGHUP", 129)]),
        (signal.SIGHUP, {}, signal.SIG_IGN, None, []),  # started under nohup: not a stop
        (signal.SIGTERM, {"LOCAL_RANK": "1"}, signal.SIG_DFL, None, []),  # Lightning's DDP worker: rank 0 speaks
        (signal.SIGTERM, {"LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}, signal.SIG_DFL, 143, []),  # torchrun's
    ],
)  # fmt: skip
def test_a_signal_outside_lightning_lets_the_phase_finish_then_exits_128_plus_n(
    one_process, monkeypatch, capsys, signum, env, hang_up, code, lines
) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(signals, "STOP_REPEAT_S", 60.0)  # the second delivery is the same stop
    hup, before = signal.signal(signal.SIGHUP, hang_up), signal.getsignal(signal.SIGTERM)
    finished, exited = False, None
    try:
        with signals.stop_on_signal(), interrupts.phase("export"):
            assert (signal.SIGHUP in signals.stop_signals()) == (hang_up == signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            os.kill(os.getpid(), signum)
            time.sleep(0.01)  # the handler has run: only recorded, nothing raised
            finished = True
    except SystemExit as stop:
        exited = stop.code
    finally:
        signal.signal(signal.SIGHUP, hup)
    assert finished and exited == code
    assert [line for line in capsys.readouterr().err.splitlines() if line] == lines
    assert signal.getsignal(signal.SIGTERM) is before


def test_outside_the_main_thread_the_block_runs_unchanged() -> None:
    before, seen = signal.getsignal(signal.SIGTERM), []
    with_thread = lambda: seen.append(signals.stop_on_signal().__enter__().active)  # noqa: E731
    thread = threading.Thread(target=with_thread)
    thread.start()
    thread.join()
    assert seen == [False] and signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize(
    ("env", "job", "zero"),
    [
        ({}, None, True),
        ({"SLURM_JOB_ID": "12", "SLURM_PROCID": "0", "RANK": "", "LOCAL_RANK": ""}, "12", True),
        ({"SLURM_JOB_ID": "12", "SLURM_JOB_NAME": "bash"}, None, True),  # srun --pty bash
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "interactive", "NODE_RANK": "1"}, None, False),
        ({"SLURM_JOB_ID": "1x", "RANK": "2"}, None, False),
        ({"LOCAL_RANK": "1"}, None, False),
        ({"SLURM_PROCID": "3"}, None, False),
    ],
)  # fmt: skip
def test_the_launch_variables_name_the_slurm_job_and_rank_zero(env, job, zero) -> None:
    assert signals.slurm_job_id(env) == job and signals.rank_zero(env) is zero


@pytest.fixture
def quits(monkeypatch: pytest.MonkeyPatch, one_process: None) -> list[tuple[int, str]]:
    asked: list[tuple[int, str]] = []
    monkeypatch.setattr(signals, "quit_now", lambda signum, why: asked.append((signum, why)))
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # SIGUSR1 is a stop (SLURM's warning)
    return asked


@pytest.mark.parametrize(
    ("first", "again", "quit"),
    [
        (signal.SIGINT, signal.SIGINT, True),
        (signal.SIGUSR1, signal.SIGUSR1, True),
        (signal.SIGUSR1, signal.SIGTERM, False),  # SLURM's end after its warning: the same stop
    ],
)
def test_a_second_request_quits_and_slurms_end_after_its_warning_does_not(
    quits, monkeypatch, first, again, quit
) -> None:
    monkeypatch.setattr(signals, "STOP_REPEAT_S", 0.0)  # every later delivery asks again
    before = set(threading.enumerate())
    with pytest.raises(SystemExit) as stop, signals.stop_on_signal() as request:
        (watcher,) = [t for t in set(threading.enumerate()) - before if t.name == "signal-watch"]
        assert watcher.daemon
        os.kill(os.getpid(), first)
        until(lambda: request.received == first, 10)
        for signum in (again, first):  # the last one quits: the watcher reads them in order
            os.kill(os.getpid(), signum)
        until(lambda: len(quits) > quit, 10)
    assert quits == [(again, AGAIN)] * quit + [(first, AGAIN)]
    assert stop.value.code == 128 + first
    watcher.join(5)  # it wakes up to see the run is over
    assert not watcher.is_alive()


@pytest.mark.parametrize(
    ("first", "since", "parent_died", "again", "second"),
    [
        (signal.SIGINT, 2.0, False, signal.SIGINT, True),
        (signal.SIGINT, 0.1, False, signal.SIGINT, False),  # the same stop delivered again
        (signal.SIGTERM, 2.0, True, signal.SIGTERM, False),  # PR_SET_PDEATHSIG, per thread
        (signal.SIGUSR1, 2.0, False, signal.SIGTERM, False),  # SLURM's end after its warning
        (signal.SIGUSR1, 2.0, False, signal.SIGUSR1, True),
        (signal.SIGUSR1, 2.0, False, signal.SIGINT, False),
        (signal.SIGHUP, 2.0, False, signal.SIGTERM, True),
        (None, 2.0, False, signal.SIGTERM, False),
    ],
)
def test_what_counts_as_a_second_request(first, since, parent_died, again, second) -> None:
    stop = signals.StopRequest(first, received_at=time.monotonic() - since)
    stop.parent = os.getppid() + parent_died
    assert signals._second_request(stop, again, time.monotonic()) is second


@pytest.mark.parametrize(
    ("state", "signum", "expected"),
    [
        ({}, 15, [(15, "received after the run had finished (its files are complete)")]),
        ({"failed": True}, 15, []),  # the error's own line and exit code follow
        ({"failed": True, "quiet": True}, 15, []),
        ({"received": 2, "received_at": -9.0}, 15, [(15, "again: quitting at once")]),
        ({"received": 10, "received_at": -9.0}, 10, [(10, "again: quitting at once")]),
        ({"received": 10, "received_at": -9.0}, 15, []),  # SLURM's end after its warning
        ({"received": 15}, 15, []),  # the stop itself, delivered again
        ({"quiet": True}, 15, ["exit 143"]),  # a DDP worker: rank 0 speaks
    ],
)
def test_a_signal_after_the_run_is_one_line(monkeypatch, quits, state, signum, expected) -> None:
    state = {"received_at": time.monotonic(), **state}
    monkeypatch.setattr(signals, "request", signals.StopRequest(**state))
    monkeypatch.setattr(os, "_exit", lambda code: quits.append(f"exit {code}"))
    signals._after_the_run(signum, None)
    assert quits == expected


@pytest.mark.parametrize(
    ("env", "where", "stderr_fails"),
    [
        ({"RANK": "2"}, "rank 2: ", None),
        ({"LOCAL_RANK": "3"}, "rank 3: ", RuntimeError("reentrant call")),  # a handler interrupted a write
        ({"RANK": "0"}, "", ValueError("closed")),  # no line, no traceback
        ({}, "", None),
    ],
)  # fmt: skip
def test_quitting_says_which_rank_kills_the_workers_and_exits_128_plus_n(
    monkeypatch, capfd, one_process, env, where, stderr_fails
) -> None:
    children = [Mock(**{"kill.side_effect": ProcessLookupError}), Mock()]
    monkeypatch.setattr(signals, "request", signals.StopRequest(children=children))
    monkeypatch.setattr(signals, "_quitting", threading.Lock())
    monkeypatch.setattr(os, "_exit", raises(SystemExit(143)))
    monkeypatch.setattr(sys, "stdout", SimpleNamespace(flush=raises(BrokenPipeError())))
    if stderr_fails:
        monkeypatch.setattr(sys, "stderr", SimpleNamespace(write=raises(stderr_fails)))
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit):
        signals.quit_now(signal.SIGTERM, "why \udcff")
    children[1].kill.assert_called_once_with()
    line = f"\nerror: {where}SIGTERM why ?; exit code 143\n"
    assert capfd.readouterr().err == ("" if isinstance(stderr_fails, ValueError) else line)
    signals.quit_now(signal.SIGTERM, "again")  # the other thread is saying it already
    assert capfd.readouterr().err == ""


def test_a_stuck_rank_quits_after_the_grace(monkeypatch, quits) -> None:
    stop, grace, sigterm = signals.StopRequest(), signals.STUCK_GRACE_S, signal.SIGTERM
    monkeypatch.setattr(signals, "STUCK_GRACE_S", 0.2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with signals.stop_on_signal() as request:  # a handler that cannot run: only the wakeup byte
        wakeup = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(wakeup)
        os.write(wakeup, bytes([sigterm]))  # what the C-level handler writes
        until(lambda: quits, 10)
        assert request.received is None
    assert quits and set(quits) == {(sigterm, STUCK.format("in native code", 0))}
    monkeypatch.setattr(signals, "STUCK_GRACE_S", grace)
    quits[:] = []
    assert signals._check_stuck(stop, sigterm, grace, None, 0.0) is None  # the handler may run
    assert quits == []
    assert signals._check_stuck(stop, sigterm, grace + 0.5, None, 0.0) is None
    assert quits == [(sigterm, STUCK.format("in native code", 10))]
    stop.received, quits[:] = sigterm, []
    code = SimpleNamespace(co_filename=f"torch{os.sep}distributed{os.sep}c.py", co_name="barrier")
    frame = SimpleNamespace(f_code=code, f_lasti=8)
    monkeypatch.setattr(sys, "_current_frames", lambda: {threading.main_thread().ident: frame})
    waiting = None
    for now in (200.0, 200.0 + grace, 200.5 + grace):
        waiting = signals._check_stuck(stop, sigterm, 99.0, waiting, now)
        assert waiting == (("barrier", id(frame), 8), 200.0)
    assert quits == [(sigterm, STUCK.format("in torch.distributed.barrier", 10))]
    frame.f_lasti = 9  # another call: its own grace
    assert signals._check_stuck(stop, sigterm, 99.0, waiting, 300.0)[1] == 300.0
    monkeypatch.setattr(sys, "_current_frames", lambda: {})
    assert signals._check_stuck(stop, sigterm, 99.0, waiting, 300.0) is None


def test_a_child_forked_during_a_run_gets_the_handlers_from_before_it(monkeypatch) -> None:
    mine, stops = (lambda *_: None), {signal.SIGINT, signal.SIGTERM}
    monkeypatch.setattr(signals, "request", signals.StopRequest())
    previous, mask = signal.signal(signal.SIGTERM, mine), blocked()
    workers: list = []
    monkeypatch.setattr(signals, "_dataloader_worker_stops", lambda: workers.append("worker"))
    try:
        with signals.stop_on_signal() as request:
            if (pid := os.fork()) == 0:
                os._exit(0)
            assert os.waitpid(pid, 0)[1] == 0 and not stops & blocked()  # the parent's mask back
            signals._before_fork()  # the fork hooks, the child's in this process
            assert stops <= blocked()
            signals._in_forked_child()
            assert not stops & blocked() and workers == []
            assert signal.getsignal(signal.SIGTERM) is mine
            assert signals.request is not request and signals.request.quiet
            assert signal.set_wakeup_fd(-1) == -1
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # a DataLoader worker's fork
            monkeypatch.setattr(signals, "_worker_stops", (signal.SIGTERM,))
            signals._in_forked_child()
            assert signal.SIGTERM not in blocked() and signals._worker_stops == ()
        monkeypatch.setattr(compat, "forked_for_a_dataloader_worker", lambda: True)
        with signals.stop_on_signal():
            signals._before_fork()
            signals._in_forked_child()
            assert stops <= blocked() and workers == ["worker"]
        signals._set({signal.SIGUSR2: None})  # a handler not set from Python
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # SIGHUP's too: later tests send it


def test_a_dataloader_worker_ends_on_its_parents_sigterm_alone(monkeypatch) -> None:
    stops, threads = (signal.SIGTERM, signal.SIGINT), []
    start = lambda target, **how: SimpleNamespace(start=lambda: threads.append((target, how)))  # noqa: E731
    monkeypatch.setattr(threading, "Thread", start)
    monkeypatch.setattr(signals, "_before_the_run", dict.fromkeys(stops))
    monkeypatch.setattr(signals, "_worker_stops", ())
    monkeypatch.setattr(os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    try:
        signals._dataloader_worker_stops()
        assert signals._worker_stops == stops and threads[0][1] == {"daemon": True}
        assert set(stops) <= blocked()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
    parent, waits = os.getppid(), []
    got = iter([(signal.SIGINT, parent), (signal.SIGTERM, os.getpid()), (signal.SIGTERM, parent)])

    def sigwaitinfo(signals_: object) -> SimpleNamespace:
        waits.append(signals_)
        signo, pid = next(got)  # StopIteration: the parent's SIGTERM did not end it
        return SimpleNamespace(si_signo=signo, si_pid=pid)

    monkeypatch.setattr(signal, "sigwaitinfo", sigwaitinfo)
    with pytest.raises(SystemExit) as ended:
        threads[0][0]()
    assert ended.value.code == 0 and waits == [stops] * 3


@pytest.mark.parametrize(
    ("size", "initialized", "world", "distributed"),
    [("", True, 2, True), ("1", True, 1, False), ("", False, 2, False), ("2", False, 1, True)],
)
def test_a_rank_of_several_is_told_by_its_launcher_or_torch(
    monkeypatch, size, initialized, world, distributed
) -> None:
    monkeypatch.setenv("WORLD_SIZE", size)
    fake = SimpleNamespace(is_initialized=lambda: initialized, get_world_size=lambda: world)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    assert signals._distributed() is distributed
    fake.get_world_size = lambda: 1 / 0  # torch's own failure: not a rank of several
    assert signals._distributed() is (size == "2")


@pytest.mark.parametrize(("gone", "terminal"), [(1, "pipe"), (2, "pipe"), (2, "pty")])
def test_outputs_whose_reader_is_gone_go_to_dev_null(gone: int, terminal: str) -> None:
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    reader, writer = pty.openpty() if terminal == "pty" else os.pipe()
    live_reader, live_writer = os.pipe()
    try:
        os.dup2(writer, gone)
        os.dup2(live_writer, 3 - gone)
        os.close(reader)
        signals._drop_closed_outputs()
        assert os.readlink(f"/proc/self/fd/{gone}") == os.devnull
        assert os.readlink(f"/proc/self/fd/{3 - gone}") != os.devnull
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        for fd in (writer, live_reader, live_writer):
            os.close(fd)


def test_a_stop_waits_for_its_workers_then_says_so_on_stderr_and_in_the_log(
    monkeypatch, capfd, tmp_path
) -> None:
    children = [Mock(), Mock(**{"wait.side_effect": [subprocess.TimeoutExpired("w", 30), 0]})]
    request = signals.StopRequest(children=children, phase="fit", detail="; saved x")
    monkeypatch.setattr(signals, "request", request)
    log = tmp_path / "train.log"
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter("%(name)s:%(levelname)s:%(filename)s:%(message)s"))
    logging.getLogger().addHandler(handler)
    try:
        with pytest.raises(SystemExit) as stop:
            signals.exit_stopped(signal.SIGTERM)
        monkeypatch.setattr(signals, "request", signals.StopRequest(quiet=True))  # a DDP worker
        with pytest.raises(SystemExit) as quiet:
            signals.exit_stopped(signal.SIGTERM)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert stop.value.code == quiet.value.code == 143 and request.children == []
    assert children[0].mock_calls == [call.wait(timeout=30.0)]  # the other does not end: killed
    assert children[1].mock_calls == [call.wait(timeout=30.0), call.kill(), call.wait()]
    line = "stopped by SIGTERM during fit; saved x; exit code 143"
    assert capfd.readouterr().err == f"{line}\n"  # once: the DDP worker says nothing
    assert log.read_text() == f"runkit.safety.signals:WARNING:signals.py:{line}\n"


def test_after_the_run_the_stop_signals_are_ignored_until_the_process_ends() -> None:
    before = {signum: signal.getsignal(signum) for signum in signals.stop_signals()}
    try:
        signals._at_exit()
        assert {signal.getsignal(signum) for signum in before} == {signal.SIG_IGN}
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_a_dead_peer_is_named_with_its_whole_first_line() -> None:
    reason = "[../gloo/transport/tcp/pair.cc:534] Read error [::1]:41: Connection reset by peer"
    trainer = SimpleNamespace(
        world_size=2, global_rank=0, checkpoint_callback=None, default_root_dir="/x"
    )
    with pytest.raises(interrupts.PeerDied) as died, interrupts.phase("fit", trainer):  # type: ignore[arg-type]
        raise RuntimeError(f"{reason}\nException raised from ...")
    assert f"({reason}); stopping the job" in str(died.value)


def fake_scontrol(directory: Path, code: int = 0) -> Path:
    directory.mkdir(exist_ok=True)
    script, calls = directory / "scontrol", directory / "scontrol.calls"
    fail = f'echo "scontrol: error: Invalid job id specified" >&2\nexit {code}\n' if code else ""
    script.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n{fail}')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return calls


def test_requeue_calls_scontrol_and_says_when_it_cannot(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_JOB_NAME", raising=False)
    calls = fake_scontrol(tmp_path / "ok")
    monkeypatch.setenv("PATH", f"{tmp_path / 'ok'}{os.pathsep}{os.environ['PATH']}")
    assert interrupts.requeue_slurm_job() == "; requeued SLURM job 77"
    assert calls.read_text() == "requeue 77\n"
    fake_scontrol(tmp_path / "bad", code=1)
    monkeypatch.setenv("PATH", str(tmp_path / "bad"))
    assert interrupts.requeue_slurm_job() == (
        "; could not requeue SLURM job 77 (scontrol: scontrol: error: Invalid job id specified): "
        "submit it again to resume"
    )
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert "could not requeue SLURM job 77" in interrupts.requeue_slurm_job()
    monkeypatch.delenv("SLURM_JOB_ID")
    assert interrupts.requeue_slurm_job() == ""


LOOPS = ("train", "validation", "test", "predict")


class SignalOnce(Callback):
    """SIGTERM as batch ``batch`` of loop ``at`` ends; counts the batches ended per loop."""

    def __init__(self, at: str, batch: int) -> None:
        self.at, self.batch, self.sent = at, batch, False
        self.ended = dict.fromkeys(("sanity", *LOOPS), 0)

    def _end(self, trainer: Trainer, loop: str, batch_idx: int) -> None:
        loop = "sanity" if trainer.sanity_checking else loop
        self.ended[loop] += 1
        if (loop, batch_idx) == (self.at, self.batch) and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


for _loop in LOOPS:  # the same hook in every loop
    setattr(
        SignalOnce, f"on_{_loop}_batch_end", lambda s, t, m, o, b, i, *a, _l=_loop: s._end(t, _l, i)
    )

AT_4 = "at epoch 1, step 4; saved {saved}"
STOPS = {
    "training": ("fit", "train", 1, {"sanity": 2, "train": 2}, "at epoch 0, step 2; saved {saved}"),
    "sanity check": ("fit", "sanity", 1, {"sanity": 2}, "before the first training step (nothing to save)"),
    "training's last batch": ("fit", "train", 3, {"sanity": 2, "train": 4, "validation": 4}, AT_4),
    "fit's validation": ("fit", "validation", 0, {"sanity": 2, "train": 4, "validation": 4}, AT_4),
    "validate": ("validate", "validation", 0, {"validation": 1}, ""),
    "test": ("test", "test", 0, {"test": 1}, ""),
    "predict": ("predict", "predict", 0, {"predict": 1}, ""),
}  # fmt: skip


@pytest.mark.parametrize("case", list(STOPS))
def test_a_stop_ends_every_loop_at_the_next_batch(
    tmp_path, case, capsys, monkeypatch, one_process
) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py"])  # the resume command reads it, not pytest's
    fn, at, batch, ended, end = STOPS[case]
    probe = SignalOnce(at, batch)
    limits = {f"limit_{loop}_batches": 4 for loop in ("train", "val", "test", "predict")}
    trainer = Trainer(
        accelerator="cpu", max_epochs=3, num_sanity_val_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, callbacks=[probe, interrupts.GracefulInterrupt()], **limits,
    )  # fmt: skip
    with pytest.raises(SystemExit) as stop, signals.stop_on_signal(), interrupts.phase(fn, trainer):
        getattr(trainer, fn)(BoringModel())
    assert stop.value.code == 143
    assert {loop: n for loop, n in probe.ended.items() if n} == ended
    saved = tmp_path / "checkpoints" / interrupts.INTERRUPTED_FILE
    assert saved.exists() == ("saved" in end)
    line = f"stopped by SIGTERM during {fn}{f' {end}' if end else ''}; exit code 143"
    assert last_line(capsys.readouterr().err) == line.format(saved=saved)


FAILED_RUN = """
import os, signal, sys
from runkit.safety import signals
try:
    with signals.stop_on_signal(until_exit=True):
        raise ValueError("bad input")
except ValueError:
    os.kill(os.getpid(), signal.SIGTERM)
    print("error: bad input", file=sys.stderr)
    raise SystemExit(2)
"""
SHUTTING_DOWN = """
import os, signal, time
from runkit.safety import signals
with signals.stop_on_signal(until_exit=True):
    pass  # the run is done; what follows is the process shutting down
os.kill(os.getpid(), signal.SIGINT)
time.sleep(30)
print("not reached")
"""
STUCK_RANK = """
import os, signal, sys, threading
from datetime import timedelta
import torch.distributed as dist
from runkit.safety import signals
os.environ["WORLD_SIZE"], signals.STUCK_GRACE_S = "2", 2.0
with signals.stop_on_signal():
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    store = dist.FileStore(sys.argv[1], 2)  # rank 1 never comes: rank 0 waits in C++
    dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=300))
print("not reached")
"""
DATALOADER_WORKERS = """
import multiprocessing, os, signal, subprocess, sys, time
from runkit.safety import signals
from torch.utils.data import DataLoader

def from_elsewhere(pid, signum):
    subprocess.run(["kill", f"-{signum}", str(pid)], check=True)

with signals.stop_on_signal():
    loader = DataLoader(range(64), batch_size=4, num_workers=2)
    os.register_at_fork(after_in_child=lambda: [os.kill(os.getpid(), s) for s in (15, 2)])
    print("batches", len(list(loader)), flush=True)
    batches = iter(loader)
    next(batches)
    workers = multiprocessing.active_children()
    for worker in workers:
        from_elsewhere(worker.pid, signal.SIGTERM)
        from_elsewhere(worker.pid, signal.SIGINT)
    time.sleep(0.5)
    print("alive", [w.is_alive() for w in workers], "batches", len(list(batches)) + 1, flush=True)
    batches = iter(loader)
    next(batches), next(batches)  # batch i comes from worker i % 2: both are past their start-up
    workers = multiprocessing.active_children()
    workers[0].terminate()  # the parent's SIGTERM, as multiprocessing ends a worker at exit
    workers[0].join(20)
    print("terminated", workers[0].exitcode, flush=True)
    left = iter(loader)  # the interpreter exits with this iterator's workers still there
    next(left)
print("end", flush=True)
"""


@pytest.mark.parametrize(  # slow: the two that import torch
    ("program", "code", "out", "err"),
    [
        pytest.param(FAILED_RUN, 2, [], ["error: bad input"], id="a signal after a failed run"),
        pytest.param(SHUTTING_DOWN, 130, [], ["error: SIGINT received after the run had finished (its files are complete); exit code 130"], id="a Ctrl-C while a finished run shuts down"),
        pytest.param(STUCK_RANK, 143, [], [f"error: SIGTERM {STUCK.format('in native code', 2)}; exit code 143"], id="a rank stuck in a collective ends within seconds", marks=pytest.mark.slow),
        pytest.param(DATALOADER_WORKERS, 0, ["batches 16", "alive [True, True] batches 16", "terminated 0", "end"], [], id="a DataLoader worker ends by its parent alone", marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_stop_signals_in_a_fresh_interpreter(tmp_path, program, code, out, err) -> None:
    done = run_python(program, str(tmp_path / "store"), timeout=90)
    assert done.returncode == code, done.stderr[-3000:]
    assert done.stdout.splitlines() == out, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if line.strip()] == err


# ------------------------------------------------------------------------------------------------
# The real CLI, each run in a session of its own


def descendants(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    kids = [int(p) for p in path.read_text().split()] if path.exists() else []
    return [*kids, *(d for kid in kids for d in descendants(kid))]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def all_gone(job: Run, started: list[int]) -> bool:
    """Every process ``job`` started has ended, and its group within 30 s."""

    def in_group() -> list[int]:
        members = []
        for stat_file in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError):
                fields = stat_file.read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == job.pid and fields[0] != "Z":
                    members.append(int(stat_file.parent.name))
        return members

    left = [pid for pid in started if alive(pid)]  # no wait: these end before the run does
    until(lambda: not in_group(), 30)
    return not left and not in_group()


class Run(subprocess.Popen):
    """``python -m tinyapp.<task>`` in its own session; killed with its group at the end."""

    def __init__(self, tmp_path: Path, task: str, *overrides: str, env=None, output=None) -> None:
        self.out, self.err, self.log_dir = (tmp_path / n for n in ("stdout", "stderr", "logs"))
        command = [
            sys.executable,
            "-m",
            f"tinyapp.{task}",
            *overrides,
            f"paths.log_dir={self.log_dir}",
        ]
        with self.out.open("w") as stdout, self.err.open("w") as stderr:
            super().__init__(
                command, cwd=tmp_path, stdout=output or stdout, stderr=output or stderr,
                start_new_session=True, env=clean_env(**{"PYTHONPATH": str(TESTS), **(env or {})}),
            )  # fmt: skip

    def until(self, found: Callable[[], object], what: str, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while not found():
            assert self.poll() is None, f"exited before {what}: {self.text[-3000:]}"
            assert time.time() < deadline, f"no {what} after {timeout} s"
            time.sleep(0.1)

    @property
    def text(self) -> str:
        return self.err.read_text()


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    started: list[Run] = []

    def start(task: str, *overrides: str, **how: object) -> Run:
        started.append(Run(tmp_path, task, *overrides, **how))  # type: ignore[arg-type]
        return started[-1]

    yield start
    for each in started:
        if each.poll() is None:
            os.killpg(each.pid, signal.SIGKILL)
            each.wait()


def held(tmp_path: Path, target: str, at: str = "", name: str = "pause") -> tuple[list[str], Path]:
    marker, key = tmp_path / name, f"+callbacks.{name}"
    added = [f"{key}._target_=user_callbacks.{target}", f"{key}.marker={marker}"]
    return [*added, *([f"{key}.at={at}"] if at else [])], marker


def release(marker: Path) -> None:
    Path(f"{marker}.release").touch()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, str, Path]:
    """``trainer.devices=2`` on CPU, given a Ctrl-C as it prints ``Run directory:``: exit code, its
    output, what followed, its log dir (its batch size gives eval and predict several batches a rank)."""
    log_dir = tmp_path_factory.mktemp("trained") / "logs"
    process = subprocess.Popen(
        [sys.executable, "-m", "tinyapp.train", *SMALL, "data.batch_size=64", "trainer.devices=2",
         "trainer.accelerator=cpu", "+trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
         f"paths.log_dir={log_dir}"],
        cwd=log_dir.parent, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    assert process.stdout is not None
    head = []
    try:
        for line in process.stdout:
            head.append(line)
            if "Run directory: " in line:
                os.killpg(process.pid, signal.SIGINT)
                break
        rest = process.stdout.read()
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, "".join(head) + rest, rest, log_dir


@pytest.mark.slow
def test_two_cpu_processes_train_one_run_and_a_ctrl_c_after_it_is_one_line(finished_run) -> None:
    code, output, rest, log_dir = finished_run
    assert code == 130, rest[-3000:]
    assert last_line(rest) in (
        "stopped by SIGINT after export had finished (its files are written); exit code 130",
        "error: SIGINT received after the run had finished (its files are complete); exit code 130",
    ), rest[-3000:]
    (run,) = run_dirs(log_dir)  # rank 1 made no directory of its own
    assert len(list(log_dir.rglob("config.yaml"))) == 2  # config.yaml + .hydra/config.yaml
    for name in ("config.yaml", "model.pth", "metrics.json", "checkpoints/last.ckpt"):
        assert (run / name).is_file(), name
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in (run / "train_ddp_process_1.log").read_text()
    # batch_size is per process: each rank sees half the data, so an epoch has half the steps
    summary = json.loads((run / "metrics.json").read_text())
    samples = 1797 - 2 * round(1797 * 0.15)  # the digits split: 1257 training samples
    assert summary["global_step"] == math.ceil(math.ceil(samples / 2) / 64) < samples / 64
    assert summary["devices"] == 2 and 0.0 <= summary["metrics"]["test/acc"] <= 1.0
    with (run / "csv" / "metrics.csv").open() as handle:  # written by rank 0 alone
        rows = list(csv.DictReader(handle))
    assert [row["epoch"] for row in rows if row.get("train/loss")] == ["0"]
    assert len([row for row in rows if row.get("test/acc")]) == 1
    assert output.count("Run directory:") == 1


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 2])
def test_ddp_on_real_gpus(cli, log_dir: Path, count: int) -> None:
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available < count:
        pytest.skip(f"needs {count} CUDA GPU(s); this machine has {available}")
    result = cli("train", "trainer=ddp", "trainer.accelerator=gpu", f"trainer.devices={count}",
                 "trainer.max_epochs=1", "data.batch_size=256", *QUIET)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = run_dirs(log_dir)
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["devices"] == count and summary["accelerator"] == "CUDAAccelerator"
    samples = 1797 - 2 * round(1797 * 0.15)
    assert summary["global_step"] == math.ceil(math.ceil(samples / count) / 256)


WORKERS = ("data.num_workers=2", *LONG)  # a group's signal reaches the DataLoader workers too
SAVED = "fit at epoch 0, step {step}; saved {saved}"
CLI_STOPS = {
    # case: (the task and its overrides, where rank 0 is held, who gets the signal: the group,
    # rank 0 alone, or rank 0 then its group (GNU timeout), the last line's "during ...", the
    # files the stop leaves unwritten); in one process: test_a_stop_ends_every_loop_at_the_...
    "sanity check, DDP": (
        ["train", "trainer=ddp_sim", "trainer.num_sanity_val_steps=1", *SMALL], "sanity", "group",
        "fit before the first training step (nothing to save)",
        ["checkpoints/interrupted.ckpt", "checkpoints/last.ckpt"],
    ),
    "eval, DDP": (["eval", "trainer=ddp_sim"], "test", "group", "eval", ["metrics.json"]),
    "predict, DDP": (["predict", "trainer=ddp_sim"], "predict", "group", "predict", ["predictions.pt"]),
    "fit, DDP, SIGTERM to rank 0 alone": (["train", "trainer=ddp_sim", *WORKERS], "train", "rank 0", SAVED, []),
    "fit, FSDP, timeout's SIGTERM": (
        ["train", "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", *WORKERS], "train",
        "rank 0, then group", SAVED, [],
    ),
    # its progress bar writes to a terminal that is gone (a closed pty answers EIO): SIGHUP
    "fit, hang-up, the terminal gone": (
        ["train", "data.num_workers=2", "trainer.max_epochs=2", "test=false"], "train", "terminal, group",
        SAVED, [],
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CLI_STOPS))
def test_one_stop_in_any_phase_ends_it_at_the_next_batch_with_one_line(
    tmp_path, run, case, request
) -> None:
    (task, *overrides), at, whom, during, unwritten = CLI_STOPS[case]
    if task != "train":
        overrides.append(
            f"ckpt_path={run_dirs(request.getfixturevalue('finished_run')[3])[0]}/checkpoints/last.ckpt"
        )
    hold, marker = held(tmp_path, "Pause", at)
    terminal, (reader, writer) = whom.startswith("terminal"), pty.openpty()
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a shell starts it, not as nohup
    try:
        job = run(task, *overrides, *hold, output=writer if terminal else None)
    finally:
        signal.signal(signal.SIGHUP, before)
        os.close(writer)
    os.set_blocking(reader, False)

    def is_held() -> bool:  # reads what it prints (the progress bar's too) until held
        with contextlib.suppress(OSError):  # BlockingIOError: nothing new
            os.read(reader, 1 << 16)
        return marker.exists()

    job.until(is_held, "the hold")
    started = descendants(job.pid)  # with its DataLoader workers: the group's signal is one stop
    os.close(reader)
    signum = signal.SIGHUP if terminal else signal.SIGTERM
    if whom.startswith("rank 0"):
        job.send_signal(signum)
    if whom.endswith("group"):  # as a terminal's Ctrl-C, SLURM or Kubernetes: every process
        os.killpg(job.pid, signum)
    release(marker)
    assert job.wait(timeout=120) == 128 + signum, job.text[-3000:]
    (run_dir,) = run_dirs(job.log_dir, task)
    saved = run_dir / "checkpoints" / interrupts.INTERRUPTED_FILE  # FSDP's: a sharded directory
    step = int(marker.read_text().split()[1]) + 1  # held after the batch's stop check: the next
    during = during.format(step=step, saved=saved)
    line = f"stopped by {signal.Signals(signum).name} during {during}; exit code {128 + signum}"
    if terminal:  # what it printed is gone with the terminal: its log says it
        log = (run_dir / "train.log").read_text()
        assert last_line(log).endswith(f"[WARNING] {line}") and "ckpt_path=" in log  # to resume
        assert torch.load(saved, map_location="cpu", weights_only=True)["global_step"] == step
    else:
        assert last_line(job.text) == line
        assert job.text.count("SIGTERM received") == 1, job.text[-3000:]
    for absent in ("again: quitting", "Traceback", "killed by signal", "weights_only` was not set"):
        assert absent not in job.text  # loaded with weights_only
    assert saved.exists() == ("saved" in during)
    assert [name for name in unwritten if (run_dir / name).exists()] == []
    assert all_gone(job, started)


@pytest.mark.slow
def test_a_slurm_job_saves_on_its_warning_signal_requeues_and_resumes_by_itself(
    tmp_path, run
) -> None:
    calls = fake_scontrol(tmp_path / "bin")
    hold, marker = held(tmp_path, "Pause", "train")
    command = ("trainer.max_epochs=1", "data.batch_size=256", "test=false", *QUIET, *hold)
    slurm = {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }  # fmt: skip
    job = run("train", *command, env=slurm)
    job.until(marker.exists, "the hold")
    job.send_signal(signal.SIGUSR1)
    release(marker)
    assert job.wait(timeout=120) == 128 + signal.SIGUSR1, job.text[-3000:]
    (first,) = run_dirs(job.log_dir)
    assert first.name.endswith("_slurm-4242")
    saved = first / "checkpoints" / "interrupted.ckpt"
    assert last_line(job.text).endswith(f"saved {saved}; requeued SLURM job 4242; exit code 138")
    assert calls.read_text() == "requeue 4242\n"
    step = torch.load(saved, map_location="cpu", weights_only=True)["global_step"]

    marker.unlink()
    rerun = run("train", *command, env={**slurm, "SLURM_RESTART_COUNT": "1"})
    assert rerun.wait(timeout=300) == 0, rerun.text[-3000:]
    second = next(d for d in run_dirs(job.log_dir) if d != first)
    assert second.name.endswith("_slurm-4242-requeue1")
    summary = json.loads((second / "metrics.json").read_text())
    assert summary["resumed_from"] == str(saved) and summary["global_step"] > step
    log = (second / "train.log").read_text()
    assert f"SLURM job 4242 was requeued: resuming from {saved}" in log
    assert not marker.exists()  # the resumed run did not pause: it started after that batch
    assert not (first / "metrics.json").exists()  # the stopped run's directory is left as it was


FAKE_CUDA = """from runkit.gpus import inventory
from runkit.gpus.inventory import TorchCuda
inventory.probe_torch = lambda uuids=True: TorchCuda(True, 2)  # test only: two CUDA devices
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["saving", "waiting for GPUs"])
def test_a_second_ctrl_c_through_the_cli_quits_at_once_in_every_phase(tmp_path, run, where) -> None:
    env, pause, hold_save = {}, tmp_path / "pause", tmp_path / "hold_save"
    if where == "waiting for GPUs":
        (tmp_path / "fake_cuda").mkdir()
        (tmp_path / "fake_cuda" / "sitecustomize.py").write_text(FAKE_CUDA)
        overrides = ["trainer.accelerator=gpu", "select_gpus=least_used", "gpu_max_util=30"]
        overrides += ["gpu_wait_s=3600", f"gpu_lock_dir={tmp_path / 'locks'}"]
        env = {
            "PYTHONPATH": f"{tmp_path / 'fake_cuda'}{os.pathsep}{TESTS}",
            "RUNKIT_NVML_BACKEND": "runkit.testing.fake_nvml:create",
            "RUNKIT_FAKE_NVML": json.dumps({"gpus": [{"util_gpu": 100}, {"util_gpu": 100}]}),
        }
        is_held = lambda: "Waiting for 1 GPU(s)" in job.out.read_text() + job.text  # noqa: E731
    else:  # held in fit, then in the save the first Ctrl-C asked for
        overrides = (
            held(tmp_path, "Pause", "train")[0] + held(tmp_path, "HoldSave", name="hold_save")[0]
        )
        is_held = pause.exists
    job = run("train", *SMALL, *overrides, env=env)
    job.until(is_held, f"the hold in {where}")
    os.killpg(job.pid, signal.SIGINT)
    job.until(lambda: FIRST_CTRL_C in job.text, "the first Ctrl-C's line")
    time.sleep(signals.STOP_REPEAT_S)  # sooner, it is the first Ctrl-C delivered again
    if where == "saving":
        assert pause.read_text().split("\n")[0] == "fit"
        release(pause)
        job.until(hold_save.exists, "the save after the first Ctrl-C")
        assert hold_save.read_text() == f"fit\nsaving after signal {int(signal.SIGINT)}"
    started = descendants(job.pid)
    os.killpg(job.pid, signal.SIGINT)
    assert job.wait(timeout=15) == 130, job.text[-3000:]  # at once: the hold would last 300 s
    assert last_line(job.text) == f"error: SIGINT {AGAIN}; exit code 130", job.text[-3000:]
    assert "Traceback" not in job.text
    assert all_gone(job, started), "processes of the run are left behind"
    for run_dir in run_dirs(job.log_dir):  # quit without saving: nothing new is written
        assert not (run_dir / "checkpoints" / "interrupted.ckpt").exists()
        assert not (run_dir / "model.pth").exists() and not (run_dir / "metrics.json").exists()


@pytest.mark.slow
def test_a_dataloader_worker_killed_during_a_run_ends_it_with_exit_1(tmp_path, run) -> None:
    hold, marker = held(tmp_path, "Pause", "train")
    job = run("train", *WORKERS, *hold)
    job.until(marker.exists, "the hold")
    os.kill(descendants(job.pid)[0], signal.SIGKILL)
    release(marker)
    assert job.wait(timeout=120) == 1, job.text[-3000:]
    assert "DataLoader worker" in job.text, job.text[-3000:]
    assert all_gone(job, []), "processes of the run are left behind"


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["rank1", "rank0"])
def test_a_dying_rank_ends_the_job(run, victim: str) -> None:
    job = run("train", "trainer.accelerator=cpu", "trainer.devices=2", *LONG)
    job.until(lambda: list(job.log_dir.glob("train/runs/*/checkpoints/last.ckpt")), "last.ckpt")
    (last,) = job.log_dir.glob("train/runs/*/checkpoints/last.ckpt")
    rank1 = descendants(job.pid)[0]
    os.kill(rank1 if victim == "rank1" else job.pid, signal.SIGKILL)
    survivor = job.pid if victim == "rank1" else rank1
    until(lambda: job.poll() is not None and not alive(survivor), 60)
    assert not alive(survivor), f"the surviving rank was still running after 60 s ({victim})"
    if victim == "rank1":
        assert job.wait(timeout=10) != 0
        assert "another process of this 2-process job died" in job.text, job.text[-2000:]
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] > 0
