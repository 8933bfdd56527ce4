"""Crash-safe writes, torch-free (Hydra imports the sweep launcher, a writer, in every command):
a temporary beside the target, fsynced and renamed over it; a kill leaves the old or the new."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import socket
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from runkit.errors import DISK_FULL, EnvironmentFailure

# Temporaries ".<target>.<pid>-<host>-<random>.tmp": a dead writer's leftover is told from a live one.
_HOST = f"{zlib.crc32(socket.gethostname().encode()):08x}"
_TEMP = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)-(?P<host>[0-9a-f]{8})-[0-9a-f]{8}\.tmp")
_FOREIGN_TEMP_AGE_S = 24 * 3600


class FileWriteError(EnvironmentFailure):
    """A file of the run could not be written; nothing half-written. ``problem``: what failed."""

    def __init__(self, problem: str, outcome: str = "") -> None:
        super().__init__(f"{problem}; {outcome}" if outcome else problem)
        self.problem = problem


class _ErrorKeepingFile:
    """Keeps a write's ``OSError``: ``torch.save`` raises a ``RuntimeError``, chained or not."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle: IO[bytes] = handle
        self.error: OSError | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = err
            raise


def _temporary_name(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target.parent)
    return target.parent / f".{target.name}.{os.getpid()}-{_HOST}-{secrets.token_hex(4)}.tmp"


def new_staging_dir(target: Path) -> Path:
    (tmp := _temporary_name(target)).mkdir()
    return tmp


def atomic_write(path: str | Path, content: str | Callable[[IO[bytes]], None]) -> Path:
    """Write text, or what ``content(handle)`` writes, beside ``path``; fsync; rename over it."""
    target = Path(path)
    kept, handle, tmp = target.is_file(), None, None
    try:
        tmp = _temporary_name(target)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as raw:
            handle = _ErrorKeepingFile(raw)
            if isinstance(content, str):
                handle.write(content.encode())
            else:
                content(handle)  # type: ignore[arg-type]
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        cause = err if isinstance(err, OSError) else (handle.error if handle else None)
        if cause is None or not isinstance(err, Exception):
            raise
        raise FileWriteError(*write_failure(target, cause, kept)) from cause
    _fsync_dir(target.parent)
    return target


def write_failure(target: Path, err: OSError, kept: bool) -> tuple[str, str]:
    outcome = "its previous version is unchanged" if kept else "nothing was written"
    if err.errno in DISK_FULL:
        return f"the disk is full: could not write {str(target)!r} ({err.strerror})", outcome
    reason = err.strerror or str(err) or type(err).__name__
    return f"could not write {str(target)!r}: {reason}", outcome


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove temporaries whose writer died here, or another machine's a day old."""
    removed: list[Path] = []
    with contextlib.suppress(OSError):
        for entry in list(os.scandir(directory)):
            match = _TEMP.fullmatch(entry.name)
            if match is None or entry.is_symlink():
                continue
            with contextlib.suppress(OSError):
                if match["host"] == _HOST:
                    stale = int(match["pid"]) != os.getpid() and not _alive(int(match["pid"]))
                else:
                    stale = time.time() - entry.stat().st_mtime > _FOREIGN_TEMP_AGE_S
                if stale:
                    if entry.is_dir():  # not a link: links were passed over
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
                    removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:  # another user's process: PermissionError, its file is kept
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems do not open directories
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_link(source: str | Path, target: str | Path) -> None:
    """``target`` as a hard link (else a copy) of ``source``, atomically; a directory's files too."""
    source, target = Path(source), Path(target)
    if source.is_dir():
        staging = new_staging_dir(target)
        for file in sorted(p for p in source.iterdir() if p.is_file()):
            atomic_link(file, staging / file.name)
        return swap_in(staging, target)
    tmp = _temporary_name(target)
    try:
        os.link(source, tmp)
    except OSError:  # no hard links on this filesystem: copy the bytes
        with source.open("rb") as reader:
            atomic_write(target, lambda handle: shutil.copyfileobj(reader, handle))
        return None
    try:
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)  # a folder deleted meanwhile took it along
        raise FileWriteError(*write_failure(target, err, target.is_file())) from err
    _fsync_dir(target.parent)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``)."""
    try:
        renameat2 = ctypes.CDLL(None).renameat2
    except (OSError, AttributeError):
        return False
    return renameat2(-100, os.fsencode(first), -100, os.fsencode(second), 2) == 0


def swap_in(staging: Path, target: Path) -> None:
    """Make the directory ``staging`` the one at ``target``, atomically where Linux can."""
    _fsync_dir(staging)
    if target.is_file():
        target.unlink()
    if not target.exists():
        os.replace(staging, target)
    else:
        aside = staging
        if not _exchange(staging, target):
            aside = _temporary_name(target)  # a temporary like any other, if we die meanwhile
            os.replace(target, aside)
            os.replace(staging, target)
        shutil.rmtree(aside, ignore_errors=True)
    _fsync_dir(target.parent)
