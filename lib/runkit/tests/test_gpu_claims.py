"""select_gpus=least_used: thresholds, windowed utilisation, waiting, per-GPU lock claims."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import Mock

import pytest
from omegaconf import OmegaConf

from runkit.errors import RunError
from runkit.gpus import claims, nvml
from runkit.gpus.claims import Load, SelectionPolicy, judge, policy_from_config, rank_by_load
from runkit.gpus.inventory import TorchCuda, collect_inventory
from runkit.gpus.resolve import DeviceError
from runkit.run.preflight import check_devices
from runkit.testing.fake_nvml import GIB, FakeClock, FakeGpu, FakeNvml, nvml_error

UUIDS = [f"GPU-{i}{i}{i}{i}0000-1111-2222-3333-44445555666{i}" for i in range(3)]
MIG = "MIG-99990000-1111-2222-3333-444455556666"
START = 1000.0  # so that a start time added instead of subtracted shows


@pytest.fixture(autouse=True)
def nothing_left_behind():
    claims.finish_job()
    yield
    claims.finish_job()
    nvml.use_library(None)


@pytest.fixture
def clock(monkeypatch):
    """The time :mod:`claims` sees; ``clock.wakeups`` run after each sleep (another run ending)."""
    clock = FakeClock(START)
    clock.wakeups, clock.sleeps = [], 0

    def sleep(seconds: float) -> None:
        clock.sleeps += 1
        if clock.sleeps > 10_000:
            raise AssertionError(f"still sleeping at t={clock.now}: the wait never ends")
        clock.advance(seconds)
        for hook in list(clock.wakeups):
            hook(clock.now)

    monkeypatch.setattr(claims, "time", SimpleNamespace(monotonic=clock, sleep=sleep))
    return clock


def machine(clock, *gpus: FakeGpu, cls=FakeNvml) -> FakeNvml:
    for gpu, uuid in zip(gpus, UUIDS, strict=False):
        gpu.uuid = gpu.uuid or uuid
    fake = cls(list(gpus), clock=clock)
    nvml.use_library(fake)
    return fake


def inventory(n: int):
    return collect_inventory(torch_info=TorchCuda(True, n), env={})


@pytest.fixture
def locks(tmp_path) -> Path:
    """A lock directory whose path has a space and a non-ASCII letter."""
    path = tmp_path / "locks é"
    path.mkdir()
    return path


def refused(call, *args) -> str:
    with pytest.raises(DeviceError) as info:
        call(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def other_run_holds(locks: Path, uuid: str) -> int:
    fd = claims.try_lock(claims.lock_path(locks, uuid))
    assert isinstance(fd, int)
    return fd


# ------------------------------------------------------------------------- the gpu_* keys
@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({}, SelectionPolicy()),
        ({"gpu_min_free_gib": 20, "gpu_max_util": 30, "gpu_wait_s": 600, "gpu_lock_dir": "/x y"},
         SelectionPolicy(20, 30, 600, lock_dir="/x y")),
        *[({key: value}, message) for key, value, message in [
            ("gpu_wait_s", -1, "gpu_wait_s=-1 is invalid; expected a number of seconds >= 0"),
            ("gpu_max_util", 150, "gpu_max_util=150 is invalid; expected a percentage from 0 to 100"),
            ("gpu_min_free_gib", "lots", "gpu_min_free_gib='lots' is invalid; expected a number of GiB >= 0"),
            ("gpu_min_free_gib", True, "gpu_min_free_gib=True is invalid"),
            ("gpu_wait_s", float("nan"), "gpu_wait_s=nan is invalid"),
            ("gpu_wait_s", float("inf"), "gpu_wait_s=inf is invalid"),
            ("gpu_util_window_s", 0, "gpu_util_window_s=0 is invalid; expected a number of seconds > 0 and <= 60"),
            ("gpu_lock_dir", "", "gpu_lock_dir='' is invalid; expected a directory path or null"),
            ("gpu_lock_dir", "runs\0x", "gpu_lock_dir='runs\\x00x' is invalid; expected a directory path or null (a directory per user)"),
        ]],
    ],
)  # fmt: skip
def test_the_gpu_keys_make_the_policy_and_a_bad_one_is_one_line_naming_it(keys, expected):
    if isinstance(expected, SelectionPolicy):
        assert policy_from_config(keys) == expected
        return
    cfg = OmegaConf.create({**keys, "trainer": {"accelerator": "cpu", "devices": 1}})
    for check, given in ((policy_from_config, keys), (check_devices, cfg)):  # preflight too
        with pytest.raises(RunError) as info:
            check(given)
        assert str(info.value).startswith(expected) and "\n" not in str(info.value)


# ------------------------------------------------------------------------- measuring
class BoardlessNvml(FakeNvml):  # a driver that cannot give a MIG slice's GPU
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle):
        raise nvml_error("unknown")


GONE = "NVML knows no such GPU"


@pytest.mark.parametrize(
    ("gpu", "window", "load"),
    [
        # busy for the first half of the window, idle after: one instant would say 90 %
        (dict(util_gpu=[(START, 90), (START + 0.5, 10)], memory_used=[(START, 0), (START + 0.6, 50 * GIB)]),
         1.0, Load(free_mib=30 * 1024, util_percent=50)),
        # busy at the first reading only: the mean shows how many readings the window took
        (dict(util_gpu=lambda t: 100 if t < START + 0.1 else 0), 1.0, Load(free_mib=80 * 1024, util_percent=100 / 6)),
        (dict(util_gpu=lambda t: 100 if t < START + 0.1 else 0), 0.2, Load(free_mib=80 * 1024, util_percent=50)),
        (dict(memory_used=10 * GIB + 1), 0.2, Load(free_mib=70 * 1024 - 1, util_percent=0)),  # whole MiB
        (dict(util_gpu=40, failures={"memory": {"error": "gpu_is_lost", "from": START + 0.5}}),
         1.0, Load(error="memory unreadable (GPU is lost)")),
        (dict(memory_used=30 * GIB, failures={"utilization": "unknown"}),
         0.2, Load(error="utilization unreadable (Unknown Error)")),
        (dict(name="A100", mig=[FakeGpu(uuid=MIG, memory_total=10 * GIB)]), 0.2,
         Load(free_mib=10 * 1024)),  # a MIG slice has no utilisation of its own: no error
    ],
)  # fmt: skip
def test_a_measurement_is_the_lowest_free_memory_and_the_mean_utilisation(clock, gpu, window, load):
    machine(clock, FakeGpu(**gpu))
    assert claims.measure_loads(inventory(1).visible, window_s=window) == [load]
    assert clock.now == pytest.approx(START + window)


def test_a_gpu_gone_or_unreadable_since_the_inventory_is_an_error_and_the_others_are_measured(
    clock,
):
    gone, stays = FakeGpu(), FakeGpu(memory_used=20 * GIB)
    machine(clock, gone, stays)
    gpus = inventory(2).visible
    nvml.use_library(FakeNvml([stays], clock=clock))  # the first GPU fell off the bus
    first, second = claims.measure_loads(gpus, window_s=0.2)
    assert first == Load(error=f"memory unreadable ({GONE})")
    assert second == Load(free_mib=60 * 1024, util_percent=0)
    machine(clock, FakeGpu(mig=[FakeGpu(uuid=MIG)]))
    gpus = inventory(1).visible
    nvml.use_library(BoardlessNvml([FakeGpu(uuid=UUIDS[0], mig=[FakeGpu(uuid=MIG)])], clock=clock))
    assert claims.measure_loads(gpus, 0.2) == [Load(error="memory unreadable (Unknown Error)")]


@pytest.mark.parametrize(
    ("load", "policy", "why"),
    [
        (Load(free_mib=20 * 1024, util_percent=30.0), SelectionPolicy(min_free_gib=20, max_util_percent=30), None),
        (Load(free_mib=20 * 1024 - 1, util_percent=30.0), SelectionPolicy(min_free_gib=20), "20.0 GiB free < gpu_min_free_gib=20"),
        (Load(free_mib=80 * 1024), SelectionPolicy(min_free_gib=81), "80.0 GiB free < gpu_min_free_gib=81"),
        (Load(free_mib=1, util_percent=50), SelectionPolicy(max_util_percent=40, util_window_s=1.0),
         "utilization 50% (mean over 1 s) > gpu_max_util=40"),
        (Load(free_mib=1, util_percent=50), SelectionPolicy(max_util_percent=60), None),
        (Load(free_mib=10 * 1024), SelectionPolicy(max_util_percent=10, min_free_gib=5), None),  # no util: no requirement
        (Load(), SelectionPolicy(min_free_gib=1), "free memory not reported, so gpu_min_free_gib cannot be checked"),
        (Load(), SelectionPolicy(), None),
        (Load(util_percent=1, error="memory unreadable (lost)"), SelectionPolicy(), "memory unreadable (lost)"),
    ],
)  # fmt: skip
def test_judge_says_why_a_gpu_does_not_qualify(load, policy, why):
    assert judge(load, policy) == why


def test_rank_by_load_free_memory_then_utilisation_then_index():
    loads = [(100, 50), (200, 90), (100, 10), (200, 90.4), (None, 0), (100, None), (0, 0)]
    assert rank_by_load([Load(f, u) for f, u in loads]) == [1, 3, 2, 0, 5, 6, 4]
    assert rank_by_load([Load(5, 1), Load(5, 0)]) == [1, 0]


# ------------------------------------------------------------------------- the lock directory
def test_the_lock_directory_is_the_given_one_or_the_users_own_and_a_bad_one_is_refused(
    tmp_path, monkeypatch
):
    temp_dir = tmp_path / "tmp é"  # the system temporary directory, and no usable XDG_RUNTIME_DIR
    temp_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_dir))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "no such dir"))
    monkeypatch.setenv("HOME", str(tmp_path))
    got = claims.lock_dir_for(SelectionPolicy(lock_dir="~/a b/é/locks"))  # parents created
    assert got == tmp_path / "a b" / "é" / "locks" and got.is_dir()
    got = claims.lock_dir_for(SelectionPolicy())
    assert got == temp_dir / f"runkit-gpu-locks-{os.getuid()}"
    assert got.stat().st_mode & 0o777 == 0o700
    got.rmdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert claims.lock_dir_for(SelectionPolicy()) == tmp_path / "runkit-gpu-locks"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "no such dir"))
    taken = temp_dir / "locks é"
    taken.write_text("mine")
    assert refused(claims.lock_dir_for, SelectionPolicy(lock_dir=str(taken))) == (
        f"gpu_lock_dir={str(taken)!r} cannot be created ({os.strerror(errno.EEXIST)}); "
        "give a writable directory or null"
    )
    assert taken.read_text() == "mine"
    path = temp_dir / f"runkit-gpu-locks-{os.getuid()}"
    (temp_dir / "elsewhere").mkdir()
    path.symlink_to(temp_dir / "elsewhere")
    message = "the GPU lock directory {!r} is not a directory of this user; set gpu_lock_dir"
    assert refused(claims.lock_dir_for, SelectionPolicy()) == message.format(str(path))
    other_uid = os.getuid() + 1  # another user's directory (the test may run as root)
    monkeypatch.setattr(os, "getuid", lambda: other_uid)
    path = temp_dir / f"runkit-gpu-locks-{other_uid}"
    assert refused(claims.lock_dir_for, SelectionPolicy()) == message.format(str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(taken))  # a file where the folder would go
    assert refused(claims.lock_dir_for, SelectionPolicy()) == (
        f"the GPU lock directory {str(taken / f'runkit-gpu-locks-{other_uid}')!r} cannot be "
        f"created ({os.strerror(errno.ENOTDIR)}); set gpu_lock_dir"
    )


# ------------------------------------------------------------------------- lock files
def test_a_lock_excludes_every_other_holder_until_closed_and_holds_only_its_pid(locks, monkeypatch):
    assert claims.lock_path(locks, "GPU-AbC-12_x") == locks / "GPU-AbC-12_x.lock"
    assert claims.lock_path(locks, "../../etc/passwd é") == locks / "______etc_passwd__.lock"
    path = claims.lock_path(locks, UUIDS[0])
    old_umask = os.umask(0)
    try:
        fd = claims.try_lock(path)
    finally:
        os.umask(old_umask)
    assert path.stat().st_mode & 0o777 == 0o644  # readable by all, for the others' messages
    assert claims.try_lock(path) == f"claimed by another run (pid {os.getpid()})"
    os.close(fd)
    path.write_bytes(b"999999999 left by an earlier holder, longer than a pid\n")
    fd = claims.try_lock(path)
    assert path.read_bytes() == f"{os.getpid()}\n".encode()
    os.close(fd)
    holder, held = other_run_holds(locks, UUIDS[1]), claims.lock_path(locks, UUIDS[1])
    for note, pid in [(b"\xff\x00 not a pid \n" * 10, ""), (b"123" + b" " * 29 + b"more", " (pid 123)")]:  # fmt: skip
        os.pwrite(holder, note, 0)  # whatever a held lock file holds, it is another run's
        assert claims.try_lock(held) == f"claimed by another run{pid}"
    monkeypatch.setattr(os, "pread", Mock(side_effect=OSError(errno.EIO, "unreadable")))
    assert claims.try_lock(held) == "claimed by another run"
    os.close(holder)
    monkeypatch.setattr(fcntl, "flock", Mock(side_effect=OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))))  # fmt: skip
    assert claims.try_lock(path) == (  # a filesystem without locks
        f"its lock file {str(path)!r} cannot be locked ({os.strerror(errno.ENOLCK)})"
    )


@pytest.fixture
def not_writable(locks, monkeypatch):
    """Writing in ``locks`` is refused, as for another user's lock file (the tests may run as root)."""
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if str(path).startswith(str(locks)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


def test_another_users_lock_file_is_locked_through_a_read_only_descriptor(locks, not_writable):
    path = claims.lock_path(locks, UUIDS[0])
    assert claims.try_lock(path) == (
        f"its lock file {str(path)!r} cannot be opened ({os.strerror(errno.ENOENT)})"
    )
    path.write_bytes(b"4242\n")  # the last holder's pid, written by its own user
    fd = claims.try_lock(path)
    assert isinstance(fd, int) and path.read_bytes() == b"4242\n"  # read-only: the note stays
    assert claims.try_lock(path) == "claimed by another run (pid 4242)"
    os.close(fd)


@pytest.mark.parametrize("writable", [True, False])
def test_hostile_lock_files_are_refused_not_followed(locks, tmp_path, request, writable):
    if not writable:
        request.getfixturevalue("not_writable")
    target = tmp_path / "victim"
    target.write_text("keep me")
    link, fifo, folder = locks / "GPU-a.lock", locks / "GPU-b.lock", locks / "GPU-c.lock"
    link.symlink_to(target)
    os.mkfifo(fifo)
    folder.mkdir()

    # a FIFO opened blocking would hang: pytest-timeout fails the test
    assert claims.try_lock(fifo) == f"its lock file {str(fifo)!r} is not a regular file"
    assert claims.try_lock(link) == (
        f"its lock file {str(link)!r} cannot be opened ({os.strerror(errno.ELOOP)})"
    )
    opened = claims.try_lock(folder)  # read-only, a directory opens, but is no regular file
    assert ("cannot be opened" if writable else "is not a regular file") in opened
    assert target.read_text() == "keep me"


# ------------------------------------------------------------------------- waiting and claiming
def test_the_best_qualified_gpus_are_claimed_and_the_line_names_them_and_the_lock_dir(clock, locks):
    machine(clock, FakeGpu(memory_used=5 * GIB), FakeGpu(), FakeGpu(memory_used=GIB))
    chosen, message = claims.wait_and_claim(inventory(3), 2, SelectionPolicy(lock_dir=str(locks)))
    assert chosen == [1, 2] and claims.claimed_uuids() == (UUIDS[1], UUIDS[2])
    assert message == (
        "select_gpus=least_used picked cuda:1, cuda:2 of 3 (most free memory, then lowest "
        f"utilisation); claimed until the run ends (locks in {locks})"
    )
    for fd in claims._held.values():  # closed behind the claim's back (a daemonising library)
        os.close(fd)
    claims.finish_job()  # given back quietly
    assert claims.claimed_uuids() == ()


@pytest.mark.parametrize(
    ("first", "second", "chosen"),
    [
        # at START the first GPU looks best; a second later, when the run measures, the second
        (dict(memory_used=[(START, 0), (START + 1, 60 * GIB)]), dict(memory_used=10 * GIB), 1),
        # equal memory: the lower utilisation over the window wins
        (dict(util_gpu=[(START, 0), (START + 1, 50)]), dict(util_gpu=[(START, 50), (START + 1, 10)]), 1),
        # a MIG slice without a utilisation reading can be claimed
        (dict(name="A100", mig=[FakeGpu(uuid=MIG, memory_total=10 * GIB)]), dict(memory_used=75 * GIB), 0),
    ],
)  # fmt: skip
def test_the_choice_follows_the_fresh_measurement_not_the_inventory(clock, locks, first, second, chosen):  # fmt: skip
    machine(clock, FakeGpu(**first), FakeGpu(**second))
    inv = inventory(2)
    clock.advance(1)
    assert claims.wait_and_claim(inv, 1, SelectionPolicy(lock_dir=str(locks)))[0] == [chosen]
    assert claims.claimed_uuids() == ((MIG,) if chosen == 0 else (UUIDS[1],))


HELD = "claimed by another run (pid {pid})"
NO_NVML = "memory unreadable (NVML is not available (Driver Not Loaded))"


@pytest.mark.parametrize(
    ("loads", "held", "policy", "wanted", "why", "after"),
    [
        # claimed GPUs are skipped and the time-out names every GPU; a released one is claimed
        ([dict(memory_used=10 * GIB), dict(memory_used=70 * GIB), dict(util_gpu=95)], 1,
         dict(min_free_gib=20, max_util_percent=50), 1,
         f"found 0 of the 1 GPU(s) wanted with gpu_wait_s=0: cuda:0 {HELD}; "
         "cuda:1 10.0 GiB free < gpu_min_free_gib=20; cuda:2 utilization 95% (mean over 1 s) > gpu_max_util=50",
         [0]),
        # too few: the one claimed is given back
        ([{}, {}, {}], 2, {}, 2,
         f"found 1 of the 2 GPU(s) wanted with gpu_wait_s=0: cuda:0 {HELD}; cuda:1 {HELD}; cuda:2 qualifies",
         [0, 1]),
        # NVML failing when measuring leaves no GPU qualified
        ([{}, {}], 0, None, 1,
         f"found 0 of the 1 GPU(s) wanted with gpu_wait_s=0: cuda:0 {NO_NVML}; cuda:1 {NO_NVML}", None),
    ],
)  # fmt: skip
def test_a_refusal_names_every_gpu_and_keeps_no_claim(clock, locks, loads, held, policy, wanted, why, after):  # fmt: skip
    machine(clock, *(FakeGpu(**load) for load in loads))
    inv = inventory(len(loads))
    fds = [other_run_holds(locks, u) for u in UUIDS[:held]]
    if policy is None:
        nvml.use_library(FakeNvml(2, init_error="driver_not_loaded"))
    chosen = SelectionPolicy(**(policy or {}), lock_dir=str(locks))
    assert refused(claims.wait_and_claim, inv, wanted, chosen) == (
        "select_gpus=least_used " + why.format(pid=os.getpid())
    )
    assert claims.claimed_uuids() == ()
    for fd in fds + [other_run_holds(locks, u) for u in UUIDS[held : len(loads)]]:  # all free
        os.close(fd)
    if after is not None:
        assert claims.wait_and_claim(inv, wanted, chosen)[0] == after
        assert claims.claimed_uuids() == tuple(UUIDS[i] for i in after)


def test_a_run_waits_logging_once_a_minute_until_another_run_lets_go(
    clock, locks, caplog, monkeypatch
):
    machine(clock, FakeGpu(), FakeGpu())
    held = [other_run_holds(locks, u) for u in UUIDS[:2]]

    def other_run_ends(now: float) -> None:
        if now >= START + 150 and len(held) == 2:
            os.close(held.pop())  # the second GPU is given back after 150 s

    clock.wakeups.append(other_run_ends)
    policy = SelectionPolicy(wait_s=600, util_window_s=0, lock_dir=str(locks))
    monkeypatch.setattr(claims.log, "disabled", False)  # whatever logging setup ran before
    monkeypatch.setattr(claims.log, "propagate", True)
    with caplog.at_level(logging.INFO, logger=claims.__name__):
        chosen, message = claims.wait_and_claim(inventory(2), 1, policy)
    assert chosen == [1] and START + 150 <= clock.now < START + 160
    why = "; ".join(f"cuda:{i} claimed by another run (pid {os.getpid()})" for i in range(2))
    assert [r.getMessage() for r in caplog.records if r.name == claims.__name__] == [
        f"Waiting for 1 GPU(s) (select_gpus=least_used, {left} s left): {why}"
        for left in (600, 540, 480)
    ]  # at 0, 60 and 120 s
    assert "(most free memory, then lowest utilisation, after waiting 15" in message
    os.close(held.pop())


@pytest.mark.parametrize(
    ("wait_s", "window", "let_go", "now", "sessions", "outcome"),
    [
        (60, 0, 2, 2, 2, "(most free memory, then lowest utilisation, after waiting 2 s); claimed"),
        # measurements end at 0.2, 2.4, 4.6 s, then the last pause is cut short to the deadline
        (5, 0.2, None, 5.2, 4, "found 0 of the 1 GPU(s) wanted after waiting 5 s: cuda:0 claimed by another run"),
        (4, 0, None, 4, 3, "after waiting 4 s"),  # a measurement at the deadline is the last
    ],
)  # fmt: skip
def test_a_wait_is_timed_from_its_start_to_its_deadline(
    clock, locks, wait_s, window, let_go, now, sessions, outcome
):
    fake = machine(clock, FakeGpu())
    held = [other_run_holds(locks, UUIDS[0])]
    clock.wakeups.append(lambda t: let_go and t >= START + let_go and held and os.close(held.pop()))
    inv = inventory(1)
    before = fake.init_count
    policy = SelectionPolicy(wait_s=wait_s, util_window_s=window, lock_dir=str(locks))
    try:
        got = claims.wait_and_claim(inv, 1, policy)[1]
    except DeviceError as err:
        got = str(err)
    assert outcome in got
    assert clock.now == pytest.approx(START + now) and fake.init_count - before == sessions
    for fd in held:
        os.close(fd)


def test_without_readings_thresholds_and_waits_are_refused_and_plain_least_used_takes_the_first(
    clock, locks
):
    nvml.use_library(FakeNvml([FakeGpu(uuid=""), FakeGpu()], clock=clock))
    assert claims.wait_and_claim(inventory(2), 1, SelectionPolicy(lock_dir=str(locks))) == (
        [0],
        "select_gpus=least_used: no GPU load readings (NVML gave no UUIDs); using the first 1: [0]",
    )
    assert claims.claimed_uuids() == ()
    nvml.use_library(FakeNvml(2, init_error="driver_not_loaded"))
    inv = inventory(2)
    assert claims.wait_and_claim(inv, 1, SelectionPolicy())[0] == [0]
    for policy in (SelectionPolicy(wait_s=0.5), SelectionPolicy(min_free_gib=1)):
        assert refused(claims.wait_and_claim, inv, 1, policy) == (
            "select_gpus=least_used with gpu_min_free_gib/gpu_max_util/gpu_wait_s needs NVML "
            "readings, but there are none (NVML is not available (Driver Not Loaded)); "
            "use select_gpus=first"
        )


# ------------------------------------------------------------------------- real launches
LAUNCH = textwrap.dedent(
    """
    import json, logging, os, sys, time
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from runkit.gpus import inventory
    from runkit.gpus.claims import SelectionPolicy
    from runkit.gpus.inventory import TorchCuda
    from runkit.gpus.resolve import resolve_for_run

    inventory.probe_torch = lambda uuids=True: TorchCuda(True, 2)  # torch has no CUDA here
    lock_dir, go = sys.argv[1:]
    Path(f"{go}.{os.getpid()}").touch()  # imported
    while not Path(go).exists():  # start every launch at the same moment
        time.sleep(0.01)
    policy = SelectionPolicy(wait_s=60, util_window_s=0.2, lock_dir=lock_dir)
    plan = resolve_for_run("gpu", 1, select="least_used", policy=policy, environ={})
    print(json.dumps({"gpus": plan.devices, "at": time.monotonic()}), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_three_launches_at_once_take_different_gpus_and_the_third_waits_until_one_dies(tmp_path):
    env = dict(os.environ, RUNKIT_NVML_BACKEND="runkit.testing.fake_nvml:create")
    env["RUNKIT_FAKE_NVML"] = json.dumps({"gpus": 2})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    args = [sys.executable, "-c", LAUNCH, str(tmp_path / "locks"), str(tmp_path / "go")]
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        while not all((tmp_path / f"go.{p.pid}").exists() for p in procs):  # all imported
            assert all(p.poll() is None for p in procs)
            time.sleep(0.01)
        (tmp_path / "go").touch()
        got: dict[subprocess.Popen[str], dict] = {}
        with selectors.DefaultSelector() as lines:
            for proc in procs:
                lines.register(proc.stdout, selectors.EVENT_READ, proc)
            while len(got) < 2:
                for key, _ in lines.select():
                    got[key.data] = json.loads(key.fileobj.readline())
                    lines.unregister(key.fileobj)
        first, second = got.values()
        assert sorted(first["gpus"] + second["gpus"]) == [0, 1]
        (waiter,) = [p for p in procs if p not in got]
        assert waiter.poll() is None  # still waiting
        killed, killed_at = next(iter(got)), time.monotonic()
        killed.send_signal(signal.SIGKILL)  # no clean-up at all: the kernel drops its locks
        waited = json.loads(waiter.stdout.readline())
        assert waited["gpus"] == first["gpus"] and waited["at"] > killed_at
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate(timeout=60)
