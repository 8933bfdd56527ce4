"""``select_gpus=least_used`` in detail: the edges of measuring, judging, locking, waiting and the
lines a user reads, each pinned by a test that a plausible bug in ``machinery/gpus/claims.py``
fails (issue #16: mutation testing).

Time is a :class:`FakeClock` starting at 1000 s (so that a start time added instead of subtracted
shows); ``sleep`` moves it, and a run that sleeps without end fails instead of hanging.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from runkit.gpus import claims, nvml
from runkit.gpus.claims import Load, SelectionPolicy, judge, policy_from_config
from runkit.gpus.inventory import collect_inventory
from runkit.gpus.records import DeviceError, TorchCuda
from runkit.testing.fake_nvml import (
    GIB,
    FakeClock,
    FakeGpu,
    FakeNvml,
    nvml_error,
)

UUIDS = [f"GPU-{i}{i}{i}{i}0000-1111-2222-3333-44445555666{i}" for i in range(3)]
START = 1000.0


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
    clock.wakeups = []
    clock.sleeps = 0

    def sleep(seconds: float) -> None:
        clock.sleeps += 1
        if clock.sleeps > 10_000:
            raise AssertionError(f"still sleeping at t={clock.now}: the wait never ends")
        clock.advance(seconds)
        for hook in list(clock.wakeups):
            hook(clock.now)

    monkeypatch.setattr(claims, "time", SimpleNamespace(monotonic=clock, sleep=sleep))
    return clock


def machine(clock, *gpus: FakeGpu) -> FakeNvml:
    for gpu, uuid in zip(gpus, UUIDS, strict=False):
        gpu.uuid = gpu.uuid or uuid
    fake = FakeNvml(list(gpus), clock=clock)
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


def other_run_holds(locks: Path, uuid: str) -> int:
    fd = claims.try_lock(claims.lock_path(locks, uuid))
    assert isinstance(fd, int)
    return fd


# ------------------------------------------------------------------------- the gpu_* keys


def test_a_lock_dir_with_a_nul_byte_is_refused_in_one_line():
    with pytest.raises(DeviceError) as info:
        policy_from_config({"gpu_lock_dir": "runs\0x"})
    assert str(info.value) == (
        "gpu_lock_dir='runs\\x00x' is invalid; expected a directory path or null "
        "(a directory per user)"
    )


# ------------------------------------------------------------------------- measuring


def test_the_window_sets_how_many_readings_are_averaged(clock):
    # Busy only at the first reading: the mean shows how many readings the window took.
    machine(clock, FakeGpu(util_gpu=lambda t: 100 if t < START + 0.1 else 0))
    gpus = inventory(1).visible
    (load,) = claims.measure_loads(gpus, window_s=1.0)  # readings at 0, 0.2, ... 1.0 s
    assert load.util_percent == pytest.approx(100 / 6)
    assert clock.now == pytest.approx(START + 1.0)
    clock.now = START
    (load,) = claims.measure_loads(gpus, window_s=0.2)  # the first and the last
    assert load.util_percent == pytest.approx(50)
    assert clock.now == pytest.approx(START + 0.2)


def test_free_memory_is_in_whole_mib_rounded_down(clock):
    machine(clock, FakeGpu(memory_used=10 * GIB + 1))
    (load,) = claims.measure_loads(inventory(1).visible, window_s=0.2)
    assert load.free_mib == 70 * 1024 - 1 and isinstance(load.free_mib, int)


def test_a_memory_reading_that_fails_within_the_window_gives_no_free_memory(clock):
    machine(clock, FakeGpu(util_gpu=40).fail("memory", "gpu_is_lost", start=START + 0.5))
    (load,) = claims.measure_loads(inventory(1).visible, window_s=1.0)
    assert load == Load(free_mib=None, util_percent=40, memory_error="GPU is lost")


def test_a_failing_utilisation_reading_is_an_error_not_a_missing_figure(clock):
    machine(clock, FakeGpu(memory_used=30 * GIB).fail("utilization", "unknown"))
    (load,) = claims.measure_loads(inventory(1).visible, window_s=0.2)
    assert load == Load(free_mib=50 * 1024, util_percent=None, util_error="Unknown Error")
    assert judge(load, SelectionPolicy()) == "utilization unreadable (Unknown Error)"


def test_a_gpu_gone_since_the_inventory_never_qualifies_and_the_others_are_measured(clock):
    gone, stays = FakeGpu(), FakeGpu(memory_used=20 * GIB)
    machine(clock, gone, stays)
    gpus = inventory(2).visible
    nvml.use_library(FakeNvml([stays], clock=clock))  # the first GPU fell off the bus
    first, second = claims.measure_loads(gpus, window_s=0.2)
    assert first == Load(memory_error="NVML knows no such GPU", util_error="NVML knows no such GPU")
    assert judge(first, SelectionPolicy()) == "memory unreadable (NVML knows no such GPU)"
    assert second == Load(free_mib=60 * 1024, util_percent=0)


class BoardlessNvml(FakeNvml):
    """A driver that cannot give a MIG slice's GPU."""

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle):
        raise nvml_error("unknown")


