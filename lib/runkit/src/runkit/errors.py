"""Failures a user can act on: one line and a non-zero exit; anything else keeps its traceback."""

from __future__ import annotations

import errno
import os
import sys
from typing import NoReturn

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# What the run's own directory answers once it is deleted, moved or made unwritable under the run.
_TAKEN_AWAY = (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS)


class RunError(Exception):
    """A bad value from the user: the message names it and says what would be accepted."""

    exit_code = 2


class EnvironmentFailure(RunError):
    """The machine failed the run, not the user (a full disk, the run's directory gone)."""

    exit_code = 4


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message, or its type's name when it has none."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def file_failure(err: OSError, run_dir: str | os.PathLike[str] | None = None) -> RunError | None:
    """``err`` as one line: the environment's (a full disk, a file in ``run_dir``), else the
    user's; ``None`` for no file and a disk not full."""
    name, reason = err.filename or run_dir, err.strerror or str(err)
    if err.errno in DISK_FULL:
        return EnvironmentFailure(
            f"the disk is full: could not write the run's files in {str(name)!r} ({reason})"
        )
    if err.filename is None:
        return None
    inside = run_dir is not None and os.path.abspath(name).startswith(
        os.path.join(os.path.abspath(run_dir), "")
    )
    if inside and err.errno in _TAKEN_AWAY:
        return EnvironmentFailure(
            f"could not write {str(name)!r} ({reason}): the run directory {str(run_dir)!r} was "
            "deleted, moved or made unwritable while the run used it"
        )
    return RunError(f"cannot create or write {str(name)!r}: {reason}")


def exit_with(err: RunError, prefix: str = "") -> NoReturn:
    """The one way a mistake ends the process: ``error: <line>`` on stderr, its exit code."""
    print(f"error: {prefix}{err}", file=sys.stderr)
    raise SystemExit(err.exit_code) from err
