"""``python -m runkit.devices --watch [SECONDS]``: the live table, ``--json`` lines, Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from rich.console import Console
from test_devices_cli import GPU_KEYS, JSON_KEYS, fake_env

from runkit.gpus import inventory, listing, nvml
from runkit.gpus.listing import main
from runkit.gpus.records import TorchCuda
from runkit.testing.fake_nvml import GIB, FakeClock, FakeGpu, FakeNvml, FakeProcess

UUID0 = "GPU-aaaa1111-1111-1111-1111-111111111111"
UUID1 = "GPU-bbbb2222-2222-2222-2222-222222222222"


@pytest.fixture
def refreshes(monkeypatch):
    """A fake NVML whose GPU 0 goes from 10 % to 90 % busy at t=1 s, torch seeing both GPUs
    (counted), and a ``sleep`` that moves the fake clock and presses Ctrl-C at the third."""
    clock = FakeClock()
    fake = FakeNvml(
        [
            FakeGpu(
                uuid=UUID0,
                util_gpu=[(0, 10), (1, 90)],
                processes=[FakeProcess(4242, 3 * GIB)],
            ),
            FakeGpu(uuid=UUID1),
        ],
        clock=clock,
    )
    nvml.use_library(fake)
    probes: list[bool] = []
    monkeypatch.setattr(
        listing, "probe_torch", lambda uuids=True: probes.append(uuids) or TorchCuda(True, 2)
    )
    monkeypatch.setattr(inventory, "probe_torch", listing.probe_torch)
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt
        clock.advance(seconds)

    monkeypatch.setattr(
        listing, "time", SimpleNamespace(sleep=sleep, time=time.time, strftime=time.strftime)
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield SimpleNamespace(fake=fake, probes=probes, sleeps=sleeps)
    nvml.use_library(None)


def test_json_watch_prints_one_document_per_refresh_and_ctrl_c_exits_zero(refreshes, capsys):
    assert main(["--json", "--watch", "1.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    docs = [json.loads(line) for line in lines]
    assert len(docs) == 3 and refreshes.sleeps == [1.5, 1.5, 1.5]
    assert all(set(d) == JSON_KEYS | {"time"} for d in docs)
    assert all(set(g) == GPU_KEYS for d in docs for g in d["gpus"])
    assert [d["gpus"][0]["utilization_percent"] for d in docs] == [10, 90, 90]
    assert docs[0]["gpus"][0]["processes"] == [{"pid": 4242, "used_memory_mib": 3072, "name": None}]
    # NVML once per refresh, torch once in all
    assert refreshes.fake.calls["nvmlInit"] == 3 and refreshes.probes == [True]
    assert refreshes.fake.balanced


def test_the_table_is_redrawn_in_place_on_a_terminal(refreshes):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=220, color_system=None)
    assert listing.watch(2.0, as_json=False, console=console) == 0
    text = out.getvalue()
    assert "\x1b[2K" in text and "\x1b[1A" in text  # Rich Live erases and rewrites its lines
    assert text.count("every 2 s; Ctrl-C to quit") == 4  # 3 refreshes; the last stays at exit
    assert "│ cuda:0 │ 0" in text and "4242 (3072 MiB)" in text
    assert "10%" in text and "90%" in text
    assert refreshes.fake.calls["nvmlInit"] == 3 and refreshes.probes == [True]


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf", "0.05"])
def test_bad_seconds_is_one_argparse_line(value, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--watch", value])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"python -m runkit.devices: error: argument --watch: SECONDS={value!r} is invalid; "
        "expected a number of seconds >= 0.1"
    )


def _read_until(fd: int, done, timeout: float) -> bytes:
    """Read from ``fd`` until ``done(data)`` or ``timeout`` seconds pass."""
    data = b""
    deadline = time.monotonic() + timeout
    while not done(data) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty reports EIO once the child has gone
                break
            if not chunk:
                break
            data += chunk
    return data


def _ctrl_c_as_in_a_terminal() -> None:
    """In the child: Ctrl-C's default action, whatever this suite inherited. A suite started in
    the background (``nohup ... &``) ignores SIGINT, and so would every child it starts."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_json_watch_in_a_subprocess_until_sigint():
    proc = subprocess.Popen(
        [sys.executable, "-m", "runkit.devices", "--json", "--watch", "0.2"],
        env=fake_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )
    data = _read_until(proc.stdout.fileno(), lambda d: d.count(b"\n") >= 3, timeout=180)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    lines = (data + rest).decode().splitlines()
    assert len(lines) >= 2
    for line in lines:
        doc = json.loads(line)
        assert set(doc) == JSON_KEYS | {"time"} and doc["schema_version"] == 1
        assert [g["uuid"] for g in doc["gpus"]][:1] == ["GPU-aaaa1111-1111-1111-1111-111111111111"]
    assert b"Traceback" not in err


@pytest.mark.slow
def test_live_table_under_a_pseudo_terminal_until_sigint():
    controller, terminal = pty.openpty()
    env = fake_env(COLUMNS="200", LINES="50", TERM="xterm-256color")
    proc = subprocess.Popen(
        [sys.executable, "-m", "runkit.devices", "--watch", "0.2"],
        env=env,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        close_fds=True,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )
    os.close(terminal)
    try:
        data = _read_until(controller, lambda d: d.count(b"Ctrl-C to quit") >= 3, timeout=180)
        proc.send_signal(signal.SIGINT)
        data += _read_until(controller, lambda d: False, timeout=5)
        assert proc.wait(timeout=60) == 0
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
    text = data.decode(errors="replace")
    assert text.count("Ctrl-C to quit") >= 3 and "\x1b[" in text
    assert "cuda:0" in text and "777 (30720 MiB)" in text
    assert "Traceback" not in text
