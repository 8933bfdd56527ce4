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


def started(*gpus: FakeGpu, **kw) -> FakeNvml:
    fake = FakeNvml(list(gpus), **kw)
    fake.nvmlInit()
    return fake


def test_scripts_step_and_integrate_exactly() -> None:
    steps = [(0.0, 10), (5.0, 90)]
    assert [evaluate(steps, t) for t in (-1, 0, 4.99, 5, 100)] == [10, 10, 10, 90, 90]
    assert evaluate(lambda t: 2 * t, 3.0) == 6.0 and evaluate(7, 123.0) == 7
    assert integrate(steps, 1.0) == 10.0 and integrate(steps, 7.0) == 10 * 5 + 90 * 2
    assert integrate(50.0, 4.0) == 200.0
    assert integrate(lambda t: 10.0, 2.0) == pytest.approx(20.0)


def test_values_and_failures_follow_the_clock() -> None:
    clock = FakeClock()
    gpu = FakeGpu(util_gpu=[(0, 10), (5, 90)], power_mw=[(0, 100_000), (2, 300_000)])
    fake = started(gpu, FakeGpu(), clock=clock)
    h = fake.nvmlDeviceGetHandleByIndex(0)
    gpu.fail("power", "not_supported").fail("utilization", "gpu_is_lost", start=6)
    gpu.fail("nvmlDeviceGetCurrentClocksEventReasons", "function_not_found")
    assert fake.nvmlDeviceGetUtilizationRates(h).gpu == 10
    start = fake.nvmlDeviceGetTotalEnergyConsumption(h)
    clock.advance(5)
    assert fake.nvmlDeviceGetUtilizationRates(h).gpu == 90
    # energy counter (mJ) = integral of power (mW) over seconds: 100 W * 2 s + 300 W * 3 s
    assert fake.nvmlDeviceGetTotalEnergyConsumption(h) - start == 1_100_000
    for call, error in [
        (lambda: fake.nvmlDeviceGetPowerUsage(h), pynvml.NVMLError_NotSupported),
        (lambda: fake.nvmlDeviceGetFanSpeed(h), pynvml.NVMLError_NotSupported),  # no fan
        (lambda: fake.nvmlDeviceGetCurrentClocksEventReasons(h), pynvml.NVMLError_FunctionNotFound),
        (lambda: fake.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM), pynvml.NVMLError_InvalidArgument),
        (lambda: fake.nvmlDeviceGetBoardId(h), pynvml.NVMLError_FunctionNotFound),  # not modelled
    ]:  # fmt: skip
        with pytest.raises(error):
            call()
    assert fake.nvmlDeviceGetCurrentClocksThrottleReasons(h) == 0  # the old name still works
    clock.set(6)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetUtilizationRates(h)
    gpu.heal("utilization")
    assert fake.nvmlDeviceGetUtilizationRates(h).gpu == 90
    fake.gpus[1].lose(at=7)
    clock.advance(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetHandleByIndex(1)
    assert fake.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert fake.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost
    with pytest.raises(AttributeError):
        _ = fake.not_a_pynvml_name


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


def test_identity_fields_and_processes() -> None:
    procs = [FakeProcess("self", 3 * GIB), FakeProcess(42, GIB)]
    fake = started(FakeGpu(name="A", memory_temperature=71, processes=procs), FakeGpu(name="B"))
    a, b = (fake.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
    uuid = fake.nvmlDeviceGetUUID(b)
    assert uuid.startswith("GPU-") and fake.nvmlDeviceGetName(b) == "B"
    assert fake.nvmlDeviceGetIndex(fake.nvmlDeviceGetHandleByUUID(uuid.encode())) == 1
    assert isinstance(fake.nvmlDeviceGetPciInfo(b).busId, bytes)  # as in nvidia-ml-py
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetHandleByUUID("GPU-does-not-exist")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(2)
    for handle, expected in ((a, (pynvml.NVML_SUCCESS, 71)), (b, (pynvml.NVML_ERROR_NOT_SUPPORTED, 0))):  # fmt: skip
        (value,) = fake.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
        assert (value.nvmlReturn, value.value.uiVal) == expected
    listed = fake.nvmlDeviceGetComputeRunningProcesses(a)
    assert [(p.pid, p.usedGpuMemory) for p in listed] == [(os.getpid(), 3 * GIB), (42, GIB)]


def test_mig_slices_answer_as_real_ones() -> None:
    clock = FakeClock()
    slices = [FakeGpu(processes=[FakeProcess(7)], memory_total=10 * GIB, memory_used=GIB)]
    slices.append(FakeGpu(gpu_instance_id=5, compute_instance_id=2))
    fake = started(FakeGpu(), FakeGpu(mig=slices), clock=clock)
    plain, parent = (fake.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
    assert fake.nvmlDeviceGetMigMode(parent)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    assert fake.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    mig, mig5 = (fake.nvmlDeviceGetMigDeviceHandleByIndex(parent, j) for j in (0, 1))
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(parent, 2)
    mig_uuid = fake.nvmlDeviceGetUUID(mig)
    assert mig_uuid.startswith("MIG-") and fake.nvmlDeviceGetHandleByUUID(mig_uuid) is mig
    assert fake.nvmlDeviceIsMigDeviceHandle(mig) and not fake.nvmlDeviceIsMigDeviceHandle(parent)
    assert fake.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig) is parent
    assert fake.nvmlDeviceGetMemoryInfo(mig).total == 10 * GIB
    ids = [(fake.nvmlDeviceGetGpuInstanceId(h), fake.nvmlDeviceGetComputeInstanceId(h)) for h in (mig, mig5)]  # fmt: skip
    assert ids == [(1, 0), (5, 2)]
    (proc,) = fake.nvmlDeviceGetComputeRunningProcesses(parent)
    assert (proc.pid, proc.gpuInstanceId, proc.computeInstanceId) == (7, 1, 0)
    for call, error in [
        (lambda: fake.nvmlDeviceGetUtilizationRates(mig), pynvml.NVMLError_NotSupported),
        (lambda: fake.nvmlDeviceGetMigMode(plain), pynvml.NVMLError_NotSupported),
        (lambda: fake.nvmlDeviceGetGpuInstanceId(parent), pynvml.NVMLError_InvalidArgument),
    ]:
        with pytest.raises(error):
            call()
    fake.gpus[1].lose(at=1.0)  # losing the parent loses its slices
    clock.advance(1.0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetMemoryInfo(mig)


def test_call_counting_per_thread_and_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(fake_nvml.time, "sleep", slept.append)
    fake = started(FakeGpu(), call_cost_s=0.0003)
    worker = threading.Thread(target=lambda: [fake.nvmlDeviceGetCount() for _ in range(3)])
    worker.start()
    worker.join()
    assert fake.calls["nvmlDeviceGetCount"] == 3 == fake.calls_in_thread(worker.ident)
    assert fake.calls_in_thread() == 1  # nvmlInit in this thread
    assert slept == [0.0003] * 3


def test_scenarios_from_the_environment_and_bad_ones_in_one_line(monkeypatch, tmp_path) -> None:
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
    damaged = tmp_path / "scénario with spaces.json"
    damaged.write_bytes(b'{"gpus": 2\xff\xfe}')
    for value, message in [
        (str(path), None),
        ("{not json", "invalid JSON"),
        (str(tmp_path / "missing.json"), "neither inline JSON"),
        (str(damaged), r"scénario with spaces.json' cannot be read \(.*utf-8"),
        ('{"gpus": [{"colour": "green"}]}', "scenario .* is invalid .*'colour'"),
    ]:
        monkeypatch.setenv(fake_nvml.SCENARIO_ENV, value)
        if message is None:
            assert len(create().gpus) == 3
        else:
            with pytest.raises(ValueError, match=message):
                create()
    with pytest.raises(ValueError, match="unknown NVML error name 'melted'"):
        FakeGpu().fail("power", "melted")
    with pytest.raises(ValueError, match="unknown metric 'flux'"):
        FakeGpu().fail("flux", "not_supported")
    with pytest.raises(ValueError, match="not sorted"):
        FakeGpu(util_gpu=[(5, 1), (1, 2)])
