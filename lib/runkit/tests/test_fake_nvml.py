"""The fake NVML must behave like pynvml where the template's code can tell the difference."""

from __future__ import annotations

import json
import os
import threading

import pynvml
import pytest

from runkit.gpus import nvml
from runkit.testing import fake_nvml
from runkit.testing.fake_nvml import (
    GIB,
    FakeClock,
    FakeGpu,
    FakeNvml,
    FakeProcess,
    create,
    evaluate,
    integrate,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_scripts_step_and_integrate_exactly() -> None:
    steps = [(0.0, 10), (5.0, 90)]
    assert [evaluate(steps, t) for t in (-1, 0, 4.99, 5, 100)] == [10, 10, 10, 90, 90]
    assert evaluate(lambda t: 2 * t, 3.0) == 6.0 and evaluate(7, 123.0) == 7
    assert integrate(steps, 1.0) == 10.0 and integrate(steps, 7.0) == 10 * 5 + 90 * 2
    assert integrate(50.0, 4.0) == 200.0
    assert integrate(lambda t: 10.0, 2.0) == pytest.approx(20.0)


def test_values_follow_the_clock(clock: FakeClock) -> None:
    fake = FakeNvml(
        [FakeGpu(util_gpu=[(0, 10), (5, 90)], power_mw=[(0, 100_000), (2, 300_000)])], clock=clock
    )
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetUtilizationRates(handle).gpu == 10
    start = fake.nvmlDeviceGetTotalEnergyConsumption(handle)
    clock.advance(5)
    assert fake.nvmlDeviceGetUtilizationRates(handle).gpu == 90
    # energy counter (mJ) = integral of power (mW) over seconds: 100 W * 2 s + 300 W * 3 s
    assert fake.nvmlDeviceGetTotalEnergyConsumption(handle) - start == 1_100_000
    fake.nvmlShutdown()
    assert fake.balanced


def test_calls_need_init_which_nests_and_can_fail_as_pynvml_does(use_fake) -> None:
    fake = use_fake(FakeNvml(2))
    for call in (fake.nvmlDeviceGetCount, fake.nvmlShutdown):
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            call()
    with nvml.nvml_session() as lib, nvml.nvml_session() as inner:
        assert inner.nvmlDeviceGetCount() == lib.nvmlDeviceGetCount() == 2
    with pytest.raises(RuntimeError), nvml.nvml_session():
        raise RuntimeError("boom")
    assert (fake.init_count, fake.shutdown_count) == (3, 3) and not fake.initialised
    fake = use_fake(FakeNvml(1, init_error="driver_not_loaded"))
    with pytest.raises(nvml.NvmlUnavailable, match="Driver Not Loaded"), nvml.nvml_session():
        pass
    assert fake.init_count == fake.shutdown_count == 0


def test_identity_and_lookup_by_uuid() -> None:
    fake = FakeNvml([FakeGpu(name="A"), FakeGpu(name="B", mig=[FakeGpu(name="B-mig")])])
    fake.nvmlInit()
    b = fake.nvmlDeviceGetHandleByIndex(1)
    uuid = fake.nvmlDeviceGetUUID(b)
    assert uuid.startswith("GPU-") and fake.nvmlDeviceGetName(b) == "B"
    assert fake.nvmlDeviceGetIndex(fake.nvmlDeviceGetHandleByUUID(uuid.encode())) == 1
    bus_id = fake.nvmlDeviceGetPciInfo(b).busId
    assert isinstance(bus_id, bytes)  # as in nvidia-ml-py
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetHandleByUUID("GPU-does-not-exist")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(2)


def test_mig_children(clock: FakeClock) -> None:
    child = FakeGpu(name="slice", memory_total=10 * GIB, memory_used=GIB)
    fake = FakeNvml([FakeGpu(), FakeGpu(mig=[child])], clock=clock)
    fake.nvmlInit()
    parent = fake.nvmlDeviceGetHandleByIndex(1)
    assert fake.nvmlDeviceGetMigMode(parent)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    assert fake.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(parent, 1)
    mig_uuid = fake.nvmlDeviceGetUUID(mig)
    assert mig_uuid.startswith("MIG-")
    assert fake.nvmlDeviceGetHandleByUUID(mig_uuid) is mig
    assert bool(fake.nvmlDeviceIsMigDeviceHandle(mig))
    assert not fake.nvmlDeviceIsMigDeviceHandle(parent)
    assert fake.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig) is parent
    assert fake.nvmlDeviceGetMemoryInfo(mig).total == 10 * GIB
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetUtilizationRates(mig)  # as on real MIG slices
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetMigMode(fake.nvmlDeviceGetHandleByIndex(0))
    # losing the parent loses its slices
    fake.gpus[1].lose(at=1.0)
    clock.advance(1.0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetMemoryInfo(mig)


def test_scripted_failures(clock: FakeClock) -> None:
    fake = FakeNvml([FakeGpu(fan_pct=None)], clock=clock)
    fake.gpus[0].fail("power", "not_supported").fail("utilization", "gpu_is_lost", start=3)
    fake.gpus[0].fail("nvmlDeviceGetCurrentClocksEventReasons", "function_not_found")
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetPowerUsage(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetFanSpeed(h)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        fake.nvmlDeviceGetCurrentClocksEventReasons(h)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)  # not scripted
    assert fake.nvmlDeviceGetCurrentClocksThrottleReasons(h) == 0  # the old name still works
    assert fake.nvmlDeviceGetUtilizationRates(h).gpu == 0
    clock.set(3)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetUtilizationRates(h)
    fake.gpus[0].heal("utilization")
    assert fake.nvmlDeviceGetUtilizationRates(h).gpu == 0


def test_unimplemented_function_raises_function_not_found_and_constants_are_pynvml() -> None:
    fake = FakeNvml(1)
    assert fake.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert fake.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        fake.nvmlDeviceGetBoardId(None)
    with pytest.raises(AttributeError):
        _ = fake.not_a_pynvml_name


def test_memory_temperature_through_field_values() -> None:
    fake = FakeNvml([FakeGpu(memory_temperature=71), FakeGpu()])
    fake.nvmlInit()
    for index, expected in (
        (0, (pynvml.NVML_SUCCESS, 71)),
        (1, (pynvml.NVML_ERROR_NOT_SUPPORTED, 0)),
    ):
        h = fake.nvmlDeviceGetHandleByIndex(index)
        (value,) = fake.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
        assert (value.nvmlReturn, value.value.uiVal) == expected


def test_processes_self_pid() -> None:
    fake = FakeNvml([FakeGpu(processes=[FakeProcess("self", 3 * GIB), FakeProcess(42, GIB)])])
    fake.nvmlInit()
    procs = fake.nvmlDeviceGetComputeRunningProcesses(fake.nvmlDeviceGetHandleByIndex(0))
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(os.getpid(), 3 * GIB), (42, GIB)]


