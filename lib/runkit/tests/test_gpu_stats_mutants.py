"""GPU statistics at their edges: a metric that stops being supported after the probe, and more.

Each test pins one behaviour that a small change to ``machinery/gpu_stats/`` would break
(``make mutate MODULE=gpu_stats``). NVML is the fake; its clock is driven by hand.
"""

from __future__ import annotations

import logging

import pytest

from runkit.gpu_stats.callback import (
    GpuStatsMonitor,
    cuda_device_uuid,
    energy_report,
    gpu_busy_pct,
)
from runkit.gpu_stats.sampler import TRAIN, GpuReader, GpuSampler
from runkit.testing.fake_nvml import FakeClock, FakeGpu, FakeNvml

LOGGER = "runkit.gpu_stats"


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

        sampler = GpuSampler([reader], interval_s=1.0)
        sampler.set_phase(TRAIN)  # t=0
        clock.set(1)
        sampler.sample_now()  # power still read
        clock.set(2)
        with caplog.at_level(logging.INFO, logger=LOGGER):
            sampler.sample_now()  # power refused: dropped, told once
            clock.set(3)
            sampler.sample_now()
        summary = sampler.collect(TRAIN, sample=False)["cuda0"]
    finally:
        fake.nvmlShutdown()
    assert reader.groups == ["utilization", "temperature"]
    assert reader.unsupported == {"power": "NotSupported"}
    assert reader.dead is None  # the GPU itself is fine: sampling goes on
    assert summary["samples"] == 3 and summary["util_mean"] == 40 and summary["temp_c_max"] == 50
    # the metric keeps only the samples it had (one), never a zero for the others
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


# --------------------------------------------------------------------------- optional groups


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


# --------------------------------------------------------------------------- PyTorch's peaks


def test_torch_peaks_are_kept_per_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from runkit.gpu_stats.sampler import GIB, TorchPeakMemory

    peaks = {"alloc": 0.0, "reserved": 0.0}
    resets: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peaks["alloc"] * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: peaks["reserved"] * GIB)

    def reset(device: torch.device) -> None:
        resets.append(device)
        peaks.update(alloc=0.0, reserved=0.0)

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    memory = TorchPeakMemory({"cuda0": torch.device("cuda", 0), "cpu": torch.device("cpu")})
    assert list(memory.devices) == ["cuda0"]  # CPU devices have no CUDA peaks
    memory.clear()
    peaks.update(alloc=3.0, reserved=4.0)  # training
    memory.stash()  # validation starts: training's peaks kept aside
    peaks.update(alloc=1.0, reserved=5.0)  # validation
    assert memory.peaks(include_carry=False) == {
        "cuda0": {"torch_peak_alloc_gib": 1.0, "torch_peak_reserved_gib": 5.0}
    }
    memory.restart()
    peaks.update(alloc=2.0, reserved=1.0)  # training again
    assert memory.peaks(include_carry=True) == {
        "cuda0": {"torch_peak_alloc_gib": 3.0, "torch_peak_reserved_gib": 4.0}
    }
    memory.clear()
    assert memory.peaks(include_carry=True) == {
        "cuda0": {"torch_peak_alloc_gib": 0.0, "torch_peak_reserved_gib": 0.0}
    }
    assert resets == [torch.device("cuda", 0)] * 4


# --------------------------------------------------------------------------- the run's energy


def monitor_with(state: dict) -> GpuStatsMonitor:
    monitor = GpuStatsMonitor()
    monitor.load_state_dict(state)
    return monitor


