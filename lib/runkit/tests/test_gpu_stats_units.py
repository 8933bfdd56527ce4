"""GPU statistics, part by part, in milliseconds: the readers, the sampler, GPM pairs, the
statistics and key scheme, the loop timer, the end-of-run report and the exchange between ranks.

NVML is the fake, on a clock driven by hand; ``test_gpu_stats.py`` drives the callback.
"""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
import torch

from runkit.gpu_stats.callback import count_samples
from runkit.gpu_stats.exchange import RankExchange
from runkit.gpu_stats.gpm import GpmCounters, GpmUnsupported
from runkit.gpu_stats.loop import LoopTimer, batch_length
from runkit.gpu_stats.report import RunSummary, print_table
from runkit.gpu_stats.sampler import (
    DEFAULT_GROUPS,
    GIB,
    THROTTLE_MASKS,
    GpuReader,
    GpuSampler,
    Phase,
)
from runkit.gpu_stats.statistics import GpuAccumulator, RunningStat, flatten_epoch, flatten_loop
from runkit.testing.fake_nvml import FakeClock, FakeGpu, FakeNvml, FakeProcess

LOGGER = "runkit.gpu_stats"
SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap


# --------------------------------------------------------------------------- readers
def test_a_readers_identity_and_values_in_their_units() -> None:
    gpu = FakeGpu(
        name="G",
        memory_total=16 * GIB,
        memory_used=4 * GIB,
        util_gpu=40,
        util_memory=30,
        temperature=61,
        power_mw=250_000,
        power_limit_mw=500_000,
        clock_sm_mhz=1500,
        clocks_event_reasons=0,
        processes=[FakeProcess("self", GIB), FakeProcess("self", 2 * GIB), FakeProcess(1, GIB)],
    )
    fake = opened_fake([FakeGpu(), gpu])
    reader = GpuReader(fake, fake.nvmlDeviceGetHandleByIndex(1), "cuda3", [
        "utilization", "memory", "process_memory", "temperature", "power", "clock", "throttle",
    ])  # fmt: skip
    reader.probe()
    assert reader.identity() == {
        "label": "cuda3",
        "name": "G",
        "uuid": gpu.uuid,
        "nvml_index": 1,
        "pci_bus_id": gpu.pci_bus_id,
        "mig": False,
        "board_uuid": gpu.uuid,
        "unsupported": [],
    }
    assert fake.calls["nvmlDeviceGetEnforcedPowerLimit"] + fake.calls[
        "nvmlDeviceGetPowerManagementLimit"
    ] == 1  # fmt: skip
    values, dropped = reader.read()
    assert dropped == []
    assert values == {
        "util": 40.0,
        "mem_util": 30.0,
        "mem_used_gib": 4.0,
        "mem_total_gib": 16.0,
        "proc_mem_gib": 3.0,  # this process's two entries; not pid 1's
        "temp_c": 61.0,
        "power_w": 250.0,
        "power_ratio": 0.5,
        "sm_clock_mhz": 1500.0,
        "throttle_power": 0.0,
        "throttle_thermal": 0.0,
        "throttle_hw": 0.0,
        "throttle_any": 0.0,
    }
    fake.nvmlShutdown()


def test_a_mig_slices_identity_names_its_board() -> None:
    parent = FakeGpu(name="A100", mig=[FakeGpu(name="slice")])
    fake = opened_fake([FakeGpu(), parent])
    handle = fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.nvmlDeviceGetHandleByIndex(1), 0)
    reader = GpuReader(fake, handle, "cuda0", ["memory", "energy"])
    reader.probe()
    identity = reader.identity()
    assert identity["mig"] is True and identity["name"] == "slice"
    assert identity["uuid"] == parent.mig[0].uuid and identity["board_uuid"] == parent.uuid
    assert identity["nvml_index"] == 1 and identity["unsupported"] == []
    fake.nvmlShutdown()


