"""``select_gpus=least_used``: measure GPUs over a window, wait for and claim them with a ``flock``
on ``<lock dir>/<UUID>.lock`` held for the run, since a choice from one reading lets two launches
take the same GPU (lock files are never deleted: that would race with the next holder). nvitop's
``select_devices`` neither waits nor claims."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import stat
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runkit.gpus import nvml
from runkit.gpus.inventory import DeviceError, Gpu, Inventory, forget_readings
from runkit.gpus.reader import DeviceReader

log = logging.getLogger(__name__)
STATUS_EVERY_S, POLL_S, SAMPLE_EVERY_S = 60.0, 2.0, 0.2  # waiting: log, pause; window: spacing
_held: dict[str, int] = {}  # claimed GPU UUID -> the descriptor holding its lock


@dataclass(frozen=True)
class SelectionPolicy:
    """The ``gpu_*`` keys: the defaults ask nothing but that no other run claimed a GPU."""

    min_free_gib: float = 0.0
    max_util_percent: float = 100.0
    wait_s: float = 0.0
    util_window_s: float = 1.0
    lock_dir: str | None = None


_KEYS = {
    "gpu_min_free_gib": ("min_free_gib", 0.0, math.inf, "a number of GiB >= 0"),
    "gpu_max_util": ("max_util_percent", 0.0, 100.0, "a percentage from 0 to 100"),
    "gpu_wait_s": ("wait_s", 0.0, math.inf, "a number of seconds >= 0"),
    "gpu_util_window_s": ("util_window_s", 1e-9, 60.0, "a number of seconds > 0 and <= 60"),
}


def policy_from_config(cfg: Mapping[str, Any]) -> SelectionPolicy:
    values: dict[str, Any] = {}
    for key, (field, low, high, accepted) in _KEYS.items():
        if (value := cfg.get(key)) is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and low <= value <= high):
            raise DeviceError(f"{key}={value!r} is invalid; expected {accepted}")
        values[field] = float(value)
    lock_dir = cfg.get("gpu_lock_dir")
    if lock_dir is not None and (
        not isinstance(lock_dir, str) or not lock_dir.strip() or "\0" in lock_dir
    ):
        raise DeviceError(
            f"gpu_lock_dir={lock_dir!r} is invalid; expected a directory path or null "
            "(a directory per user)"
        )
    return SelectionPolicy(**values, lock_dir=lock_dir)


@dataclass(frozen=True)
class Load:
    """The lowest free memory and mean utilisation over a window, or why NVML could not say."""

    free_mib: int | None = None
    util_percent: float | None = None
    error: str | None = None


def _reader(lib: Any, uuid: str) -> DeviceReader | str:
    try:
        found = nvml.find_handle(lib, uuid)
        return DeviceReader.open(lib, found[0]) if found else "NVML knows no such GPU"
    except lib.NVMLError as err:
        return str(err)


def measure_loads(gpus: Sequence[Gpu], window_s: float) -> list[Load]:
    """One :class:`Load` per GPU, read over ``window_s`` in one NVML session."""
    samples = max(2, round(window_s / SAMPLE_EVERY_S) + 1)
    with nvml.nvml_session() as lib:
        unsupported = nvml.error_classes(lib, nvml.UNSUPPORTED_ERRORS)
        readers = [_reader(lib, gpu.uuid) for gpu in gpus]
        seen: list[tuple[list[int], list[int]]] = [([], []) for _ in gpus]  # free, utilisation
        errors = [f"memory unreadable ({r})" if isinstance(r, str) else None for r in readers]
        for k in range(samples):
            if k:
                time.sleep(window_s / (samples - 1))
            for i, reader in enumerate(readers):
                queries = () if isinstance(reader, str) else (reader.memory, reader.utilization)
                for kind, query, got in zip(
                    ("memory", "utilization"), queries, seen[i], strict=False
                ):
                    try:
                        if not errors[i]:  # free memory, GPU utilisation
                            got.append(query()[2 if kind == "memory" else 0])
                    except unsupported:
                        pass
                    except lib.NVMLError as err:
                        errors[i] = f"{kind} unreadable ({err})"
    return [
        Load(error=error) if error else
        Load(min(free) // 2**20 if free else None, sum(util) / len(util) if util else None)
        for (free, util), error in zip(seen, errors, strict=True)
    ]  # fmt: skip


def rank_by_load(loads: Sequence[Load]) -> list[int]:
    """Positions in ``loads``, best first: most free memory, lowest utilisation (whole percent),
    lowest index; unknown after known (nvitop ranks a failed reading first)."""

    def key(i: int) -> tuple[bool, int, bool, int, int]:
        free, util = loads[i].free_mib, loads[i].util_percent
        return (free is None, -(free or 0), util is None, round(util or 0), i)

    return sorted(range(len(loads)), key=key)


def judge(load: Load, policy: SelectionPolicy) -> str | None:
    if load.error:
        return load.error
    free, util = load.free_mib, load.util_percent
    if policy.min_free_gib > 0 and free is None:
        return "free memory not reported, so gpu_min_free_gib cannot be checked"
    if free is not None and free < policy.min_free_gib * 1024:
        return f"{free / 1024:.1f} GiB free < gpu_min_free_gib={policy.min_free_gib:g}"
    if util is not None and util > policy.max_util_percent:
        return (
            f"utilization {util:.0f}% (mean over {policy.util_window_s:g} s) "
            f"> gpu_max_util={policy.max_util_percent:g}"
        )
    return None


def lock_dir_for(policy: SelectionPolicy) -> Path:
    given, runtime = policy.lock_dir is not None, os.environ.get("XDG_RUNTIME_DIR")
    if policy.lock_dir is not None:
        path = Path(os.path.expanduser(policy.lock_dir))
    elif runtime and os.path.isdir(runtime):
        path = Path(runtime) / "runkit-gpu-locks"
    else:
        path = Path(tempfile.gettempdir()) / f"runkit-gpu-locks-{os.getuid()}"
    what = f"gpu_lock_dir={policy.lock_dir!r}" if given else f"the GPU lock directory {str(path)!r}"
    try:
        path.mkdir(mode=0o777 if given else 0o700, parents=given, exist_ok=True)
        info = path.lstat()
    except OSError as err:
        fix = "give a writable directory or null" if given else "set gpu_lock_dir"
        raise DeviceError(f"{what} cannot be created ({err.strerror}); {fix}") from err
    if not given and (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()):
        raise DeviceError(f"{what} is not a directory of this user; set gpu_lock_dir")
    return path


def lock_path(lock_dir: Path, uuid: str) -> Path:
    return lock_dir / f"{re.sub(r'[^A-Za-z0-9_-]', '_', uuid)}.lock"


def try_lock(path: Path) -> int | str:
    """The descriptor holding ``path`` locked, or why not: no symlink followed, no FIFO waited on,
    only a regular file locked; the holder writes its pid for the others."""
    import fcntl  # POSIX only: imported where used, so importing this module works anywhere

    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags | os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:  # another user's lock file: a read-only descriptor locks too
            fd = os.open(path, flags | os.O_RDONLY)
    except OSError as err:
        return f"its lock file {str(path)!r} cannot be opened ({err.strerror})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            why = f"its lock file {str(path)!r} is not a regular file"
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with contextlib.suppress(OSError):  # read-only: the lock holds, the note is missing
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
    except BlockingIOError:
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace")
        except OSError:
            text = ""
        match = re.fullmatch(r"\s*(\d{1,10})\s*", text)
        why = f"claimed by another run{f' (pid {match.group(1)})' if match else ''}"
    except OSError as err:
        why = f"its lock file {str(path)!r} cannot be locked ({err.strerror})"
    os.close(fd)
    return why


def release_claims() -> None:
    while _held:
        with contextlib.suppress(OSError):
            os.close(_held.popitem()[1])


def claimed_uuids() -> tuple[str, ...]:
    return tuple(_held)


def finish_job() -> None:
    """After each job: give back its GPUs and forget its NVML reading (a sweep's next job claims anew)."""
    release_claims()
    forget_readings()


def _attempt(
    candidates: Sequence[Gpu], count: int, policy: SelectionPolicy, lock_dir: Path
) -> tuple[list[int] | None, list[str | None]]:
    try:
        loads = measure_loads(candidates, policy.util_window_s)
    except nvml.NvmlUnavailable as err:
        loads = [Load(error=f"memory unreadable ({err})")] * len(candidates)
    reasons: list[str | None] = [judge(load, policy) for load in loads]
    got: dict[int, int] = {}
    for i in rank_by_load(loads):
        if reasons[i] is None and len(got) < count:
            outcome = try_lock(lock_path(lock_dir, candidates[i].uuid))
            if isinstance(outcome, str):
                reasons[i] = outcome
            else:
                got[i] = outcome
    if len(got) < count:
        for fd in got.values():
            os.close(fd)
        return None, reasons
    _held.update({candidates[i].uuid: fd for i, fd in got.items()})
    return sorted(got), reasons


def wait_and_claim(inv: Inventory, count: int, policy: SelectionPolicy) -> tuple[list[int], str]:
    """The sorted ``cuda:N`` of ``count`` GPUs claimed under ``policy`` and a message; without NVML
    the first ``count`` unclaimed, unless thresholds or a wait need readings."""
    candidates = list(inv.visible[: inv.usable_gpu_count])
    if not inv.nvml_available or not all(g.uuid for g in candidates):
        why = inv.nvml_reason or "NVML gave no UUIDs"
        if policy.min_free_gib > 0 or policy.max_util_percent < 100 or policy.wait_s > 0:
            raise DeviceError(
                f"select_gpus=least_used with gpu_min_free_gib/gpu_max_util/gpu_wait_s needs "
                f"NVML readings, but there are none ({why}); use select_gpus=first"
            )
        chosen = list(range(count))
        return (
            chosen,
            f"select_gpus=least_used: no GPU load readings ({why}); using the first {count}: {chosen}",
        )
    lock_dir = lock_dir_for(policy)
    started = next_status = time.monotonic()
    while True:
        chosen, reasons = _attempt(candidates, count, policy, lock_dir)
        now = time.monotonic()
        standing = "; ".join(
            f"cuda:{i} {'qualifies' if why is None else why}" for i, why in enumerate(reasons)
        )
        if chosen is not None:
            waited = f", after waiting {now - started:.0f} s" if now - started >= POLL_S else ""
            return chosen, (
                f"select_gpus=least_used picked {', '.join(f'cuda:{i}' for i in chosen)} of "
                f"{len(candidates)} (most free memory, then lowest utilisation{waited}); "
                f"claimed until the run ends (locks in {lock_dir})"
            )
        if now >= started + policy.wait_s:
            waited = f"after waiting {policy.wait_s:g} s" if policy.wait_s else "with gpu_wait_s=0"
            raise DeviceError(
                f"select_gpus=least_used found {reasons.count(None)} of the {count} GPU(s) "
                f"wanted {waited}: {standing}"
            )
        if now >= next_status:
            left = started + policy.wait_s - now
            log.info(
                f"Waiting for {count} GPU(s) (select_gpus=least_used, {left:.0f} s left): {standing}"
            )
            next_status = now + STATUS_EVERY_S
        time.sleep(max(0.0, min(POLL_S, started + policy.wait_s - now)))
