"""``python -m tinyapp.<entry> ...`` (or ``-m pytest``, ``-c <code>``) as a ``fork`` of a server
that imported torch, Lightning and the library once: still its own process (pid, exit status,
signals), but it may hold modules the entry never imports. ``RUNKIT_TEST_FRESH=1`` runs every
command fresh.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
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
    import types

    if request.get("session"):
        os.setsid()  # as start_new_session=True: killpg reaches it and the ranks it starts
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
    if request["env"].get("OMP_NUM_THREADS", "").isdigit():  # read once, when torch loaded
        sys.modules["torch"].set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    if request["module"] == "-c":  # as ``python -c``: '' first on sys.path, argv[0] '-c'
        sys.path[0], sys.argv = "", ["-c", *request["args"][1:]]
        sys.modules["__main__"] = main = types.ModuleType("__main__")
        exec(compile(request["args"][0], "<string>", "exec"), main.__dict__)
        raise SystemExit(0)
    sys.path[0] = os.getcwd()
    sys.argv = [request["module"], *request["args"]]  # runpy puts the module's file first
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


_LOCK = threading.RLock()
_SERVER: dict[str, Any] = {"process": None, "pending": b"", "open": None}  # one per test process


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


def _request(command: list[str], kwargs: dict[str, Any], allowed: set[str]) -> dict | None:
    """What the server needs to run ``command`` as a fork, or None where it must run fresh."""
    env = dict(kwargs["env"]) if kwargs.get("env") is not None else dict(os.environ)
    flags = {k: v for k, v in env.items() if k.startswith("PYTHON")}  # they act at start-up
    entries = ("tinyapp.", "project.", "runkit.", "conformance.", "pytest", "torch.distributed.run")
    if not (
        len(command) >= 3
        and command[0] == sys.executable
        and (command[1] == "-c" or (command[1] == "-m" and str(command[2]).startswith(entries)))
        and os.environ.get("RUNKIT_TEST_FRESH") != "1"
        and set(kwargs) <= allowed
        and flags == {k: v for k, v in _server_env().items() if k.startswith("PYTHON")}
    ):
        return None
    module, args = (command[1], command[2:]) if command[1] == "-c" else (command[2], command[3:])
    return {"module": str(module), "args": [str(a) for a in args], "env": env,
            "cwd": str(Path(kwargs.get("cwd") or os.getcwd()).resolve())}  # fmt: skip


def _start(request: dict[str, Any], folder: str) -> int | None:
    """Fork ``request`` (under ``_LOCK``); its pid, or None while a :class:`Popen` child runs."""
    if _SERVER["open"] is not None and _SERVER["open"].poll() is None:
        return None
    request.update(stdout=str(Path(folder, "stdout")), stderr=str(Path(folder, "stderr")))
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
    return _read_reply(None)["pid"]


def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """:func:`subprocess.run`; ``[sys.executable, "-m", "tinyapp.x", ...]`` on a prewarmed fork."""
    allowed = {"cwd", "env", "capture_output", "text", "timeout", "check"}
    request = _request(command, kwargs, allowed) if kwargs.get("capture_output") else None
    with _LOCK, tempfile.TemporaryDirectory(prefix="prewarmed") as tmp:
        pid = None if request is None else _start(request, tmp)
        if pid is not None:
            try:
                returncode = _read_reply(kwargs.get("timeout"))["returncode"]
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
                _read_reply(None)
                returncode = None
            out, err = Path(tmp, "stdout").read_bytes(), Path(tmp, "stderr").read_bytes()
    if pid is None:
        return subprocess.run(command, **kwargs)
    if returncode is None:
        raise subprocess.TimeoutExpired(command, kwargs["timeout"], out, err)
    if kwargs.get("text"):
        out, err = out.decode(errors="replace"), err.decode(errors="replace")
    done = subprocess.CompletedProcess(command, returncode, out, err)
    if kwargs.get("check"):
        done.check_returncode()
    return done


class Popen:
    """:class:`subprocess.Popen` with ``stdout``/``stderr=PIPE``, ``text=True`` and
    ``start_new_session=True`` (a process group of its own, for ``killpg``), on a prewarmed fork
    where :func:`run` would fork; else a fresh ``subprocess.Popen``. Read it with ``communicate``."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.args, self._code, self._tmp = command, None, tempfile.mkdtemp(prefix="prewarmed")
        request = _request(command, {"cwd": cwd, "env": env}, {"cwd", "env"})
        with _LOCK:
            pid = None if request is None else _start({**request, "session": True}, self._tmp)
            if pid is not None:
                _SERVER["open"] = self
        if pid is None:
            self._fresh: subprocess.Popen | None = subprocess.Popen(
                command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, start_new_session=True,
            )  # fmt: skip
            self.pid, self.stderr = self._fresh.pid, self._fresh.stderr
        else:
            self._fresh, self.pid = None, pid
            self.stderr = SimpleNamespace(read=Path(self._tmp, "stderr").read_text)

    @property
    def returncode(self) -> int | None:
        return self._code if self._fresh is None else self._fresh.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        if self._fresh is not None:
            return self._fresh.wait(timeout)
        if self._code is None:
            with _LOCK:
                try:
                    self._code = _read_reply(timeout)["returncode"]
                except subprocess.TimeoutExpired:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
                _SERVER["open"] = None
        return self._code

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self._fresh is not None:
            return self._fresh.communicate(timeout=timeout)
        self.wait(timeout)
        out, err = (Path(self._tmp, name).read_bytes() for name in ("stdout", "stderr"))
        shutil.rmtree(self._tmp, ignore_errors=True)
        return out.decode(errors="replace"), err.decode(errors="replace")


if __name__ == "__main__":
    _serve()