def test_a_gpu_whose_reader_cannot_open_never_qualifies(clock):
    mig = FakeGpu(uuid="MIG-99990000-1111-2222-3333-444455556666")
    machine(clock, FakeGpu(name="NVIDIA A100-SXM4-80GB", mig=[mig]))
    gpus = inventory(1).visible
    nvml.use_library(BoardlessNvml([FakeGpu(uuid=UUIDS[0], mig=[mig])], clock=clock))
    (load,) = claims.measure_loads(gpus, window_s=0.2)
    assert load == Load(memory_error="Unknown Error", util_error="Unknown Error")


# ------------------------------------------------------------------------- judging


def test_a_gpu_exactly_at_a_threshold_qualifies():
    policy = SelectionPolicy(min_free_gib=20, max_util_percent=30)
    assert judge(Load(free_mib=20 * 1024, util_percent=30.0), policy) is None
    assert judge(Load(free_mib=20 * 1024 - 1, util_percent=30.0), policy) == (
        "20.0 GiB free < gpu_min_free_gib=20"
    )
    assert judge(Load(free_mib=80 * 1024), SelectionPolicy(min_free_gib=81)) == (
        "80.0 GiB free < gpu_min_free_gib=81"
    )


# ------------------------------------------------------------------------- the lock directory


def test_a_given_lock_dir_is_created_with_its_parents_under_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    got = claims.lock_dir_for(SelectionPolicy(lock_dir="~/a b/é/locks"))
    assert got == tmp_path / "a b" / "é" / "locks" and got.is_dir()


def test_a_given_lock_dir_that_is_a_file_is_refused_and_kept(tmp_path):
    taken = tmp_path / "locks é"
    taken.write_text("mine")
    with pytest.raises(DeviceError) as info:
        claims.lock_dir_for(SelectionPolicy(lock_dir=str(taken)))
    assert str(info.value) == (
        f"gpu_lock_dir={str(taken)!r} cannot be created ({os.strerror(errno.EEXIST)}); "
        "give a writable directory or null"
    )
    assert taken.read_text() == "mine"


@pytest.fixture
def temp_dir(tmp_path, monkeypatch) -> Path:
    """The system temporary directory, here, and no usable ``$XDG_RUNTIME_DIR``."""
    path = tmp_path / "tmp é"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "no such dir"))
    return path


def test_without_a_runtime_dir_the_default_is_private_to_the_user_in_tmp(temp_dir):
    got = claims.lock_dir_for(SelectionPolicy())
    assert got == temp_dir / f"runkit-gpu-locks-{os.getuid()}"
    assert got.stat().st_mode & 0o777 == 0o700


def test_a_default_lock_dir_that_cannot_be_created_says_to_set_one(temp_dir, monkeypatch):
    blocker = temp_dir / "a file"
    blocker.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(blocker))
    with pytest.raises(DeviceError) as info:
        claims.lock_dir_for(SelectionPolicy())
    path = blocker / f"runkit-gpu-locks-{os.getuid()}"
    assert str(info.value) == (
        f"the GPU lock directory {str(path)!r} cannot be created "
        f"({os.strerror(errno.ENOTDIR)}); set gpu_lock_dir"
    )


