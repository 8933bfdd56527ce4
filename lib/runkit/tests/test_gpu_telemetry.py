"""The GPU figures below the callback (readers, GPM, the sampler, keys, energy); no Trainer."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pynvml
import pytest
import torch

from runkit.gpu_stats.callback import GpuStatsMonitor, energy_report
from runkit.gpu_stats.sampler import DEFAULT_GROUPS, GPM_METRICS, TRAIN, GpuReader, GpuSampler
from runkit.gpu_stats.statistics import RunSummary, flatten_epoch, flatten_loop
from runkit.gpus import nvml
from runkit.testing.fake_nvml import GIB, FakeClock, FakeGpu, FakeNvml, FakeProcess

LOGGER = "runkit.gpu_stats"
HOPPER_GPM = {"SM_UTIL": 60, "SM_OCCUPANCY": 30, "ANY_TENSOR_UTIL": 20, "DRAM_BW_UTIL": 45}


@pytest.fixture
def nvml_of():
    """``nvml_of(gpu, ..., clock=...)``: a started fake NVML, shut down after the test."""
    fakes: list[FakeNvml] = []

    def start(*gpus: FakeGpu, clock=None) -> FakeNvml:
        fakes.append(FakeNvml(list(gpus), clock=clock))
        fakes[-1].nvmlInit()
        return fakes[-1]

    yield start
    for fake in fakes:
        fake.nvmlShutdown()


def reader(fake: FakeNvml, index: int, groups=DEFAULT_GROUPS, handle=None) -> GpuReader:
    return GpuReader(fake, handle or fake.nvmlDeviceGetHandleByIndex(index), f"cuda{index}", groups)


def sampled(clock, *readers, times=(1, 2, 3, 4), prime=True) -> GpuSampler:
    """A sampler that read at t=0 outside any phase (``prime``), then in training at ``times``."""
    sampler = GpuSampler(readers, interval_s=1.0, devices={})
    if prime:  # the energy counter's first reading
        sampler.sample_now()
    sampler.set_phase(TRAIN)
    for t in times:
        clock.set(t)
        sampler.sample_now()
    return sampler


# --------------------------------------------------------------------------- sampling
def test_epoch_statistics_are_exact_on_a_fake_clock(nvml_of) -> None:
    clock = FakeClock()
    gpu = FakeGpu(util_gpu=[(0, 10), (2, 50), (4, 90)], util_memory=[(0, 20), (3, 40)],
                  memory_used=[(0, 4 * GIB), (3, 8 * GIB)], memory_total=16 * GIB,
                  temperature=[(0, 50), (1, 70)], power_mw=350_000, power_limit_mw=700_000,
                  clock_sm_mhz=[(0, 1800), (3, 1200)],
                  clocks_event_reasons=[(0, 0), (3, pynvml.nvmlClocksEventReasonSwPowerCap)],
                  processes=[FakeProcess("self", [(0, GIB), (2, 3 * GIB)])])  # fmt: skip
    s = sampled(clock, reader(nvml_of(gpu, clock=clock), 0)).report(TRAIN)[0]["cuda0"]
    # A boundary sample belongs to the phase it closes: the epoch's samples are t = 1, 2, 3, 4.
    expected = {
        "samples": 4, "util_mean": (10 + 50 + 50 + 90) / 4, "util_max": 90, "util_min": 10,
        "mem_used_gib_max": 8, "mem_total_gib": 16, "mem_util_mean": 30, "mem_used_gib_mean": 6,
        "proc_mem_gib_mean": (1 + 3 + 3 + 3) / 4, "temp_c_mean": 70, "temp_c_max": 70,
        "power_w_mean": 350, "power_ratio_max": 0.5, "sm_clock_mhz_min": 1200,
        "sm_clock_mhz_mean": 1500, "throttle_power_frac": 2 / 4, "throttle_any_frac": 2 / 4,
        "throttle_thermal_frac": 0, "energy_j": 350 * 4,  # 350 W for the 4 s of the phase
    }  # fmt: skip
    assert {k: s[k] for k in expected} == pytest.approx(expected)


def test_unsupported_metrics_are_left_out_never_zero_and_optional_ones_read_in_units(nvml_of) -> None:  # fmt: skip
    mig_parent = FakeGpu(name="A100", mig=[FakeGpu(name="A100 MIG 1g.10gb", memory_total=10 * GIB)])
    datacenter = FakeGpu(fan_pct=None).fail("power", "not_supported")
    datacenter.fail("nvmlDeviceGetCurrentClocksEventReasons", "function_not_found")  # old driver
    fake = nvml_of(datacenter, mig_parent)
    groups = [*DEFAULT_GROUPS, "fan", "memory_temperature"]
    plain = reader(fake, 0, groups)
    mig_handle = fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.nvmlDeviceGetHandleByIndex(1), 0)
    mig = reader(fake, 1, groups, mig_handle)
    assert set(plain.unsupported) == {"power", "fan", "memory_temperature", "gpm"}  # no GPM here
    assert "throttle" in plain.groups  # fell back to nvmlDeviceGetCurrentClocksThrottleReasons
    assert set(mig.unsupported) == {"utilization", "fan", "memory_temperature", "gpm"}
    assert mig.is_mig and mig.nvml_index == 1  # whole-GPU values come from the parent
    assert mig.identity()["board_uuid"] == fake.gpus[1].uuid  # energy counted per physical GPU
    out = sampled(FakeClock(), plain, mig, times=()).report(TRAIN)[0]  # the latest reading
    assert not any(k.startswith(("power", "fan", "mem_temp")) for k in out["cuda0"])
    assert "throttle_any_frac" in out["cuda0"] and "temp_c_mean" in out["cuda0"]
    assert not any(k.startswith(("util", "mem_util", "fan")) for k in out["cuda1"])
    assert out["cuda1"]["mem_total_gib"] == 10 and "power_w_mean" in out["cuda1"]
    gpu = FakeGpu(fan_pct=60, pcie_tx_kbs=2048, pcie_rx_kbs=512, ecc_uncorrected=3, memory_temperature=80)  # fmt: skip
    optional = reader(nvml_of(gpu, clock=lambda: 0.0), 0, ["fan", "pcie", "ecc", "memory_temperature"])  # fmt: skip
    assert optional.read() == (
        {"fan_pct": 60.0, "pcie_tx_mbs": 2.0, "pcie_rx_mbs": 0.5, "ecc_uncorrected": 3.0, "mem_temp_c": 80.0},
        [],
    )  # fmt: skip
    assert optional.unsupported == {}


def test_gpu_lost_mid_run_warns_once_and_the_others_continue(nvml_of, caplog) -> None:
    clock = FakeClock()
    fake = nvml_of(FakeGpu(util_gpu=30), FakeGpu(util_gpu=60).lose(at=2.0), clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sampler = sampled(clock, reader(fake, 0), reader(fake, 1), times=(1, 2, 3, 4, 4))
    out = sampler.report(TRAIN)[0]
    # samples at t = 1, 2, 3, 4, 4; the lost GPU only has t = 1
    assert out["cuda0"]["samples"] == 5 and out["cuda0"]["util_mean"] == 30
    assert out["cuda1"]["samples"] == 1 and out["cuda1"]["util_mean"] == 60
    lost = [r for r in caplog.records if "stopped sampling cuda1" in r.message]
    assert len(lost) == 1 and "GpuIsLost" in lost[0].message
    assert sampler.readers[1].dead and not sampler.readers[0].dead


# --------------------------------------------------------------------------- GPM
def test_gpm_readings_cover_each_sampling_interval_exactly(nvml_of) -> None:
    clock = FakeClock()
    fake = nvml_of(FakeGpu(gpm={**HOPPER_GPM, "SM_UTIL": [(0, 20), (2, 80)]}), clock=clock)
    gpu = reader(fake, 0)  # first sample at t=0
    assert "gpm" in gpu.groups and fake.gpm_samples_live == 2
    # intervals 0-1 (20 %), 1-3 (half 20, half 80 %), 3-4 (80)
    sampler = sampled(clock, gpu, times=(1, 3, 4), prime=False)
    s = sampler.report(TRAIN)[0]["cuda0"]
    assert s["sm_active_mean"] == pytest.approx((20 + 50 + 80) / 3)
    assert s["sm_active_max"] == pytest.approx(80) and s["sm_occupancy_mean"] == 30
    assert s["tensor_active_max"] == 20 and s["dram_active_mean"] == 45
    assert not any(k.startswith(("fp16", "fp32", "fp64")) for k in s)  # absent, never 0
    sampler.stop()
    assert fake.gpm_samples_live == 0  # the pair is freed when sampling stops


def test_gpm_taken_by_a_profiler_pauses_with_one_line_and_comes_back(nvml_of, caplog) -> None:
    clock = FakeClock()
    gpu = FakeGpu(gpm={"SM_UTIL": 50})
    counters = reader(nvml_of(gpu, clock=clock), 0)
    gpu.fail("nvmlGpmSampleGet", "in_use", start=1.5)  # DCGM or Nsight takes the counters
    readings = []
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for t in (1, 2, 3, 4, 5):
            clock.set(t)
            if t == 4:
                gpu.heal("nvmlGpmSampleGet")
            readings.append(counters.read()[0].get("sm_active"))
    # t=2, 3 refused; t=4 starts a fresh pair (no figure yet); t=5 has one again
    assert readings == [50, None, None, None, 50]
    assert "gpm" in counters.groups and counters.dead is None  # the other metrics never stopped
    messages = [r.getMessage() for r in caplog.records]
    assert sum("GPM refused (InUse)" in m and "profiler" in m for m in messages) == 1
    assert sum("GPM figures are back" in m for m in messages) == 1
    counters.close()


def test_gpm_of_a_mig_slice_is_its_own_and_without_gpm_no_samples_are_held(nvml_of) -> None:
    fake = nvml_of(FakeGpu(), FakeGpu(gpm=HOPPER_GPM).fail("gpm", "function_not_found"))
    for index in range(2):
        gpu = reader(fake, index)
        assert "gpm" not in gpu.groups and "gpm" in gpu.unsupported
        assert not set(GPM_METRICS) & set(gpu.read()[0])
    assert fake.calls["nvmlGpmSampleAlloc"] == 0
    lost = nvml_of(FakeGpu(gpm=HOPPER_GPM).fail("nvmlGpmSampleGet", "gpu_is_lost"))
    with pytest.raises(lost.NVMLError_GpuIsLost):  # not "unsupported": the reader fails
        reader(lost, 0)
    assert lost.calls["nvmlGpmSampleAlloc"] == 2 and lost.gpm_samples_live == 0
    clock = FakeClock()
    slices = nvml_of(FakeGpu(mig=[FakeGpu(gpm={"SM_UTIL": 10}), FakeGpu(gpm={"SM_UTIL": 70})]), clock=clock)  # fmt: skip
    second = slices.nvmlDeviceGetMigDeviceHandleByIndex(slices.nvmlDeviceGetHandleByIndex(0), 1)
    gpu = reader(slices, 0, handle=second)
    clock.advance(1)
    assert gpu.read()[0]["sm_active"] == 70  # the second slice's, not the first's nor the GPU's
    assert slices.calls["nvmlGpmMigSampleGet"] == 2 and slices.calls["nvmlGpmSampleGet"] == 0
    gpu.close()
    assert slices.gpm_samples_live == 0


# --------------------------------------------------------------------------- keys
def payload(node, gpus, boards=None, rank=0):
    return {"node": node, "rank": rank, "gpus": gpus, "boards": boards or {}}


def test_keys_per_gpu_then_aggregates_mig_energy_once_loop_figures_and_run_summary() -> None:
    payloads = [
        payload(0, {"cuda0": {"util_mean": 90.0, "energy_j": 10.0, "sample_ms": 1.0}}),
        payload(1, {"cuda0": {"util_mean": 30.0, "energy_j": 20.0, "sample_ms": 2.0}}),
        payload(1, {}),  # a rank whose NVML failed still takes part
    ]
    logged = flatten_epoch(payloads, "gpu", log_cost=False)
    assert logged["gpu/node0/cuda0/util_mean"] == 90 and logged["gpu/node1/cuda0/util_mean"] == 30
    assert (logged["gpu/all/util_mean_min"], logged["gpu/all/util_mean_max"]) == (30, 90)
    assert logged["gpu/all/util_mean_mean"] == 60 and logged["gpu/all/energy_j_sum"] == 30
    assert not any("sample_ms" in k for k in logged)
    assert "gpu/node1/cuda0/sample_ms" in flatten_epoch(payloads, "gpu", log_cost=True)
    one = flatten_epoch(payloads[:1], "gpu", False)  # one GPU: no aggregate copies of its keys
    assert one == {"gpu/node0/cuda0/util_mean": 90.0, "gpu/node0/cuda0/energy_j": 10.0}
    big = {f"cuda{i}": {"util_mean": float(i), "energy_j": 1.0} for i in range(16)}
    logged = flatten_epoch([payload(0, big), payloads[1]], "gpu", False, 8)
    assert not any(k.startswith("gpu/node0/") for k in logged)  # 16 > 8: aggregates only
    assert logged["gpu/node1/cuda0/util_mean"] == 30 and logged["gpu/all/util_mean_max"] == 30
    assert logged["gpu/all/util_mean_min"] == 0 and logged["gpu/all/energy_j_sum"] == 36
    assert len(flatten_epoch([payload(0, big)], "gpu", False, 16)) > len(logged)
    boards = {"cuda0": "GPU-a", "cuda1": "GPU-a"}  # two slices of one physical GPU
    gpus = {"cuda0": {"energy_j": 10.0}, "cuda1": {"energy_j": 10.0}}
    other = payload(0, {"cuda0": {"energy_j": 5.0}}, {"cuda0": "GPU-b"}, rank=1)
    assert flatten_epoch([payload(0, gpus, boards), other], "gpu", False)["gpu/all/energy_j_sum"] == 15  # fmt: skip
    monitor = GpuStatsMonitor()
    monitor._add_energy(  # the run's energy: every rank's cumulative counters, each board once
        [
            {**payload(0, {}, boards), "energy_total_j": {"cuda0": 100.0, "cuda1": 101.0}},
            {**payload(1, {}, {"cuda0": "GPU-a"}), "energy_total_j": {"cuda0": 99.0}},
        ]
    )
    assert monitor.run_energy_j() == {"node0/cuda0": 100.0}
    loops = [
        {"loop_s": 10.0, "data_wait_s": 2.0, "samples": 100.0},
        {"loop_s": 10.0, "data_wait_s": 5.0, "samples": 100.0},
        None,  # a rank that ran no step
    ]  # the slowest rank's share; the run's throughput
    assert flatten_loop(loops) == {"loop/data_wait_frac": 0.5, "loop/samples_per_s": 20.0}
    assert flatten_loop([None]) == {}
    assert "loop/samples_per_s" not in flatten_loop([{"loop_s": 1.0, "data_wait_s": 0.0}])
    summary = RunSummary()  # GPM means weighted by samples
    summary.add_epoch([payload(0, {"cuda0": {"sm_active_mean": 10.0, "samples": 1.0}})])
    summary.add_epoch([payload(0, {"cuda0": {"sm_active_mean": 40.0, "samples": 3.0}})])
    (row,) = summary.rows([])
    assert row["sm_active_mean"] == pytest.approx((10 + 120) / 4) and row["util_mean"] is None


# --------------------------------------------------------------------------- energy state
@pytest.mark.parametrize(
    "state",
    [{"energy_j": {"node0/cuda0": float("nan")}}, {"energy_j": "lots"}, "garbage",
     {"energy_j": {}, "train_samples": -3}],
)  # fmt: skip
def test_a_damaged_checkpoint_state_is_one_line_and_ignored(state, caplog) -> None:
    monitor = GpuStatsMonitor()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monitor.load_state_dict(state)
    assert monitor.run_energy_j() == {} and monitor.run_samples() == 0
    assert [r.getMessage() for r in caplog.records] == [
        "gpu_stats: the checkpoint's GPU statistics state is not what this callback writes "
        f"({state!r:.80}); the run's energy counts from this resume on"
    ]


def test_energy_report_from_a_resumed_run_with_or_without_samples() -> None:
    def report(state: dict) -> dict | None:
        monitor = GpuStatsMonitor()
        monitor.load_state_dict(state)
        return energy_report(SimpleNamespace(callbacks=[object(), monitor]))

    per_gpu = {"node0/cuda0": 7200.0, "node0/cuda1": 1800.0}
    assert report({"energy_j": per_gpu, "train_samples": 900}) == {
        "energy_j": 9000.0, "energy_kwh": 9000.0 / 3.6e6, "energy_j_per_training_sample": 10.0,
        "training_samples": 900, "energy_j_per_gpu": per_gpu,
    }  # fmt: skip
    unknown = report({"energy_j": {"node0/cuda0": 0.1234567}, "train_samples": None})
    assert unknown["energy_j"] == 0.123 and unknown["energy_j_per_gpu"] == {"node0/cuda0": 0.123}
    assert unknown["energy_j_per_training_sample"] is None and unknown["training_samples"] is None
    assert report({"energy_j": {"a": 5.0}, "train_samples": 0})["energy_j_per_training_sample"] is None  # fmt: skip
    assert report({}) is None and energy_report(SimpleNamespace(callbacks=[])) is None


@pytest.mark.gpu
def test_real_gpm_on_a_hopper_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with an NVIDIA driver (torch.cuda.is_available() is False)")
    nvml.use_library(None)
    with nvml.nvml_session() as lib:
        found = nvml.find_handle(lib, str(torch.cuda.get_device_properties(0).uuid))
        assert found is not None
        gpu = GpuReader(lib, found[0], "cuda0", DEFAULT_GROUPS)
        try:
            if "gpm" not in gpu.groups:
                pytest.skip(f"GPM is not supported here ({gpu.unsupported.get('gpm')})")
            a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
            end = time.monotonic() + 1.0
            while time.monotonic() < end:  # tensor-core work for a second
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
            values, _ = gpu.read()
        finally:
            gpu.close()
    assert 0 < values["sm_active"] <= 100 and 0 < values["tensor_active"] <= 100
    assert 0 <= values["sm_occupancy"] <= 100 and 0 <= values["dram_active"] <= 100