def test_energy_report_from_a_resumed_run() -> None:
    from types import SimpleNamespace

    monitor = monitor_with(
        {"energy_j": {"node0/cuda0": 7200.0, "node0/cuda1": 1800.0}, "train_samples": 900}
    )
    report = energy_report(SimpleNamespace(callbacks=[object(), monitor]))
    assert report == {
        "energy_j": 9000.0,
        "energy_kwh": 9000.0 / 3.6e6,
        "energy_j_per_training_sample": 10.0,
        "training_samples": 900,
        "energy_j_per_gpu": {"node0/cuda0": 7200.0, "node0/cuda1": 1800.0},
    }
    assert monitor.state_dict() == {
        "version": 1,
        "energy_j": {"node0/cuda0": 7200.0, "node0/cuda1": 1800.0},
        "train_samples": 900.0,
    }


def test_energy_report_without_samples_or_energy() -> None:
    from types import SimpleNamespace

    unknown = monitor_with({"energy_j": {"node0/cuda0": 0.1234567}, "train_samples": None})
    report = energy_report(SimpleNamespace(callbacks=[unknown]))
    assert report is not None
    assert report["energy_j"] == 0.123 and report["energy_j_per_gpu"] == {"node0/cuda0": 0.123}
    assert report["energy_j_per_training_sample"] is None and report["training_samples"] is None
    none_yet = monitor_with({"energy_j": {"node0/cuda0": 5.0}, "train_samples": 0})
    assert (
        energy_report(SimpleNamespace(callbacks=[none_yet]))["energy_j_per_training_sample"] is None
    )
    assert energy_report(SimpleNamespace(callbacks=[GpuStatsMonitor()])) is None
    assert energy_report(SimpleNamespace(callbacks=[])) is None


@pytest.mark.parametrize(
    "state",
    [
        [],
        {"energy_j": [1.0]},
        {"energy_j": {1: 1.0}},
        {"energy_j": {"a": -1.0}},
        {"energy_j": {"a": float("nan")}},
        {"energy_j": {"a": True}},
        {"energy_j": {"a": "1"}},
        {"energy_j": {}, "train_samples": -1},
        {"energy_j": {}, "train_samples": float("inf")},
        {"energy_j": {}, "train_samples": False},
    ],
    ids=lambda s: repr(s)[:40],
)
def test_a_damaged_energy_state_is_ignored_in_one_line(
    state: object, caplog: pytest.LogCaptureFixture
) -> None:
    monitor = GpuStatsMonitor()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monitor.load_state_dict(state)  # type: ignore[arg-type]
    assert monitor.run_energy_j() == {} and monitor.run_samples() == 0.0
    assert [r.getMessage() for r in caplog.records] == [
        "gpu_stats: the checkpoint's GPU statistics state is not what this callback writes "
        f"({state!r:.80}); the run's energy counts from this resume on"
    ]


def test_a_fresh_state_loads_and_zero_is_a_valid_reading() -> None:
    monitor = monitor_with({"energy_j": {"node0/cuda0": 0, "node1/cuda0": 2}, "train_samples": 0})
    assert monitor.run_energy_j() == {"node0/cuda0": 0.0, "node1/cuda0": 2.0}
    assert monitor.run_samples() == 0.0


# --------------------------------------------------------------------------- helpers


def test_gpu_busy_is_the_mean_utilisation_or_sm_activity() -> None:
    everyone = [
        {"gpus": {"cuda0": {"util_mean": 20.0}, "cuda1": {"sm_active_mean": 60.0}}},
        {"gpus": {"cuda0": {"util_mean": 40.0, "sm_active_mean": 99.0}, "cuda1": {}}},
        {},
    ]
    assert gpu_busy_pct(everyone) == pytest.approx((20 + 60 + 40) / 3)
    assert gpu_busy_pct([{"gpus": {"cuda0": {}}}]) is None
    assert gpu_busy_pct([]) is None


def test_cuda_device_uuid_is_the_properties_uuid_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid as uuid_module

    import torch

    value = uuid_module.UUID("12345678-1234-5678-1234-567812345678")
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: type("P", (), {"uuid": value})()
    )
    assert cuda_device_uuid(0) == "12345678-1234-5678-1234-567812345678"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: object())
    assert cuda_device_uuid(0) is None