def test_a_default_lock_dir_that_is_a_symlink_or_anothers_is_refused(temp_dir, monkeypatch):
    path = temp_dir / f"runkit-gpu-locks-{os.getuid()}"
    elsewhere = temp_dir / "elsewhere"
    elsewhere.mkdir()
    path.symlink_to(elsewhere)
    message = "the GPU lock directory {!r} is not a directory of this user; set gpu_lock_dir"
    with pytest.raises(DeviceError) as info:
        claims.lock_dir_for(SelectionPolicy())
    assert str(info.value) == message.format(str(path))
    # A directory of another user (faked by being another uid: the test may run as root).
    other_uid = os.getuid() + 1
    monkeypatch.setattr(os, "getuid", lambda: other_uid)
    with pytest.raises(DeviceError) as info:
        claims.lock_dir_for(SelectionPolicy())
    assert str(info.value) == message.format(str(temp_dir / f"runkit-gpu-locks-{other_uid}"))


# ------------------------------------------------------------------------- lock files


def test_a_lock_file_is_named_after_the_uuid_as_it_is(tmp_path):
    assert claims.lock_path(tmp_path, "GPU-AbC-12_x") == tmp_path / "GPU-AbC-12_x.lock"
    assert claims.lock_path(tmp_path, "MIG-1/2 é") == tmp_path / "MIG-1_2__.lock"


def test_a_lock_file_is_readable_by_all_and_holds_only_the_holders_pid(locks):
    path = claims.lock_path(locks, UUIDS[0])
    old_umask = os.umask(0)
    try:
        fd = claims.try_lock(path)
    finally:
        os.umask(old_umask)
    assert isinstance(fd, int)
    assert path.stat().st_mode & 0o777 == 0o644
    os.close(fd)
    path.write_bytes(b"999999999 left by an earlier holder, longer than a pid\n")
    fd = claims.try_lock(path)
    assert path.read_bytes() == f"{os.getpid()}\n".encode()
    os.close(fd)