@pytest.mark.parametrize(
    ("reasons", "expected"),
    [
        (0x1, (0, 0, 0, 0)),  # GPU idle: not a throttle
        (THROTTLE_MASKS["throttle_hw"], (0, 0, 1, 1)),
        (0x4, (1, 0, 0, 1)),
        (0x80, (1, 0, 0, 1)),
        (0x20, (0, 1, 0, 1)),
        (0x40, (0, 1, 0, 1)),
        (0x4 | 0x40, (1, 1, 0, 1)),
    ],
)
def test_throttle_reasons_by_bit(reasons, expected) -> None:
    fake = opened_fake([FakeGpu(clocks_event_reasons=reasons)])
    reader = GpuReader(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda0", ["throttle"])
    values, _ = reader.read()
    order = ("throttle_power", "throttle_thermal", "throttle_hw", "throttle_any")
    assert tuple(values[k] for k in order) == expected
    fake.nvmlShutdown()


def test_what_the_probe_leaves_out_and_what_it_passes_on(monkeypatch) -> None:
    gpu = (
        FakeGpu(processes=[FakeProcess(1, GIB)])
        .fail("temperature", "no_permission")
        .fail("clock", "not_found")
        .fail("power_limit", "not_supported")
        .fail("nvmlGpmQueryDeviceSupport", "no_permission")
    )
    gpu.gpm = {"SM_UTIL": 1.0}
    fake = opened_fake([gpu])
    groups = ["gpm", "temperature", "clock", "power", "process_memory", "utilization"]
    reader = GpuReader(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda0", groups)
    monkeypatch.setattr(reader, "_read_utilization", lambda out: out.missing)
    reader.probe()
    assert reader.unsupported == {
        "gpm": "NoPermission",  # refused when asked whether it has GPM
        "temperature": "NoPermission",
        "clock": "NotFound",
        "utilization": "AttributeError",
    }
    assert reader.groups == ["power", "process_memory"] and groups[0] == "gpm"
    assert reader.gpm is None and fake.gpm_samples_live == 0
    values, dropped = reader.read()
    assert values == {"power_w": 70.0} and dropped == []  # no limit: no ratio; no own process
    failing = opened_fake([FakeGpu().fail("memory", "unknown")])
    other = GpuReader(failing, failing.nvmlDeviceGetHandleByIndex(0), "cuda0", ["memory"])
    with pytest.raises(failing.NVMLError_Unknown):
        other.probe()
    fake.nvmlShutdown()
    failing.nvmlShutdown()


def test_a_group_that_stops_working_is_dropped_but_a_failing_gpu_raises() -> None:
    clock = FakeClock()
    gpu = FakeGpu().fail("pcie", "function_not_found", start=1.0).fail("ecc", "unknown", start=2.0)
    fake = opened_fake([gpu], clock)
    reader = GpuReader(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda0", ["pcie", "ecc", "fan"])
    reader.probe()
    assert reader.groups == ["pcie", "ecc"] and reader.unsupported == {"fan": "NotSupported"}
    clock.set(1.0)
    values, dropped = reader.read()
    assert values == {"ecc_uncorrected": 0.0} and dropped == ["pcie"]
    assert reader.unsupported == {"fan": "NotSupported", "pcie": "FunctionNotFound"}
    clock.set(2.0)
    with pytest.raises(fake.NVMLError_Unknown):
        reader.read()
    fake.nvmlShutdown()


def test_what_a_reader_says_when_its_index_bus_or_gpm_is_missing(caplog) -> None:
    clock = FakeClock()
    gpu = FakeGpu(gpm={"SM_UTIL": 5}).fail("index", "not_supported").fail("pci", "not_supported")
    fake = opened_fake([gpu, FakeGpu()], clock)
    reader = GpuReader(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda4", ["gpm", "fan", "pcie"])
    reader.probe()
    identity = reader.identity()
    assert identity["nvml_index"] is None and identity["pci_bus_id"] is None
    assert reader.unsupported == {"fan": "NotSupported"}  # probed after GPM
    plain = GpuReader(fake, fake.nvmlDeviceGetHandleByIndex(1), "cuda5", ["gpm"])
    plain.probe()
    assert plain.unsupported == {"gpm": "NotSupported"} and plain.groups == []
    gpu.fail("nvmlGpmSampleGet", "in_use")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        clock.set(1.0)
        reader.read()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("gpu_stats: cuda4: GPM refused (InUse)")
    reader.close()
    fake.nvmlShutdown()


def test_groups_dropped_together_are_named_together(caplog) -> None:
    clock = FakeClock()
    gpu = FakeGpu().fail("pcie", "not_supported", start=1.0).fail("ecc", "not_supported", start=1.0)
    fake = opened_fake([gpu], clock)
    sampler = sampler_on(fake, ["pcie", "ecc", "temperature"])
    clock.set(1.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sampler.sample_now()
    assert [r.getMessage() for r in caplog.records] == [
        "gpu_stats: cuda0 no longer reports pcie, ecc; left out"
    ]
    fake.nvmlShutdown()


def probed(fake: FakeNvml, index: int, groups: list[str]) -> GpuReader:
    reader = GpuReader(fake, fake.nvmlDeviceGetHandleByIndex(index), f"cuda{index}", groups)
    reader.probe()
    return reader


def test_a_metric_that_stops_being_supported_after_the_probe_is_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    gpu = FakeGpu(util_gpu=40, power_mw=300_000, power_limit_mw=600_000, temperature=50)
    gpu.fail("power", "not_supported", start=2.0)  # supported at the probe (t=0), not from t=2
    fake = FakeNvml([gpu], clock=clock)
    fake.nvmlInit()
    try:
        reader = probed(fake, 0, ["utilization", "power", "temperature"])
        assert reader.groups == ["utilization", "power", "temperature"]
        assert reader.unsupported == {}
        values, dropped = reader.read()
        assert values["power_w"] == 300.0 and values["power_ratio"] == 0.5 and dropped == []

        sampler, phase = GpuSampler([reader], interval_s=1.0), Phase()
        sampler.begin(phase)
        sampler.sample_now()  # t=0
        clock.set(1)
        sampler.sample_now()  # power still read
        clock.set(2)
        with caplog.at_level(logging.INFO, logger=LOGGER):
            sampler.sample_now()  # power refused: dropped, told once
            clock.set(3)
            sampler.sample_now()
        summary = phase.figures()["cuda0"]
    finally:
        fake.nvmlShutdown()
    assert reader.groups == ["utilization", "temperature"]
    assert reader.unsupported == {"power": "NotSupported"}
    assert reader.dead is None  # the GPU itself is fine: sampling goes on
    assert summary["samples"] == 4 and summary["util_mean"] == 40 and summary["temp_c_max"] == 50
    # the metric keeps only the samples it had (two), never a zero for the others
    assert summary["power_w_mean"] == 300.0 and summary["power_w_max"] == 300.0
    dropped_lines = [
        r.getMessage() for r in caplog.records if "no longer reports" in r.getMessage()
    ]
    assert dropped_lines == ["gpu_stats: cuda0 no longer reports power; left out"]


def test_a_metric_refused_at_the_probe_is_never_read_again() -> None:
    gpu = FakeGpu(fan_pct=None)
    fake = FakeNvml([gpu], clock=lambda: 0.0)
    fake.nvmlInit()
    try:
        reader = probed(fake, 0, ["fan", "utilization"])
        fake.reset_counters()
        values, dropped = reader.read()
    finally:
        fake.nvmlShutdown()
    assert reader.unsupported == {"fan": "NotSupported"} and reader.groups == ["utilization"]
    assert "fan_pct" not in values and dropped == []
    assert fake.calls["nvmlDeviceGetFanSpeed"] == 0


def test_optional_groups_are_read_in_their_units() -> None:
    gpu = FakeGpu(
        fan_pct=60, pcie_tx_kbs=2048, pcie_rx_kbs=512, ecc_uncorrected=3, memory_temperature=80
    )
    fake = FakeNvml([gpu], clock=lambda: 0.0)
    fake.nvmlInit()
    try:
        reader = probed(fake, 0, ["fan", "pcie", "ecc", "memory_temperature"])
        values, dropped = reader.read()
    finally:
        fake.nvmlShutdown()
    assert dropped == [] and reader.unsupported == {}
    assert values == {
        "fan_pct": 60.0,
        "pcie_tx_mbs": 2.0,
        "pcie_rx_mbs": 0.5,
        "ecc_uncorrected": 3.0,
        "mem_temp_c": 80.0,
    }


# --------------------------------------------------------------------------- the sampler
def open_reader(fake: FakeNvml, index: int, groups=DEFAULT_GROUPS) -> GpuReader:
    handle = fake.nvmlDeviceGetHandleByIndex(index)
    reader = GpuReader(fake, handle, f"cuda{index}", groups)
    reader.probe()
    return reader


def test_epoch_statistics_are_exact_on_a_fake_clock() -> None:
    clock = FakeClock()
    fake = FakeNvml(
        [
            FakeGpu(
                util_gpu=[(0, 10), (2, 50), (4, 90)],
                util_memory=[(0, 20), (3, 40)],
                memory_used=[(0, 4 * GIB), (3, 8 * GIB)],
                memory_total=16 * GIB,
                temperature=[(0, 50), (1, 70)],
                power_mw=350_000,
                power_limit_mw=700_000,
                clock_sm_mhz=[(0, 1800), (3, 1200)],
                clocks_event_reasons=[(0, 0), (3, SW_POWER_CAP)],
                processes=[FakeProcess("self", [(0, GIB), (2, 3 * GIB)])],
            )
        ],
        clock=clock,
    )
    fake.nvmlInit()
    sampler = GpuSampler([open_reader(fake, 0)], interval_s=1.0)
    sampler.sample_now()  # before any phase: only primes the energy counter
    phase = Phase()
    sampler.begin(phase)  # t=0
    for _ in range(4):  # t=1, 2, 3, 4
        clock.advance(1)
        sampler.sample_now()
    summary = phase.figures()["cuda0"]
    assert summary["samples"] == 4
    assert summary["util_mean"] == pytest.approx((10 + 50 + 50 + 90) / 4)
    assert (summary["util_max"], summary["util_min"]) == (90, 10)
    assert summary["mem_util_mean"] == pytest.approx((20 + 20 + 40 + 40) / 4)
    assert summary["mem_used_gib_mean"] == pytest.approx((4 + 4 + 8 + 8) / 4)
    assert summary["mem_used_gib_max"] == 8 and summary["mem_total_gib"] == 16
    assert summary["proc_mem_gib_mean"] == pytest.approx((1 + 3 + 3 + 3) / 4)
    assert (summary["temp_c_mean"], summary["temp_c_max"]) == (70, 70)
    assert summary["power_w_mean"] == 350 and summary["power_ratio_max"] == 0.5
    assert summary["sm_clock_mhz_min"] == 1200
    assert summary["sm_clock_mhz_mean"] == pytest.approx((1800 + 1800 + 1200 + 1200) / 4)
    assert summary["throttle_power_frac"] == pytest.approx(2 / 4)
    assert summary["throttle_any_frac"] == pytest.approx(2 / 4)
    assert summary["throttle_thermal_frac"] == 0
    assert summary["energy_j"] == pytest.approx(350 * 4)  # 350 W for the 4 s of the phase
    fake.nvmlShutdown()


def test_unsupported_metrics_are_left_out_never_zero() -> None:
    mig_parent = FakeGpu(name="A100", mig=[FakeGpu(name="A100 MIG 1g.10gb", memory_total=10 * GIB)])
    datacenter = FakeGpu(fan_pct=None).fail("power", "not_supported")
    datacenter.fail("nvmlDeviceGetCurrentClocksEventReasons", "function_not_found")  # old driver
    fake = FakeNvml([datacenter, mig_parent])
    fake.nvmlInit()
    groups = [*DEFAULT_GROUPS, "fan", "memory_temperature"]
    plain = open_reader(fake, 0, groups)
    mig_handle = fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.nvmlDeviceGetHandleByIndex(1), 0)
    mig = GpuReader(fake, mig_handle, "cuda1", groups)
    mig.probe()
    assert set(plain.unsupported) == {"power", "fan", "memory_temperature", "gpm"}  # no GPM here
    assert "throttle" in plain.groups  # fell back to nvmlDeviceGetCurrentClocksThrottleReasons
    assert set(mig.unsupported) == {"utilization", "fan", "memory_temperature", "gpm"}
    assert mig.is_mig and mig.nvml_index == 1  # whole-GPU values come from the parent
    sampler, phase = GpuSampler([plain, mig], interval_s=1.0), Phase()
    sampler.begin(phase)
    sampler.sample_now()
    out = phase.figures()
    assert not any(k.startswith(("power", "fan", "mem_temp")) for k in out["cuda0"])
    assert "throttle_any_frac" in out["cuda0"] and "temp_c_mean" in out["cuda0"]
    assert not any(k.startswith(("util", "mem_util", "fan")) for k in out["cuda1"])
    assert out["cuda1"]["mem_total_gib"] == 10 and "power_w_mean" in out["cuda1"]
    fake.nvmlShutdown()


def test_gpu_lost_mid_run_warns_once_and_the_others_continue(caplog) -> None:
    clock = FakeClock()
    fake = FakeNvml([FakeGpu(util_gpu=30), FakeGpu(util_gpu=60).lose(at=2.0)], clock=clock)
    fake.nvmlInit()
    sampler = GpuSampler([open_reader(fake, 0), open_reader(fake, 1)], interval_s=1.0)
    phase = Phase()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sampler.begin(phase)
        for _ in range(4):
            clock.advance(1)
            sampler.sample_now()
    out = phase.figures()
    # samples at t = 1, 2, 3, 4; the lost GPU only has t = 1
    assert out["cuda0"]["samples"] == 4 and out["cuda0"]["util_mean"] == 30
    assert out["cuda1"]["samples"] == 1 and out["cuda1"]["util_mean"] == 60
    lost = [r for r in caplog.records if "stopped sampling cuda1" in r.message]
    assert len(lost) == 1 and "GpuIsLost" in lost[0].message
    assert [r.label for r in sampler.alive] == ["cuda0"]
    fake.nvmlShutdown()


def sampler_on(fake: FakeNvml, groups: list[str], count: int = 1) -> GpuSampler:
    readers = []
    for i in range(count):
        reader = GpuReader(fake, fake.nvmlDeviceGetHandleByIndex(i), f"cuda{i}", groups)
        reader.probe()
        readers.append(reader)
    return GpuSampler(readers, interval_s=1.0)


def test_a_reading_counts_for_the_phase_current_as_it_begins_and_energy_for_the_run() -> None:
    clock = FakeClock()
    fake = opened_fake([FakeGpu(power_mw=100_000, util_gpu=[(0, 10), (3, 30)])], clock)
    sampler = sampler_on(fake, ["utilization", "energy"])
    assert sampler.phase is None and sampler.energy_totals_j() == {}
    sampler.sample_now()  # t=0, no phase: primes the counter
    clock.set(2.0)
    sampler.sample_now()  # no phase still: counts for the run, not for a phase
    assert sampler.energy_totals_j() == {"cuda0": pytest.approx(200.0)}
    train, val = Phase(), Phase()
    sampler.begin(train)
    assert not sampler.settled(train) and train.figures() == {}
    clock.set(3.0)
    sampler.sample_now()
    assert sampler.settled(train) and not sampler.settled(val)
    sampler.begin(val)
    clock.set(6.0)
    sampler.sample_now()
    sampler.begin(train)  # training goes on
    clock.set(7.0)
    sampler.sample_now()
    assert train.figures()["cuda0"]["samples"] == 2 and train.figures()["cuda0"]["util_mean"] == 30
    assert train.figures()["cuda0"]["energy_j"] == pytest.approx(100.0 * 2)  # 2..3 and 6..7
    assert val.figures()["cuda0"] == {
        "util_mean": 30.0, "util_max": 30.0, "util_min": 30.0, "mem_util_mean": 0.0,
        "mem_util_max": 0.0, "energy_j": pytest.approx(300.0), "samples": 1.0,
        "sample_ms": pytest.approx(val.figures()["cuda0"]["sample_ms"]),
    }  # fmt: skip
    assert 0.0 <= val.figures()["cuda0"]["sample_ms"] < 1000.0
    assert sampler.energy_totals_j() == {"cuda0": pytest.approx(700.0)}
    fake.nvmlShutdown()


def test_a_phase_that_begins_gets_a_reading_at_once_and_none_is_awaited_after_the_end() -> None:
    fake = opened_fake([FakeGpu(util_gpu=40, gpm={"SM_UTIL": 5})], clock=None)
    sampler = sampler_on(fake, ["utilization", "gpm"])
    sampler.interval_s = 1000.0  # no reading but the first and those a phase asks for
    sampler.start()
    thread = sampler._thread
    assert thread.name == "gpu-stats-sampler" and thread.daemon
    for _ in range(2):  # a phase is settled by the reading its start asked for
        phase = Phase()
        sampler.begin(phase)
        assert sampler.settled(phase, wait=True)
        assert phase.figures()["cuda0"]["util_mean"] == 40.0
    sampler.stop()
    assert not thread.is_alive() and fake.gpm_samples_live == 0  # the readers are closed
    late = Phase()
    sampler.begin(late)
    assert sampler.settled(late) and late.figures() == {}  # no reading will come: none awaited
    fake.nvmlShutdown()


def test_the_thread_ends_when_every_gpu_is_lost_and_says_so_once(caplog) -> None:
    clock = FakeClock()
    fake = opened_fake([FakeGpu().lose(at=1.0)], clock)
    sampler = sampler_on(fake, ["utilization"])
    clock.set(1.0)
    phase = Phase()
    sampler.begin(phase)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sampler.start()
        sampler._thread.join(timeout=10)
    assert not sampler._thread.is_alive() and sampler.alive == []
    assert sampler.settled(phase) and phase.figures() == {}
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("gpu_stats: stopped sampling cuda0") and "training continues" in line
    sampler.stop()
    fake.nvmlShutdown()


def test_torch_peaks_per_device_across_two_validations(monkeypatch) -> None:
    from runkit.gpu_stats.sampler import TorchPeakMemory

    alloc = {0: 0.5, 1: 0.25}
    reserved = {0: 0.75, 1: 0.5}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: alloc[d.index] * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: reserved[d.index] * GIB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: None)
    memory = TorchPeakMemory({"cuda0": torch.device("cuda", 0), "cuda1": torch.device("cuda", 1)})
    memory.clear()
    memory.stash()  # validation 1 starts: training so far 0.5/0.75 and 0.25/0.5
    alloc.update({0: 0.125, 1: 0.125})
    reserved.update({0: 0.875, 1: 0.125})
    memory.stash()  # validation 2 starts
    assert memory.peaks(include_carry=True) == {
        "cuda0": {"torch_peak_alloc_gib": 0.5, "torch_peak_reserved_gib": 0.875},
        "cuda1": {"torch_peak_alloc_gib": 0.25, "torch_peak_reserved_gib": 0.5},
    }


# --------------------------------------------------------------------------- GPM
def opened_fake(gpus: list[FakeGpu], clock: Any = None) -> FakeNvml:
    fake = FakeNvml(gpus, clock=clock or FakeClock())
    fake.nvmlInit()
    return fake


def test_gpm_counters_give_each_intervals_metrics_that_have_a_value(monkeypatch) -> None:
    clock = FakeClock()
    gpm = {"SM_UTIL": [(0, 20), (2, 80)], "FP16_UTIL": 5, "FP64_UTIL": 9, "DRAM_BW_UTIL": 1}
    fake = opened_fake([FakeGpu(gpm=gpm)], clock)
    counters = GpmCounters(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda0", None)
    assert counters.read() == {}  # not opened: no samples, no NVML call
    assert fake.calls["nvmlGpmSampleGet"] == 0
    counters.open()
    assert fake.gpm_samples_live == 2 and fake.calls["nvmlGpmSampleGet"] == 1
    clock.set(1.0)
    assert counters.read() == {
        "sm_active": 20.0, "dram_active": 1.0, "fp16_active": 5.0, "fp64_active": 9.0
    }  # fmt: skip
    real_get = fake.nvmlGpmMetricsGet

    def with_a_nan(request: Any) -> Any:  # NVML returns NaN for a metric it could not compute
        real_get(request)
        for i in range(request.numMetrics):
            if request.metrics[i].metricId == fake.NVML_GPM_METRIC_FP16_UTIL:
                request.metrics[i].value = float("nan")
        return request

    monkeypatch.setattr(fake, "nvmlGpmMetricsGet", with_a_nan)
    clock.set(3.0)
    values = counters.read()
    assert values == {"sm_active": 50.0, "dram_active": 1.0, "fp64_active": 9.0}
    assert all(type(v) is float for v in values.values())
    counters.close()
    assert fake.gpm_samples_live == 0 and counters.read() == {}
    counters.close()  # again: nothing to free
    fake.nvmlShutdown()


@pytest.mark.parametrize(
    ("gpu", "reason"),
    [
        (FakeGpu(), "NotSupported"),  # no GPM on this GPU
        (FakeGpu(gpm={"SM_UTIL": 1}).fail("gpm", "function_not_found"), "FunctionNotFound"),
        (FakeGpu(gpm={"SM_UTIL": 1}).fail("gpm", "not_supported"), "NotSupported"),
    ],
)
def test_gpm_unsupported_says_why_and_allocates_nothing(gpu, reason) -> None:
    fake = opened_fake([gpu])
    counters = GpmCounters(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda0", None)
    with pytest.raises(GpmUnsupported) as raised:
        counters.open()
    assert str(raised.value) == reason
    assert fake.calls["nvmlGpmSampleAlloc"] == 0
    fake.nvmlShutdown()


def test_gpm_missing_from_old_bindings_is_unsupported(monkeypatch) -> None:
    fake = opened_fake([FakeGpu(gpm={"SM_UTIL": 1})])

    def missing(handle: Any) -> Any:
        raise AttributeError("module 'pynvml' has no attribute 'nvmlGpmQueryDeviceSupport'")

    monkeypatch.setattr(fake, "nvmlGpmQueryDeviceSupport", missing)
    with pytest.raises(GpmUnsupported) as raised:
        GpmCounters(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda0", None).open()
    assert str(raised.value) == "AttributeError"
    fake.nvmlShutdown()


def test_gpm_failing_after_an_allocation_frees_the_samples(monkeypatch) -> None:
    fake = opened_fake([FakeGpu(gpm={"SM_UTIL": 1}).fail("nvmlGpmSampleGet", "gpu_is_lost")])
    counters = GpmCounters(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda0", None)
    with pytest.raises(fake.NVMLError_GpuIsLost):
        counters.open()
    assert fake.calls["nvmlGpmSampleAlloc"] == 2 and fake.gpm_samples_live == 0
    real_alloc = fake.nvmlGpmSampleAlloc

    def second_fails() -> Any:
        if fake.gpm_samples_live:
            raise fake.NVMLError_Memory()
        return real_alloc()

    monkeypatch.setattr(fake, "nvmlGpmSampleAlloc", second_fails)
    fake.gpus[0].heal("nvmlGpmSampleGet")
    counters = GpmCounters(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda0", None)
    with pytest.raises(fake.NVMLError_Memory):
        counters.open()
    assert fake.gpm_samples_live == 0
    fake.nvmlShutdown()


def test_gpm_refused_pauses_with_one_line_and_a_lost_gpu_is_passed_on(caplog) -> None:
    clock = FakeClock()
    gpu = FakeGpu(gpm={"SM_UTIL": 50})
    fake = opened_fake([gpu], clock)
    counters = GpmCounters(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda7", None)
    counters.open()
    gpu.fail("nvmlGpmSampleGet", "in_use", start=1.5)
    readings = []
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for t in (1, 2, 3, 4, 5, 6):
            clock.set(t)
            if t == 4:
                gpu.heal("nvmlGpmSampleGet")
            readings.append(counters.read())
    assert readings == [{"sm_active": 50.0}, {}, {}, {}, {"sm_active": 50.0}, {"sm_active": 50.0}]
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.INFO,
            "gpu_stats: cuda7: GPM refused (InUse); a profiler (DCGM, Nsight) may hold the "
            "counters. GPM figures pause and come back when it lets go",
        ),
        (logging.INFO, "gpu_stats: cuda7: GPM figures are back"),
    ]
    gpu.lose(at=7.0)
    clock.set(7.0)
    with pytest.raises(fake.NVMLError_GpuIsLost):
        counters.read()
    fake.nvmlShutdown()


def test_a_sample_that_cannot_be_freed_is_one_debug_line(monkeypatch, caplog) -> None:
    fake = opened_fake([FakeGpu(gpm={"SM_UTIL": 1})])
    counters = GpmCounters(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda0", None)
    counters.open()

    def refuse(sample: Any) -> None:
        raise fake.NVMLError_Uninitialized()

    monkeypatch.setattr(fake, "nvmlGpmSampleFree", refuse)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        counters.close()
    line = f"gpu_stats: cuda0: freeing a GPM sample failed: {fake.NVMLError_Uninitialized()}"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.DEBUG, line)] * 2
    fake.nvmlShutdown()


def test_gpm_of_a_mig_slice_is_its_own(caplog) -> None:
    clock = FakeClock()
    slices = [FakeGpu(gpm={"SM_UTIL": 10}), FakeGpu(gpm={"SM_UTIL": 70})]
    fake = opened_fake([FakeGpu(mig=slices)], clock)
    board = fake.nvmlDeviceGetHandleByIndex(0)
    reader = GpuReader(
        fake, fake.nvmlDeviceGetMigDeviceHandleByIndex(board, 1), "cuda0", ["gpm", "memory"]
    )
    reader.probe()
    clock.set(1.0)
    values, dropped = reader.read()
    assert values["sm_active"] == 70.0 and dropped == []
    assert fake.calls["nvmlGpmMigSampleGet"] == 2 and fake.calls["nvmlGpmSampleGet"] == 0
    reader.close()
    assert fake.gpm_samples_live == 0
    fake.nvmlShutdown()


def test_gpm_support_without_the_support_flag_or_a_metric_constant(monkeypatch) -> None:
    fake = opened_fake([FakeGpu(gpm={"SM_UTIL": 1})])
    monkeypatch.setattr(fake, "nvmlGpmQueryDeviceSupport", lambda handle: object())
    with pytest.raises(GpmUnsupported):
        GpmCounters(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda0", None).open()
    fake.nvmlShutdown()

    class OldBindings(FakeNvml):
        def __getattr__(self, name: str) -> Any:
            if name == "NVML_GPM_METRIC_FP64_UTIL":
                raise AttributeError(name)
            return super().__getattr__(name)

    clock = FakeClock()
    old = OldBindings([FakeGpu(gpm={"SM_UTIL": 3, "FP64_UTIL": 4})], clock=clock)
    old.nvmlInit()
    counters = GpmCounters(old, old.nvmlDeviceGetHandleByIndex(0), "cuda0", None)
    counters.open()
    clock.set(1.0)
    assert counters.read() == {"sm_active": 3.0}  # FP64 has no id in these bindings
    counters.close()
    old.nvmlShutdown()


# --------------------------------------------------------------------------- statistics
def test_running_stat_keeps_count_sum_extremes_and_last() -> None:
    stat = RunningStat()
    assert (stat.count, stat.total, stat.last) == (0, 0.0, 0.0)
    assert stat.low == float("inf") and stat.high == float("-inf")
    for value in (3.0, -1.0, 7.0, 2.0):
        stat.add(value)
    assert stat.count == 4 and stat.total == 11.0
    assert [stat.get(s) for s in ("mean", "frac", "max", "min", "last")] == [2.75, 2.75, 7, -1, 2]
    with pytest.raises(KeyError):
        stat.get("median")


def test_an_accumulators_summary_has_each_metrics_own_statistics() -> None:
    acc = GpuAccumulator()
    assert acc.summary() == {}
    acc.add({"util": 10.0, "mem_total_gib": 80.0, "throttle_any": 1.0, "new_metric": 4.0}, 0.002)
    acc.add({"util": 30.0, "mem_total_gib": 40.0, "throttle_any": 0.0, "new_metric": 6.0}, 0.004)
    acc.add_energy(1500.0)
    acc.add_energy(500.0)
    assert acc.summary() == {
        "util_mean": 20.0,
        "util_max": 30.0,
        "util_min": 10.0,
        "mem_total_gib": 40.0,  # "last"
        "throttle_any_frac": 0.5,
        "new_metric_mean": 5.0,  # a metric without a listed statistic: its mean
        "energy_j": 2.0,
        "samples": 2.0,
        "sample_ms": pytest.approx(3.0),
    }
    energy_only = GpuAccumulator()
    energy_only.add_energy(0.0)
    assert energy_only.summary() == {"energy_j": 0.0}  # a zero reading is a reading


def test_flatten_epoch_keys_per_node_label_and_the_aggregates() -> None:
    payloads = [
        {
            "node": 0,
            "gpus": {
                "cuda0": {"util_mean": 10.0, "temp_c_mean": 50.0, "energy_j": 4.0},
                "cuda1": {"util_mean": 50.0, "temp_c_mean": 70.0, "energy_j": 6.0},
            },
        },
        {"node": 1, "gpus": {"cuda0": {"util_mean": 30.0, "energy_j": 5.0, "sample_ms": 2.0}}},
        {"node": 1},  # a rank without GPU figures
    ]
    logged = flatten_epoch(payloads, "g", log_cost=True, per_gpu_keys_up_to=2)
    assert logged == {
        "g/node0/cuda0/util_mean": 10.0,
        "g/node0/cuda0/temp_c_mean": 50.0,
        "g/node0/cuda0/energy_j": 4.0,
        "g/node0/cuda1/util_mean": 50.0,
        "g/node0/cuda1/temp_c_mean": 70.0,
        "g/node0/cuda1/energy_j": 6.0,
        "g/node1/cuda0/util_mean": 30.0,
        "g/node1/cuda0/energy_j": 5.0,
        "g/node1/cuda0/sample_ms": 2.0,
        "g/all/util_mean_min": 10.0,
        "g/all/util_mean_mean": 30.0,
        "g/all/util_mean_max": 50.0,
        "g/all/energy_j_min": 4.0,
        "g/all/energy_j_mean": 5.0,
        "g/all/energy_j_max": 6.0,
        # temp_c_mean is not aggregated (temp_c_max is); cuda0 of two nodes: two boards
        "g/all/energy_j_sum": 15.0,
    }
    narrow = flatten_epoch(payloads, "g", log_cost=False, per_gpu_keys_up_to=1)
    assert not any(k.startswith("g/node0/") for k in narrow)  # 2 GPUs > 1
    assert narrow["g/node1/cuda0/util_mean"] == 30.0 and "g/node1/cuda0/sample_ms" not in narrow
    assert narrow["g/all/util_mean_max"] == 50.0
    assert not any(k.startswith("g/node") for k in flatten_epoch(payloads, "g", True, 0))
    no_energy = [{"node": 0, "gpus": {"a": {"util_mean": 1.0}, "b": {"util_mean": 3.0}}}]
    assert flatten_epoch(no_energy, "g", False) == {
        "g/node0/a/util_mean": 1.0,
        "g/node0/b/util_mean": 3.0,
        "g/all/util_mean_min": 1.0,
        "g/all/util_mean_mean": 2.0,
        "g/all/util_mean_max": 3.0,
    }


def test_flatten_loop_skips_ranks_without_a_loop() -> None:
    assert flatten_loop([]) == {}
    assert flatten_loop([{"loop_s": 0.0, "data_wait_s": 0.0, "samples": 1.0}]) == {}
    assert flatten_loop([{"data_wait_s": 1.0}]) == {}
    figures = flatten_loop(
        [
            {"loop_s": 4.0, "data_wait_s": 1.0, "samples": 8.0},
            {"loop_s": 0.0, "data_wait_s": 1.0},  # no loop time: left out, samples or not
            {"loop_s": 2.0, "data_wait_s": 0.2, "samples": 4.0},
        ]
    )
    assert figures == {"loop/data_wait_frac": 0.25, "loop/samples_per_s": 4.0}


def test_count_samples_of_every_rank() -> None:
    assert count_samples([{"samples": 3.0}, None, {"samples": 5.0}]) == 8.0
    assert count_samples([{"samples": 3.0}, {"loop_s": 1.0}]) is None
    assert count_samples([None]) == 0


# --------------------------------------------------------------------------- the loop timer
def test_batch_length_in_every_container() -> None:
    assert batch_length(torch.zeros(3, 2)) == 3
    assert batch_length(torch.zeros(0, 2)) == 0  # an empty batch has length 0, not "unknown"
    assert batch_length(torch.tensor(1.0)) is None
    assert batch_length((torch.tensor(1.0), torch.zeros(6))) == 6  # the first with a length
    assert batch_length([None, {"x": torch.zeros(2, 1)}]) == 2
    assert batch_length({"a": "text", "b": [torch.zeros(4)]}) == 4
    assert batch_length({}) is None and batch_length(()) is None and batch_length(7) is None
    assert batch_length("abc") is None


def test_batch_length_looks_into_dataclasses_and_says_once_when_a_batch_has_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from dataclasses import dataclass

    @dataclass
    class Points:
        x: torch.Tensor
        y: torch.Tensor

    class Opaque:
        pass

    assert batch_length(Points(torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_length(Points) is None  # the class itself is no batch
    timer = LoopTimer(clock=iter(range(100)).__next__)
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            timer.start_epoch()
            timer.batch_start()
            timer.batch_end(Opaque())
    summary = timer.summary()
    assert summary is not None and "samples" not in summary and summary["steps"] == 1
    said = [r.getMessage() for r in caplog.records if "holds no tensor" in r.getMessage()]
    assert said == [
        "loop: a training batch of type Opaque holds no tensor to count samples in; "
        "loop/samples_per_s is not logged (loop/data_wait_frac is)"
    ]


def test_loop_timer_pauses_once_and_resumes_only_after_a_pause() -> None:
    clock = FakeClock()
    clock.set(100.0)
    timer = LoopTimer(clock)
    assert timer.summary() is None
    clock.advance(1.0)
    timer.batch_start()  # waited 1 s
    clock.advance(2.0)
    timer.batch_end(torch.zeros(5))
    clock.advance(1.0)
    timer.pause()
    clock.advance(3.0)
    timer.pause()  # still the same validation: it started 3 s ago
    clock.advance(1.0)
    timer.batch_start()  # 4 s of validation since the last pause started; waited 1 s
    clock.advance(2.0)
    timer.batch_end({"x": torch.zeros(5)})
    # 10 s since the epoch start, less 4 s of validation (from the first pause to the batch)
    assert timer.summary() == {"loop_s": 6.0, "data_wait_s": 2.0, "steps": 2.0, "samples": 10.0}
    timer.batch_start()
    clock.advance(1.0)
    timer.batch_end("no tensor")
    summary = timer.summary()
    assert "samples" not in summary and summary["steps"] == 3.0
    timer.batch_start()
    timer.batch_end(torch.zeros(5))
    assert "samples" not in timer.summary()  # unknown for the rest of the epoch
    timer.start_epoch()
    assert timer.summary() is None and timer.samples == 0 and timer.wait_s == 0.0
    timer.batch_start()
    timer.batch_end(torch.zeros(2))
    assert timer.summary() == {"loop_s": 0.0, "data_wait_s": 0.0, "steps": 1.0, "samples": 2.0}


def test_loop_timer_adds_up_several_validations() -> None:
    clock = FakeClock()
    timer = LoopTimer(clock)
    for _ in range(2):  # two validations, each between two steps
        timer.batch_start()
        clock.advance(1.0)
        timer.batch_end(torch.zeros(1))
        timer.pause()
        clock.advance(5.0)
    timer.batch_start()
    clock.advance(1.0)
    timer.batch_end(torch.zeros(1))
    assert timer.summary() == {"loop_s": 3.0, "data_wait_s": 0.0, "steps": 3.0, "samples": 3.0}


def test_loop_timer_uses_the_wall_clock_by_default() -> None:
    timer = LoopTimer()
    timer.batch_start()
    timer.batch_end(torch.zeros(1))
    summary = timer.summary()
    assert 0.0 <= summary["data_wait_s"] <= summary["loop_s"] < 5.0


# --------------------------------------------------------------------------- the report
def test_run_summary_rows_over_epochs() -> None:
    summary = RunSummary()
    assert not summary and summary.rows([]) == []
    summary.add_epoch(
        [
            {
                "node": 1,
                "gpus": {
                    "cuda0": {
                        "util_mean": 20.0,
                        "samples": 1.0,
                        "mem_used_gib_max": 3.0,
                        "proc_mem_gib_max": 1.0,
                        "torch_peak_alloc_gib": 2.5,
                        "energy_j": 1000.0,
                        "sample_ms": 2.0,
                    }
                },
            },
            {"node": 0, "gpus": {"cuda3": {}}},
        ]
    )
    summary.add_epoch(
        [
            {
                "node": 1,
                "gpus": {
                    "cuda0": {
                        "util_mean": 60.0,
                        "samples": 3.0,
                        "mem_used_gib_max": 2.0,
                        "proc_mem_gib_max": 4.0,
                        "torch_peak_alloc_gib": 1.0,
                        "energy_j": 500.0,
                        "sample_ms": 4.0,
                    }
                },
            }
        ]
    )
    assert summary
    identities = [{"node": 1, "gpus": [{"label": "cuda0", "name": "H", "uuid": "GPU-x"}]}]
    first, second = summary.rows(identities)
    assert first == {
        "gpu": "node0/cuda3",
        "name": "?",
        "uuid": "?",
        "util_mean": None,
        "sm_active_mean": None,
        "sm_occupancy_mean": None,
        "tensor_active_mean": None,
        "dram_active_mean": None,
        "mem_used_gib_max": None,
        "torch_peak_alloc_gib": None,
        "energy_j": None,
        "samples": 0,
        "sample_ms": None,
    }
    assert second == {
        "gpu": "node1/cuda0",
        "name": "H",
        "uuid": "GPU-x",
        "util_mean": 50.0,  # (20 x 1 + 60 x 3) / 4
        "sm_active_mean": None,
        "sm_occupancy_mean": None,
        "tensor_active_mean": None,
        "dram_active_mean": None,
        "mem_used_gib_max": 3.0,
        "torch_peak_alloc_gib": 2.5,
        "energy_j": 1500.0,
        "samples": 4,
        "sample_ms": 3.5,
    }


ROW = {
    "gpu": "node0/cuda0", "name": "H", "util_mean": 1.0, "sm_active_mean": None,
    "sm_occupancy_mean": None, "tensor_active_mean": None, "dram_active_mean": None,
    "mem_used_gib_max": None, "torch_peak_alloc_gib": None, "energy_j": None, "samples": 1,
    "sample_ms": None,
}  # fmt: skip
TAIL = ["peak mem GiB", "torch peak GiB", "energy kJ", "samples", "NVML ms/sample"]


@pytest.mark.parametrize(
    ("columns", "changes", "gpm", "cells"),
    [
        ("200", {}, [], ["1.0", "n/a", "n/a", "n/a", "1", "n/a"]),
        (  # GPM columns only for the GPM figures some GPU has
            "250",
            {"sm_active_mean": 12.34, "tensor_active_mean": 5.0, "dram_active_mean": 7.0},
            ["SM active %", "tensor %", "DRAM bw %"],
            ["1.0", "12.3", "5.0", "7.0", "n/a", "n/a", "n/a", "1", "n/a"],
        ),
        (  # a log file: Rich would assume 80 columns, but a CI log or a SLURM .out has room
            None,
            {
                "name": "NVIDIA H100 80GB HBM3",
                "sm_occupancy_mean": 3.0,
                "mem_used_gib_max": 1.0,
                "torch_peak_alloc_gib": 0.5,
                "energy_j": 2000.0,
                "sample_ms": 0.25,
            },
            ["occupancy %"],
            ["1.0", "3.0", "1.00", "0.50", "2.00", "1", "0.25"],
        ),
    ],
)
def test_the_table_of_the_run(capsys, monkeypatch, columns, changes, gpm, cells) -> None:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    row = {**ROW, **changes}
    print_table([row])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].strip() == "GPU statistics over the run (training epochs)"
    assert columns or max(len(line) for line in lines) > 80  # not wrapped
    header = next(line for line in lines if "name" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == ["GPU", "name", "util %", *gpm,
                                                                  *TAIL]  # fmt: skip
    (line,) = [line.split("│") for line in lines if "node0" in line]
    assert [c.strip() for c in line[1:-1]] == ["node0/cuda0", row["name"], *cells]
    assert line[2].startswith(f" {row['name']} ") and line[3].endswith(" 1.0 ")  # left, right


# --------------------------------------------------------------------------- the exchange
def test_the_exchange_without_a_process_group_is_this_ranks_payload() -> None:
    thing = {"a": 1}
    exchange = RankExchange("epoch end")
    assert exchange.gather(SimpleNamespace(world_size=1, global_rank=0), thing) == [thing]
    not_initialised = SimpleNamespace(world_size=2, global_rank=0)
    assert exchange.gather(not_initialised, thing) == [thing]


@pytest.fixture
def store(tmp_path):
    """A real process group of one, whose key-value store stands in for a job's."""
    import torch.distributed as dist

    from runkit import compat

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        yield compat.default_store()
    finally:
        dist.destroy_process_group()


def test_the_exchange_hands_rank_0_every_ranks_payload_through_the_store(store) -> None:
    exchange = RankExchange("training epoch end", timeout_s=5)
    mine, theirs = {"gpus": {"cuda0": {"util_mean": 1.0}}}, {"gpus": {"cuda1": {"util_mean": 2.0}}}
    # Rank 1 posts and goes on at once: it never waits for anyone.
    rank1 = RankExchange("training epoch end", timeout_s=5)
    assert rank1.gather(SimpleNamespace(world_size=2, global_rank=1), theirs) == [theirs]
    gathered = exchange.gather(SimpleNamespace(world_size=2, global_rank=0), mine)
    assert gathered == [mine, theirs] and gathered[0] is mine and gathered[1] is not theirs
    assert not store.check(["runkit/training epoch end/1/1"])  # read, then removed


def test_a_rank_that_never_posts_costs_rank_0_the_timeout_and_one_warning(store, caplog) -> None:

    exchange = RankExchange("validation end", timeout_s=0.6)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        gathered = exchange.gather(SimpleNamespace(world_size=3, global_rank=0), {"node": 0})
    assert 0.5 < time.monotonic() - started < 5
    assert gathered == [{"node": 0}]
    (line,) = [r.getMessage() for r in caplog.records if "did not reach" in r.getMessage()]
    assert line == (
        "gpu_stats: rank 1,2 did not reach validation end within 1 s; its figures are left out "
        "this time (a rank held up elsewhere: look at that rank's log)"
    )
    # A late rank's payload, posted after rank 0 went on, is removed at the next round.
    store.set("runkit/validation end/1/2", "{}")
    with caplog.at_level(logging.WARNING):
        exchange.gather(SimpleNamespace(world_size=1, global_rank=0), {"node": 0})
        late = RankExchange("validation end", timeout_s=0.1)
        late._round, late._late = 1, ["runkit/validation end/1/2"]
        late.gather(SimpleNamespace(world_size=2, global_rank=0), {"node": 0})
    assert not store.check(["runkit/validation end/1/2"])


def test_a_late_ranks_payload_is_removed_once_it_arrives_and_a_run_of_one_keeps_no_round(
    store,
) -> None:
    exchange = RankExchange("training epoch end", timeout_s=0.1)
    assert exchange.gather(SimpleNamespace(world_size=1, global_rank=0), {"r": 0}) == [{"r": 0}]
    rank0 = SimpleNamespace(world_size=2, global_rank=0)
    assert exchange.gather(rank0, {"r": 0}) == [{"r": 0}]  # round 1: rank 1 late
    late = "runkit/training epoch end/1/1"
    exchange.gather(rank0, {"r": 0})  # round 2: still not posted, still remembered
    store.set(late, "{}")  # it arrives after rank 0 went on
    exchange.gather(rank0, {"r": 0})
    assert not store.check([late])


def test_with_every_rank_rank_0_posts_its_payload_for_the_others(store) -> None:
    mine, theirs = {"node": 0, "r": 0}, {"node": 0, "r": 1}
    store.set("runkit/validation end/1/1", json.dumps(theirs))
    rank0 = RankExchange("validation end", timeout_s=5)
    gathered = rank0.gather(SimpleNamespace(world_size=2, global_rank=0), mine, every_rank=True)
    assert gathered == [mine, theirs]
    assert json.loads(store.get("runkit/validation end/1/0")) == mine


def test_with_a_monitor_on_another_rank_every_rank_gets_every_payload(store) -> None:
    mine, theirs = {"node": 0, "r": 1}, {"node": 0, "r": 0}
    store.set("runkit/training epoch end/1/0", json.dumps(theirs))  # rank 0 posted already
    rank1 = RankExchange("training epoch end", timeout_s=5)
    gathered = rank1.gather(SimpleNamespace(world_size=2, global_rank=1), mine, every_rank=True)
    assert gathered == [theirs, mine]  # in rank order, rank 1 included
    assert store.check(["runkit/training epoch end/1/1"])  # posted for rank 0 to read
    assert store.check(["runkit/training epoch end/1/0"])  # the owner removes its own, later
    for _ in range(2):
        store.set(f"runkit/training epoch end/{rank1._round + 1}/0", "{}")
        rank1.gather(SimpleNamespace(world_size=2, global_rank=1), mine, every_rank=True)
    assert not store.check(["runkit/training epoch end/1/1"])  # two rounds on: removed
