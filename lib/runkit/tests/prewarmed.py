"""``python -m tinyapp.<entry> ...`` as a ``fork`` of a server that imported torch, Lightning and
the library once: still its own process (pid, exit status, signals), but it may hold modules the
entry never imports. ``RUNKIT_TEST_FRESH=1`` runs every command fresh.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

# Imported by the server before it forks: what `python -m tinyapp.train` imports anyway.
WARM = ("torch", "lightning.pytorch", "torchmetrics", "hydra", "hydra.core.hydra_config",
        "omegaconf", "rich.console", "matplotlib.pyplot", "runkit.run.builders",
        "runkit.run.preflight", "runkit.run.launch", "runkit.run.run_files",
        "runkit.safety.checkpoints", "runkit.safety.interrupts", "runkit.safety.signals",
        "runkit.gpu_stats.callback", "runkit.gpus.resolve", "runkit.gpus.claims", "runkit.plots",
        "runkit.speed", "tinyapp.models", "tinyapp.data")  # fmt: skip


def _serve() -> None:
    """Import, then fork one child per request line; reply its pid, then its exit status."""
    import gc
    import importlib

    os.environ.setdefault("MPLBACKEND", "Agg")
    for name in WARM:
        with contextlib.suppress(ImportError):  # an optional extra that is not installed
            importlib.import_module(name)
    gc.freeze()  # children would otherwise copy every page the collector walks
    for line in iter(sys.stdin.buffer.readline, b""):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(json.loads(line))  # raises SystemExit, which ends this process as `python -m`
        _reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _reply({"returncode": os.waitstatus_to_exitcode(status)})


def _reply(message: dict[str, int]) -> None:
    sys.stdout.buffer.write(json.dumps(message).encode() + b"\n")
    sys.stdout.buffer.flush()


def _child(request: dict[str, Any]) -> None:
    import random
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    streams = [(os.devnull, os.O_RDONLY), (request["stdout"], os.O_WRONLY)]
    for fd, (path, flags) in enumerate([*streams, (request["stderr"], os.O_WRONLY)]):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    random.seed()  # a fresh interpreter seeds from the OS; forks would all share the server's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.path[0] = os.getcwd()
    sys.argv = [request["module"], *request["args"]]  # runpy puts the module's file first
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


_LOCK, _SERVER = threading.Lock(), {"process": None, "pending": b""}  # one per test process


def _server_env() -> dict[str, str]:
    from conftest import clean_env

    return clean_env()


def _read_reply(timeout: float | None) -> dict[str, int]:
    # Read the pipe directly: a buffered readline could swallow the pid and the exit status
    # of a fast child in one go, and select() would then wait for a line already read.
    server = _SERVER["process"]
    while b"\n" not in _SERVER["pending"]:
        if not select.select([server.stdout], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("prewarmed", timeout or 0)
        if not (chunk := os.read(server.stdout.fileno(), 4096)):
            raise RuntimeError("the prewarmed server died; run with RUNKIT_TEST_FRESH=1 to compare")
        _SERVER["pending"] += chunk
    line, _, _SERVER["pending"] = _SERVER["pending"].partition(b"\n")
    return json.loads(line)


def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`subprocess.run`; ``[sys.executable, "-m", "tinyapp.x", ...]`` on a prewarmed fork."""
    env = dict(kwargs["env"]) if kwargs.get("env") is not None else dict(os.environ)
    flags = {k: v for k, v in env.items() if k.startswith("PYTHON")}  # they act at start-up
    if not (
        len(command) >= 3
        and command[0] == sys.executable
        and command[1] == "-m"
        and str(command[2]).startswith(("tinyapp.", "project.", "runkit.", "conformance."))
        and os.environ.get("RUNKIT_TEST_FRESH") != "1"
        and set(kwargs) <= {"cwd", "env", "capture_output", "text", "timeout", "check"}
        and kwargs.get("capture_output")
        and flags == {k: v for k, v in _server_env().items() if k.startswith("PYTHON")}
    ):
        return subprocess.run(command, **kwargs)
    request = {"module": str(command[2]), "args": [str(a) for a in command[3:]], "env": env,
               "cwd": str(Path(kwargs.get("cwd") or os.getcwd()).resolve())}  # fmt: skip
    with _LOCK, tempfile.TemporaryDirectory(prefix="prewarmed") as tmp:
        request.update(stdout=str(Path(tmp, "stdout")), stderr=str(Path(tmp, "stderr")))
        for name in ("stdout", "stderr"):
            Path(request[name]).touch()
        server = _SERVER["process"]
        if server is None or server.poll() is not None:
            server = _SERVER["process"] = subprocess.Popen(
                [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, cwd=Path(__file__).parent, env=_server_env(),
            )  # fmt: skip
            atexit.register(server.kill)
            _SERVER["pending"] = b""
        server.stdin.write(json.dumps(request).encode() + b"\n")
        server.stdin.flush()
        pid = _read_reply(None)["pid"]
        try:
            returncode = _read_reply(kwargs.get("timeout"))["returncode"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            _read_reply(None)
            returncode = None
        out, err = Path(request["stdout"]).read_bytes(), Path(request["stderr"]).read_bytes()
    if returncode is None:
        raise subprocess.TimeoutExpired(command, kwargs["timeout"], out, err)
    if kwargs.get("text"):
        out, err = out.decode(errors="replace"), err.decode(errors="replace")
    done = subprocess.CompletedProcess(command, returncode, out, err)
    if kwargs.get("check"):
        done.check_returncode()
    return done


if __name__ == "__main__":
    _serve()