@pytest.fixture
def not_writable(locks, monkeypatch):
    """Opening a file in ``locks`` for writing is refused, as for another user's lock file in a
    shared directory (simulated: the tests may run as root, whom nothing is refused)."""
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if str(path).startswith(str(locks)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


def test_another_users_lock_file_is_locked_through_a_read_only_descriptor(locks, not_writable):
    path = claims.lock_path(locks, UUIDS[0])
    path.write_bytes(b"4242\n")  # the last holder's pid, written by its own user
    fd = claims.try_lock(path)
    assert isinstance(fd, int)
    assert path.read_bytes() == b"4242\n"  # read-only: the note stays
    assert claims.try_lock(path) == "claimed by another run (pid 4242)"
    os.close(fd)


def test_the_read_only_way_refuses_symlinks_and_fifos_too(locks, not_writable, tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep me")
    link = locks / "GPU-a.lock"
    link.symlink_to(target)
    assert claims.try_lock(link) == (
        f"its lock file {str(link)!r} cannot be opened ({os.strerror(errno.ELOOP)})"
    )
    fifo = locks / "GPU-b.lock"
    os.mkfifo(fifo)

    def hung(signum, frame):
        raise TimeoutError("opening the FIFO blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        outcome = claims.try_lock(fifo)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert outcome == f"its lock file {str(fifo)!r} is not a regular file"
    assert target.read_text() == "keep me"


def test_a_missing_lock_file_in_a_read_only_directory_cannot_be_opened(locks, not_writable):
    path = claims.lock_path(locks, UUIDS[0])
    assert claims.try_lock(path) == (
        f"its lock file {str(path)!r} cannot be opened ({os.strerror(errno.ENOENT)})"
    )


def test_lock_files_that_are_not_regular_files_are_named_in_the_reason(locks):
    link = locks / "GPU-a.lock"
    link.symlink_to(locks / "anything")
    assert claims.try_lock(link) == (
        f"its lock file {str(link)!r} cannot be opened ({os.strerror(errno.ELOOP)})"
    )
    fifo = locks / "GPU-b.lock"
    os.mkfifo(fifo)
    assert claims.try_lock(fifo) == f"its lock file {str(fifo)!r} is not a regular file"


def test_a_filesystem_without_locks_is_named_in_the_reason(locks, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    path = claims.lock_path(locks, UUIDS[0])
    assert claims.try_lock(path) == (
        f"its lock file {str(path)!r} cannot be locked ({os.strerror(errno.ENOLCK)})"
    )


def test_the_holders_pid_is_read_from_the_first_32_bytes_only(locks):
    path = claims.lock_path(locks, UUIDS[0])
    fd = other_run_holds(locks, UUIDS[0])
    os.pwrite(fd, b"123" + b" " * 29 + b"and more after the note", 0)
    assert claims.try_lock(path) == "claimed by another run (pid 123)"
    os.close(fd)


def test_an_unreadable_lock_file_still_reads_as_another_run(locks, monkeypatch):
    fd = other_run_holds(locks, UUIDS[0])

    def pread(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "pread", pread)
    assert claims.try_lock(claims.lock_path(locks, UUIDS[0])) == "claimed by another run"
    os.close(fd)


def test_claims_whose_descriptors_were_closed_elsewhere_are_given_back_quietly(clock, locks):
    machine(clock, FakeGpu())
    claims.wait_and_claim(inventory(1), 1, SelectionPolicy(lock_dir=str(locks)))
    for fd in claims._held.values():  # closed behind the claim's back (a daemonising library)
        os.close(fd)
    claims.finish_job()
    assert claims.claimed_uuids() == ()


# ------------------------------------------------------------------------- choosing and claiming


def test_the_choice_follows_the_fresh_measurement_not_the_inventory(clock, locks):
    # At START the first GPU looks best; a second later the second one is.
    machine(
        clock,
        FakeGpu(memory_used=[(START, 0), (START + 1, 60 * GIB)]),
        FakeGpu(memory_used=10 * GIB),
    )
    inv = inventory(2)
    clock.advance(1)
    assert claims.wait_and_claim(inv, 1, SelectionPolicy(lock_dir=str(locks)))[0] == [1]
    claims.finish_job()
    # Equal memory: the lower utilisation over the window wins.
    clock.now = START
    machine(
        clock,
        FakeGpu(util_gpu=[(START, 0), (START + 1, 50)]),
        FakeGpu(util_gpu=[(START, 50), (START + 1, 10)]),
    )
    inv = inventory(2)
    clock.advance(1)
    assert claims.wait_and_claim(inv, 1, SelectionPolicy(lock_dir=str(locks)))[0] == [1]


def test_a_mig_slice_without_a_utilisation_reading_can_be_claimed(clock, locks):
    mig = FakeGpu(uuid="MIG-99990000-1111-2222-3333-444455556666", memory_total=10 * GIB)
    machine(clock, FakeGpu(name="NVIDIA A100-SXM4-80GB", mig=[mig]), FakeGpu(memory_used=75 * GIB))
    chosen, _ = claims.wait_and_claim(inventory(2), 1, SelectionPolicy(lock_dir=str(locks)))
    assert chosen == [0] and claims.claimed_uuids() == (mig.uuid,)


def test_too_few_gpus_claimed_are_given_back_and_the_error_names_each(clock, locks):
    machine(clock, FakeGpu(), FakeGpu(), FakeGpu())
    held = [other_run_holds(locks, u) for u in UUIDS[:2]]
    with pytest.raises(DeviceError) as info:
        claims.wait_and_claim(inventory(3), 2, SelectionPolicy(lock_dir=str(locks)))
    pid = os.getpid()
    assert str(info.value) == (
        "select_gpus=least_used found 1 of the 2 GPU(s) wanted with gpu_wait_s=0: "
        f"cuda:0 claimed by another run (pid {pid}); cuda:1 claimed by another run (pid {pid}); "
        "cuda:2 qualifies"
    )
    assert claims.claimed_uuids() == ()
    free_again = claims.try_lock(claims.lock_path(locks, UUIDS[2]))
    assert isinstance(free_again, int)
    for fd in [*held, free_again]:
        os.close(fd)


def test_nvml_failing_when_measuring_leaves_no_gpu_qualified(clock, locks):
    machine(clock, FakeGpu(), FakeGpu())
    inv = inventory(2)
    nvml.use_library(FakeNvml(2, init_error="driver_not_loaded"))
    with pytest.raises(DeviceError) as info:
        claims.wait_and_claim(inv, 1, SelectionPolicy(lock_dir=str(locks)))
    why = "memory unreadable (NVML is not available (Driver Not Loaded))"
    assert str(info.value) == (
        "select_gpus=least_used found 0 of the 1 GPU(s) wanted with gpu_wait_s=0: "
        f"cuda:0 {why}; cuda:1 {why}"
    )
    assert claims.claimed_uuids() == ()


def test_the_claim_line_names_the_gpus_taken_and_the_lock_directory(clock, locks):
    machine(clock, FakeGpu(), FakeGpu(), FakeGpu())
    chosen, message = claims.wait_and_claim(inventory(3), 2, SelectionPolicy(lock_dir=str(locks)))
    assert chosen == [0, 1] and claims.claimed_uuids() == tuple(UUIDS[:2])
    assert message == (
        "select_gpus=least_used picked cuda:0, cuda:1 of 3 (most free memory, then lowest "
        f"utilisation); claimed until the run ends (locks in {locks})"
    )


def test_a_wait_of_one_poll_is_reported_from_its_start(clock, locks):
    machine(clock, FakeGpu())
    held = [other_run_holds(locks, UUIDS[0])]

    def let_go(now: float) -> None:
        if now >= START + 2 and held:
            os.close(held.pop())

    clock.wakeups.append(let_go)
    policy = SelectionPolicy(wait_s=60, util_window_s=0, lock_dir=str(locks))
    chosen, message = claims.wait_and_claim(inventory(1), 1, policy)
    assert chosen == [0] and clock.now == START + 2
    assert "(most free memory, then lowest utilisation, after waiting 2 s); claimed" in message


def test_the_time_out_comes_at_the_deadline_and_says_how_long_it_waited(clock, locks):
    machine(clock, FakeGpu())
    held = other_run_holds(locks, UUIDS[0])
    policy = SelectionPolicy(wait_s=5, util_window_s=0.2, lock_dir=str(locks))
    with pytest.raises(DeviceError) as info:
        claims.wait_and_claim(inventory(1), 1, policy)
    assert str(info.value) == (
        "select_gpus=least_used found 0 of the 1 GPU(s) wanted after waiting 5 s: "
        f"cuda:0 claimed by another run (pid {os.getpid()})"
    )
    # Measurements end at 0.2, 2.4, 4.6 s, then the last pause is cut short to the deadline.
    assert clock.now == pytest.approx(START + 5.2)
    os.close(held)


def test_a_measurement_ending_exactly_at_the_deadline_is_the_last(clock, locks):
    fake = machine(clock, FakeGpu())
    held = other_run_holds(locks, UUIDS[0])
    policy = SelectionPolicy(wait_s=4, util_window_s=0, lock_dir=str(locks))
    inv = inventory(1)
    sessions_before = fake.init_count
    with pytest.raises(DeviceError, match="after waiting 4 s"):
        claims.wait_and_claim(inv, 1, policy)
    assert clock.now == START + 4 and fake.init_count - sessions_before == 3  # at 0, 2 and 4 s
    os.close(held)


def test_the_status_line_comes_at_the_start_and_every_minute(clock, locks, caplog, monkeypatch):
    machine(clock, FakeGpu())
    held = other_run_holds(locks, UUIDS[0])
    policy = SelectionPolicy(wait_s=150, util_window_s=0, lock_dir=str(locks))
    monkeypatch.setattr(claims.log, "disabled", False)  # whatever logging setup ran before
    monkeypatch.setattr(claims.log, "propagate", True)
    with caplog.at_level(logging.INFO, logger=claims.__name__), pytest.raises(DeviceError):
        claims.wait_and_claim(inventory(1), 1, policy)
    why = f"cuda:0 claimed by another run (pid {os.getpid()})"
    assert [r.getMessage() for r in caplog.records if r.name == claims.__name__] == [
        f"Waiting for 1 GPU(s) (select_gpus=least_used, {left} s left): {why}"
        for left in (150, 90, 30)
    ]
    os.close(held)


# ------------------------------------------------------------------------- without readings


def test_without_uuids_the_first_gpus_are_taken_unclaimed(clock, locks):
    nvml.use_library(FakeNvml([FakeGpu(uuid=""), FakeGpu()], clock=clock))
    inv = inventory(2)
    assert inv.nvml_available
    assert claims.wait_and_claim(inv, 1, SelectionPolicy(lock_dir=str(locks))) == (
        [0],
        "select_gpus=least_used: no GPU load readings (NVML gave no UUIDs); using the first 1: [0]",
    )
    assert claims.claimed_uuids() == ()


def test_without_nvml_any_wait_is_refused():
    nvml.use_library(FakeNvml(2, init_error="driver_not_loaded"))
    with pytest.raises(DeviceError) as info:
        claims.wait_and_claim(inventory(2), 1, SelectionPolicy(wait_s=0.5))
    assert str(info.value) == (
        "select_gpus=least_used with gpu_min_free_gib/gpu_max_util/gpu_wait_s needs NVML "
        "readings, but there are none (NVML is not available (Driver Not Loaded)); "
        "use select_gpus=first"
    )