def test_call_counting_per_thread_and_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(fake_nvml.time, "sleep", slept.append)
    fake = FakeNvml(1, call_cost_s=0.0003)
    fake.nvmlInit()
    worker = threading.Thread(target=lambda: [fake.nvmlDeviceGetCount() for _ in range(3)])
    worker.start()
    worker.join()
    assert fake.calls["nvmlDeviceGetCount"] == 3
    assert fake.calls_in_thread(worker.ident) == 3
    assert fake.calls_in_thread() == 1  # nvmlInit in this thread
    assert slept == [0.0003] * 3


def test_bad_scenarios_fail_with_one_clear_line() -> None:
    with pytest.raises(ValueError, match="unknown NVML error name 'melted'"):
        FakeGpu().fail("power", "melted")
    with pytest.raises(ValueError, match="unknown metric 'flux'"):
        FakeGpu().fail("flux", "not_supported")
    with pytest.raises(ValueError, match="not sorted"):
        FakeGpu(util_gpu=[(5, 1), (1, 2)])
    with pytest.raises(ValueError, match=r"gpus\[0\] has unknown keys \['colour'\]"):
        FakeNvml.from_dict({"gpus": [{"colour": "green"}]})


def test_create_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv(fake_nvml.SCENARIO_ENV, raising=False)
    assert len(create().gpus) == 2  # the preset
    scenario = {
        "gpus": [
            {"name": "X", "util_gpu": [[0, 5], [1, 50]], "failures": {"fan": "not_supported"}},
            {"name": "Y", "mig": [{"uuid": "MIG-abc"}], "lost_at": 2.0},
        ],
        "call_cost_s": 0.0,
        "init_error": None,
    }
    monkeypatch.setenv(fake_nvml.SCENARIO_ENV, json.dumps(scenario))
    fake = create()
    assert [g.name for g in fake.gpus] == ["X", "Y"]
    assert fake.gpus[1].mig[0].uuid == "MIG-abc" and fake.gpus[1].lost_at == 2.0
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps({"gpus": 3}))
    monkeypatch.setenv(fake_nvml.SCENARIO_ENV, str(path))
    assert len(create().gpus) == 3
    monkeypatch.setenv(fake_nvml.SCENARIO_ENV, "{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        create()
    monkeypatch.setenv(fake_nvml.SCENARIO_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="neither inline JSON"):
        create()
    damaged = tmp_path / "scénario with spaces.json"
    damaged.write_bytes(b'{"gpus": 2\xff\xfe}')
    monkeypatch.setenv(fake_nvml.SCENARIO_ENV, str(damaged))
    with pytest.raises(ValueError, match=r"scénario with spaces.json' cannot be read \(.*utf-8"):
        create()


def test_mig_instance_ids_match_the_process_list() -> None:
    fake = FakeNvml(
        [
            FakeGpu(
                mig=[
                    FakeGpu(processes=[FakeProcess(7)]),
                    FakeGpu(gpu_instance_id=5, compute_instance_id=2),
                ]
            )
        ]
    )
    fake.nvmlInit()
    parent = fake.nvmlDeviceGetHandleByIndex(0)
    slices = [fake.nvmlDeviceGetMigDeviceHandleByIndex(parent, j) for j in range(2)]
    ids = [
        (fake.nvmlDeviceGetGpuInstanceId(h), fake.nvmlDeviceGetComputeInstanceId(h)) for h in slices
    ]
    assert ids == [(1, 0), (5, 2)]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetGpuInstanceId(parent)  # a physical GPU has none
    (proc,) = fake.nvmlDeviceGetComputeRunningProcesses(parent)
    assert (proc.pid, proc.gpuInstanceId, proc.computeInstanceId) == (7, 1, 0)
    fake.nvmlShutdown()
