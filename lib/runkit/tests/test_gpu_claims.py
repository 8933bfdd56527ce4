"""``select_gpus=least_used`` on a shared machine: thresholds, a windowed utilisation, waiting, and
claims (a lock per GPU) that keep two launches off the same GPU.

In-process tests move a :class:`FakeClock` instead of sleeping; the concurrent-launch tests start
real processes against the same fake NVML (``RUNKIT_NVML_BACKEND``) and lock directory.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import prewarmed
from runkit.errors import RunError
from runkit.gpus import claims, nvml
from runkit.gpus.claims import Load, SelectionPolicy, judge, policy_from_config
from runkit.gpus.inventory import collect_inventory
from runkit.gpus.records import TorchCuda
from runkit.gpus.resolve import DeviceError
from runkit.testing.fake_nvml import GIB, FakeClock, FakeGpu, FakeNvml

UUIDS = [f"GPU-{i}{i}{i}{i}0000-1111-2222-3333-444455556666" for i in range(3)]


@pytest.fixture(autouse=True)
def no_claims_left():
    claims.finish_job()
    yield
    claims.finish_job()


@pytest.fixture
def clock(monkeypatch):
    """Time for :mod:`claims` and the fake: ``sleep`` moves the clock instead of waiting."""
    clock = FakeClock()
    wakeups: list = []

    def sleep(seconds: float) -> None:
        clock.advance(seconds)
        for hook in list(wakeups):
            hook(clock.now)

    monkeypatch.setattr(claims, "time", SimpleNamespace(monotonic=clock, sleep=sleep))
    clock.wakeups = wakeups
    return clock


def machine(clock, *gpus: FakeGpu) -> FakeNvml:
    for gpu, uuid in zip(gpus, UUIDS, strict=False):
        gpu.uuid = gpu.uuid or uuid
    fake = FakeNvml(list(gpus), clock=clock)
    nvml.use_library(fake)
    return fake


@pytest.fixture(autouse=True)
def no_fake_left():
    yield
    nvml.use_library(None)


def inventory(n: int):
    return collect_inventory(torch_info=TorchCuda(True, n), env={})


# ------------------------------------------------------------------------- the gpu_* keys


def test_the_defaults_ask_nothing_and_do_not_wait():
    policy = policy_from_config({})
    assert policy == SelectionPolicy() and not policy.has_thresholds and policy.wait_s == 0
    got = policy_from_config(
        {"gpu_min_free_gib": 20, "gpu_max_util": 30, "gpu_wait_s": 600, "gpu_lock_dir": "/x y"}
    )
    assert (got.min_free_gib, got.max_util_percent, got.wait_s, got.lock_dir) == (
        20,
        30,
        600,
        "/x y",
    )


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("gpu_wait_s", -1, "gpu_wait_s=-1 is invalid; expected a number of seconds >= 0"),
        ("gpu_max_util", 150, "gpu_max_util=150 is invalid; expected a percentage from 0 to 100"),
        ("gpu_min_free_gib", "lots", "gpu_min_free_gib='lots' is invalid; expected a number of"),
        ("gpu_min_free_gib", True, "gpu_min_free_gib=True is invalid"),
        ("gpu_wait_s", float("nan"), "gpu_wait_s=nan is invalid"),
        (
            "gpu_util_window_s",
            0,
            "gpu_util_window_s=0 is invalid; expected a number of seconds > 0",
        ),
        ("gpu_lock_dir", "", "gpu_lock_dir='' is invalid; expected a directory path or null"),
    ],
)
def test_a_bad_key_is_one_line_naming_it(key, value, message):
    with pytest.raises(RunError) as info:
        policy_from_config({key: value})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_preflight_checks_the_keys():
    from omegaconf import OmegaConf

    from runkit.run.preflight import check_devices

    cfg = OmegaConf.create({"gpu_max_util": 101, "trainer": {"accelerator": "cpu", "devices": 1}})
    with pytest.raises(RunError, match=r"^gpu_max_util=101 is invalid"):
        check_devices(cfg)


@pytest.mark.slow
def test_the_cli_refuses_a_bad_key_in_one_line_and_creates_nothing(tmp_path):
    runs = tmp_path / "runs é"
    result = prewarmed.run(
        [sys.executable, "-m", "project.train", "gpu_wait_s=-5", f"paths.log_dir='{runs}'"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: gpu_wait_s=-5 is invalid; expected a number of seconds >= 0"
    )
    assert not runs.exists()


# ------------------------------------------------------------------------- measuring


def test_utilisation_is_the_mean_over_the_window_and_memory_the_lowest(clock):
    # Busy for the first half of the window, idle after: one instant would say 90 %.
    machine(clock, FakeGpu(util_gpu=[(0, 90), (0.5, 10)], memory_used=[(0, 0), (0.6, 50 * GIB)]))
    (load,) = claims.measure_loads(inventory(1).visible, window_s=1.0)
    assert load.util_percent == pytest.approx(50)
    assert load.free_mib == 30 * 1024
    assert judge(load, SelectionPolicy(max_util_percent=60, util_window_s=1.0)) is None
    assert judge(load, SelectionPolicy(max_util_percent=40, util_window_s=1.0)) == (
        "utilization 50% (mean over 1 s) > gpu_max_util=40"
    )
    assert judge(load, SelectionPolicy(min_free_gib=31)) == "30.0 GiB free < gpu_min_free_gib=31"


def test_unsupported_utilisation_is_no_requirement_but_a_failing_gpu_never_qualifies(clock):
    mig = FakeGpu(uuid="MIG-99990000-1111-2222-3333-444455556666", memory_total=10 * GIB)
    lost = FakeGpu()
    lost.fail("memory", "gpu_is_lost")
    machine(clock, FakeGpu(name="NVIDIA A100-SXM4-80GB", mig=[mig]), lost)
    inv = inventory(2)
    assert [g.uuid for g in inv.visible] == [mig.uuid, UUIDS[1]]
    mig_load, lost_load = claims.measure_loads(inv.visible, window_s=0.2)
    assert mig_load.util_percent is None and mig_load.util_error is None
    assert judge(mig_load, SelectionPolicy(max_util_percent=10, min_free_gib=5)) is None
    assert judge(lost_load, SelectionPolicy()) == "memory unreadable (GPU is lost)"


def test_judge_needs_a_reading_for_a_memory_threshold():
    assert judge(Load(), SelectionPolicy(min_free_gib=1)) == (
        "free memory not reported, so gpu_min_free_gib cannot be checked"
    )
    assert judge(Load(), SelectionPolicy()) is None


# ------------------------------------------------------------------------- locks


def test_a_lock_excludes_every_other_holder_until_closed(tmp_path):
    path = claims.lock_path(tmp_path, UUIDS[0])
    fd = claims.try_lock(path)
    assert isinstance(fd, int)
    assert claims.try_lock(path) == f"claimed by another run (pid {os.getpid()})"
    os.close(fd)
    again = claims.try_lock(path)
    assert isinstance(again, int)
    os.close(again)


def test_hostile_lock_files_are_refused_not_followed(tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep me")
    (tmp_path / "GPU-a.lock").symlink_to(target)
    assert "cannot be opened" in claims.try_lock(tmp_path / "GPU-a.lock")
    assert target.read_text() == "keep me"
    os.mkfifo(tmp_path / "GPU-b.lock")  # opening a FIFO must not block
    assert claims.try_lock(tmp_path / "GPU-b.lock").endswith("is not a regular file")
    (tmp_path / "GPU-c.lock").mkdir()
    assert "cannot be opened" in claims.try_lock(tmp_path / "GPU-c.lock")
    assert claims.lock_path(tmp_path, "../../etc/passwd") == tmp_path / "______etc_passwd.lock"


def test_garbage_in_a_held_lock_file_still_reads_as_another_run(tmp_path):
    path = claims.lock_path(tmp_path, UUIDS[0])
    fd = claims.try_lock(path)
    os.pwrite(fd, b"\xff\x00 not a pid \n" * 10, 0)
    assert claims.try_lock(path) == "claimed by another run"
    os.close(fd)


def test_the_default_lock_directory_is_the_users_own(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run é"))
    (tmp_path / "run é").mkdir()
    assert claims.lock_dir_for(SelectionPolicy()) == tmp_path / "run é" / "runkit-gpu-locks"
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DeviceError, match=r"^gpu_lock_dir='.*file/locks' cannot be created"):
        claims.lock_dir_for(SelectionPolicy(lock_dir=str(blocker / "locks")))


# ------------------------------------------------------------------------- waiting and claiming


def test_claimed_gpus_are_skipped_and_time_out_names_every_gpu(clock, tmp_path):
    machine(
        clock,
        FakeGpu(memory_used=10 * GIB),
        FakeGpu(memory_used=70 * GIB),
        FakeGpu(util_gpu=95),
    )
    other_run = claims.try_lock(claims.lock_path(tmp_path, UUIDS[0]))
    policy = SelectionPolicy(min_free_gib=20, max_util_percent=50, lock_dir=str(tmp_path))
    with pytest.raises(DeviceError) as info:
        claims.wait_and_claim(inventory(3), 1, policy)
    assert str(info.value) == (
        "select_gpus=least_used found 0 of the 1 GPU(s) wanted with gpu_wait_s=0: "
        f"cuda:0 claimed by another run (pid {os.getpid()}); "
        "cuda:1 10.0 GiB free < gpu_min_free_gib=20; "
        "cuda:2 utilization 95% (mean over 1 s) > gpu_max_util=50"
    )
    assert claims.claimed_uuids() == ()
    os.close(other_run)
    chosen, message = claims.wait_and_claim(inventory(3), 1, policy)
    assert chosen == [0] and claims.claimed_uuids() == (UUIDS[0],)
    assert message.startswith("select_gpus=least_used picked cuda:0 of 3")


def test_a_run_waits_logging_once_a_minute_until_another_run_lets_go(
    clock, tmp_path, caplog, monkeypatch
):
    machine(clock, FakeGpu(), FakeGpu())
    held = [claims.try_lock(claims.lock_path(tmp_path, u)) for u in UUIDS[:2]]

    def other_run_ends(now: float) -> None:
        if now >= 150 and len(held) == 2:
            os.close(held.pop())  # the second GPU is given back after 150 s

    clock.wakeups.append(other_run_ends)
    policy = SelectionPolicy(wait_s=600, util_window_s=0.2, lock_dir=str(tmp_path))
    monkeypatch.setattr(claims.log, "disabled", False)  # whatever logging setup ran before
    monkeypatch.setattr(claims.log, "propagate", True)
    with caplog.at_level(logging.INFO, logger=claims.__name__):
        chosen, message = claims.wait_and_claim(inventory(2), 1, policy)
    assert chosen == [1] and 150 <= clock.now < 160
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Waiting")]
    assert len(waits) == 3  # at 0, 60 and 120 s
    assert waits[0].startswith("Waiting for 1 GPU(s) (select_gpus=least_used, 600 s left): ")
    assert "after waiting 15" in message
    os.close(held.pop())


def test_without_nvml_thresholds_are_refused_and_plain_least_used_takes_the_first():
    nvml.use_library(FakeNvml(2, init_error="driver_not_loaded"))
    inv = collect_inventory(torch_info=TorchCuda(True, 2), env={})
    assert claims.wait_and_claim(inv, 1, SelectionPolicy())[0] == [0]
    with pytest.raises(DeviceError, match=r"needs NVML readings, but there are none \(NVML is"):
        claims.wait_and_claim(inv, 1, SelectionPolicy(wait_s=5))


# ------------------------------------------------------------------------- two real launches

LAUNCH = textwrap.dedent(
    """
    import json, logging, os, sys, time
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from runkit.gpus import inventory
    from runkit.gpus.claims import SelectionPolicy
    from runkit.gpus.records import TorchCuda
    from runkit.gpus.resolve import resolve_for_run

    devices, hold_s, lock_dir, go = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
    inventory.probe_torch = lambda uuids=True: TorchCuda(True, 2)  # torch has no CUDA here
    while not Path(go).exists():  # start both launches at the same moment
        time.sleep(0.01)
    started = time.monotonic()
    policy = SelectionPolicy(wait_s=60, util_window_s=0.2, lock_dir=lock_dir)
    plan = resolve_for_run("gpu", devices, select="least_used", policy=policy, environ={})
    print(json.dumps({"gpus": plan.devices, "waited": time.monotonic() - started}), flush=True)
    time.sleep(hold_s)
    """
)


def launch(tmp_path: Path, devices: int, hold_s: float) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["RUNKIT_NVML_BACKEND"] = "runkit.testing.fake_nvml:create"
    env["RUNKIT_FAKE_NVML"] = json.dumps({"gpus": 2})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCH,
            str(devices),
            str(hold_s),
            str(tmp_path / "locks"),
            str(tmp_path / "go"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_launches_at_once_take_different_gpus(tmp_path):
    procs = [launch(tmp_path, 1, hold_s=1.0) for _ in range(2)]
    time.sleep(3)  # both imported and polling for the start signal
    (tmp_path / "go").touch()
    first, second = (result(p) for p in procs)
    assert sorted(first["gpus"] + second["gpus"]) == [0, 1]


@pytest.mark.slow
def test_the_second_launch_waits_until_the_first_lets_go_even_by_dying(tmp_path):
    holder = launch(tmp_path, 2, hold_s=600)  # takes both GPUs, then hangs
    (tmp_path / "go").touch()
    assert json.loads(holder.stdout.readline())["gpus"] == [0, 1]
    waiter = launch(tmp_path, 1, hold_s=0)
    time.sleep(4)
    assert waiter.poll() is None  # still waiting
    holder.send_signal(signal.SIGKILL)  # no clean-up at all: the kernel drops its locks
    holder.communicate(timeout=60)
    got = result(waiter)
    assert got["gpus"] == [0] and got["waited"] >= 1.0
