"""GpuStatsMonitor as a user meets it: which GPU each device is, what its arguments accept,
what it says at setup, what its hooks log (on a stand-in trainer, the sampler's readings taken
by hand on a FakeClock), the run's energy, and real ``Trainer.fit`` runs (one process and DDP)
against the fake NVML, with ``device_uuids`` naming the fake GPU each CPU "device" is.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from runkit.gpu_stats import callback as gpu_callback
from runkit.gpu_stats.callback import (
    GpuStatsMonitor,
    cuda_device_uuid,
    energy_report,
    gpu_busy_pct,
    process_devices,
)
from runkit.gpu_stats.loop import LoopTimer
from runkit.gpu_stats.sampler import DEFAULT_GROUPS, GpuReader, GpuSampler
from runkit.gpus import nvml
from runkit.gpus.nvml import find_handle
from runkit.run import run_files
from runkit.testing.fake_nvml import GIB, FakeClock, FakeGpu, FakeNvml, FakeProcess

LOGGER = "runkit.gpu_stats"  # every module of the package logs under it
REPO = Path(__file__).resolve().parents[3]
HOPPER_GPM = {"SM_UTIL": 60, "SM_OCCUPANCY": 30, "ANY_TENSOR_UTIL": 20, "DRAM_BW_UTIL": 45}


@pytest.fixture
def no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """No sampling thread: the test takes the readings the thread would (:func:`read`)."""
    monkeypatch.setattr(GpuSampler, "start", lambda self: None)


def read(monitor: GpuStatsMonitor) -> None:
    """The sampler thread's next reading, taken now (for the phase current now)."""
    monitor._sampler.sample_now()


def visible_uuids(fake: FakeNvml, cuda_visible_devices: str | None, fastest_first: bool) -> list:
    """What CUDA would enumerate: a stand-in for the driver, so the test can say what torch sees.

    CUDA_DEVICE_ORDER=FASTEST_FIRST (CUDA's default) may order devices differently from NVML's
    PCI order; the fake's GPUs are identical, so "fastest first" is modelled as reversed order.
    """
    physical = [g.uuid for g in fake.gpus]
    if fastest_first:
        physical = physical[::-1]
    every = physical + [m.uuid for g in fake.gpus for m in g.mig]
    if cuda_visible_devices is None:
        chosen = physical
    else:
        chosen = []
        for item in cuda_visible_devices.split(","):
            chosen.append(
                physical[int(item)] if item.isdigit() else next(u for u in every if u == item)
            )
    return [u.split("-", 1)[1] for u in chosen]  # torch reports the bare UUID, no GPU-/MIG-


FOUR = FakeNvml(
    [FakeGpu(name=f"gpu{i}") for i in range(3)]
    + [FakeGpu(name="gpu3", mig=[FakeGpu(name="slice")])]
)


@pytest.mark.parametrize(
    ("cvd", "fastest_first", "expected"),
    [
        (None, False, ["gpu0", "gpu1", "gpu2", "gpu3"]),
        ("2,3", False, ["gpu2", "gpu3"]),  # cuda:0 is physical GPU 2, not NVML index 0
        ("3,1", False, ["gpu3", "gpu1"]),
        (f"{FOUR.gpus[2].uuid},{FOUR.gpus[0].uuid}", False, ["gpu2", "gpu0"]),
        (FOUR.gpus[3].mig[0].uuid, False, ["slice"]),
        ("0,1", True, ["gpu3", "gpu2"]),  # CUDA_DEVICE_ORDER=FASTEST_FIRST reorders
    ],
)
def test_torch_device_maps_to_the_right_nvml_device(
    monkeypatch: pytest.MonkeyPatch, cvd, fastest_first, expected
) -> None:
    uuids = visible_uuids(FOUR, cvd, fastest_first)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i], name="x")
    )
    FOUR.nvmlInit()
    try:
        names = []
        for index in range(len(uuids)):
            handle, nvml_uuid = find_handle(FOUR, cuda_device_uuid(index))
            assert nvml_uuid.startswith(("GPU-", "MIG-"))
            names.append(FOUR.nvmlDeviceGetName(handle))
    finally:
        FOUR.nvmlShutdown()
    assert names == expected


CUDA = [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.parametrize(
    ("devices", "world_size", "num_nodes", "local_rank", "expected"),
    [
        (CUDA, 1, 1, 0, list(enumerate(CUDA))),  # one process drives both (DataParallel-like)
        (CUDA, 2, 2, 0, list(enumerate(CUDA))),  # one process per node, several devices
        (CUDA, 2, 1, 1, [(1, CUDA[1])]),  # DDP: rank 1 drives parallel_devices[1] only
        (CUDA, 4, 2, 1, [(1, CUDA[1])]),
        (CUDA[1:], 2, 1, 1, [(0, CUDA[1])]),  # a local rank beyond the list: position 0
        (None, 1, 1, 0, [(0, CUDA[1])]),  # no parallel_devices: the root device
    ],
)
def test_each_process_samples_the_devices_it_drives(
    devices, world_size, num_nodes, local_rank, expected
) -> None:
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(parallel_devices=devices, root_device=CUDA[1]),
        world_size=world_size,
        num_nodes=num_nodes,
        local_rank=local_rank,
    )
    assert process_devices(trainer) == expected


def test_cuda_devices_are_found_by_uuid_and_get_pytorchs_peaks(
    monkeypatch, use_fake, no_thread
) -> None:
    clock = FakeClock()
    fake = use_fake(FakeNvml([FakeGpu(name="g0"), FakeGpu(name="g1", util_gpu=25)], clock=clock))
    bare = [g.uuid.split("-", 1)[1] for g in fake.gpus]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=bare[i])
    )
    peaks = {"alloc": 2.0, "reserved": 3.0}
    resets: list[Any] = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peaks["alloc"] * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: peaks["reserved"] * GIB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    monkeypatch.setattr(gpu_callback, "LoopTimer", lambda: LoopTimer(clock))
    cuda = torch.device("cuda")  # no index: the current device, 1
    trainer = stub_trainer(strategy=SimpleNamespace(parallel_devices=[cuda], root_device=cuda))
    logger = trainer.loggers[0]
    monitor = GpuStatsMonitor(interval_s=1000.0)
    monitor.setup(trainer, None, "fit")
    ((gpu,),) = [p["gpus"] for p in monitor.identities]
    assert (gpu["label"], gpu["name"], gpu["nvml_index"]) == ("cuda1", "g1", 1)
    monitor.on_train_epoch_start(trainer, None)
    train_steps(monitor, trainer, clock, [0.0])
    monitor.on_validation_epoch_start(trainer, None)
    peaks.update(alloc=1.0, reserved=1.5)
    read(monitor)
    monitor.on_validation_epoch_end(trainer, None)
    peaks.update(alloc=0.5, reserved=0.5)
    read(monitor)
    monitor.on_train_epoch_end(trainer, None)
    monitor.teardown(trainer, None, "fit")
    (val, _), (train, _) = logger.calls
    assert val["gpu_val/node0/cuda1/torch_peak_alloc_gib"] == 1.0
    assert val["gpu_val/node0/cuda1/torch_peak_reserved_gib"] == 1.5
    assert train["gpu/node0/cuda1/torch_peak_alloc_gib"] == 2.0  # training's peak, kept aside
    assert train["gpu/node0/cuda1/torch_peak_reserved_gib"] == 3.0
    assert train["gpu/node0/cuda1/util_mean"] == 25.0
    assert len(resets) == 3  # epoch start, validation start, validation end


def test_the_second_rank_of_a_node_samples_its_own_device(use_fake, no_thread) -> None:
    fake = use_fake(FakeNvml([FakeGpu(name="a"), FakeGpu(name="b")]))
    cpu = torch.device("cpu")
    trainer = stub_trainer(
        strategy=SimpleNamespace(parallel_devices=[cpu, cpu], root_device=cpu),
        world_size=4,
        num_nodes=2,
        local_rank=1,
        node_rank=1,
        global_rank=3,
        is_global_zero=False,
    )
    monitor = GpuStatsMonitor(device_uuids=[g.uuid for g in fake.gpus])
    monitor.setup(trainer, None, "fit")
    (payload,) = monitor.identities
    assert (payload["node"], payload["rank"], payload["status"]) == (1, 3, "on")
    assert [(g["label"], g["name"]) for g in payload["gpus"]] == [("cuda1", "b")]
    monitor.teardown(trainer, None, "fit")


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


# --------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval_s": -1.0}, "interval_s=-1.0; give seconds > 0"),
        ({"interval_s": "1"}, "interval_s='1'; give seconds > 0"),
        (
            {"device_uuids": ["GPU-1", 2]},
            "device_uuids=['GPU-1', 2]; give a list of NVML UUID strings",
        ),
        ({"extras": "fan"}, "extras='fan'; give a list of some of fan, pcie, ecc, "),
        ({"extras": ["fans"]}, "extras=['fans']; give a list of some of fan, pcie, ecc, "),
        ({"extras": 3}, "extras=3; give a list of some of fan, pcie, ecc, "),
        ({"per_gpu_keys_up_to": True}, "per_gpu_keys_up_to=True; give a GPU count >= 0"),
        ({"per_gpu_keys_up_to": 2.0}, "per_gpu_keys_up_to=2.0; give a GPU count >= 0"),
        ({"data_wait_warning": True}, "data_wait_warning=True; give a number in [0, 1]"),
        ({"data_wait_warning": -0.1}, "data_wait_warning=-0.1; give a number in [0, 1]"),
        ({"gpu_idle_below_pct": 100.5}, "gpu_idle_below_pct=100.5; give a number in [0, 100]"),
    ],
)
def test_each_bad_argument_is_named_with_what_is_accepted(kwargs, message) -> None:
    with pytest.raises(ValueError) as raised:
        GpuStatsMonitor(**kwargs)
    assert str(raised.value).startswith(f"GpuStatsMonitor: {message}")


def test_the_edges_of_the_accepted_ranges_and_the_options() -> None:
    low = GpuStatsMonitor(
        interval_s=1, per_gpu_keys_up_to=0, data_wait_warning=0, gpu_idle_below_pct=0
    )
    assert (low.interval_s, low.per_gpu_keys_up_to) == (1.0, 0)
    assert (low.data_wait_warning, low.gpu_idle_below_pct) == (0.0, 0.0)
    high = GpuStatsMonitor(data_wait_warning=1, gpu_idle_below_pct=100, device_uuids=("GPU-a",))
    assert (high.data_wait_warning, high.gpu_idle_below_pct) == (1.0, 100.0)
    assert high.device_uuids == ["GPU-a"] and GpuStatsMonitor().device_uuids is None
    default = GpuStatsMonitor()
    assert default.groups == [
        "utilization", "memory", "process_memory", "temperature", "power", "clock", "throttle",
        "energy", "gpm",
    ]  # fmt: skip
    assert (default.interval_s, default.per_gpu_keys_up_to) == (1.0, 8)
    assert (default.data_wait_warning, default.gpu_idle_below_pct) == (0.3, 50.0)
    assert default.report_validation and default.summary_table and not default.log_sampler_cost
    every = GpuStatsMonitor(extras=gpu_callback.EXTRAS[::-1], gpm=False)
    assert every.groups[-4:] == ["fan", "pcie", "ecc", "memory_temperature"]
    assert "gpm" not in every.groups and len(every.groups) == 12 and every.log_sampler_cost
    assert GpuStatsMonitor(extras=["pcie"]).groups[-2:] == ["gpm", "pcie"]


def test_device_uuids_is_not_in_the_users_yaml_but_an_override_still_reaches_it() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from project import config_dir
    from runkit.run.preflight import check_targets

    assert "device_uuids" not in (REPO / "configs" / "callbacks" / "gpu_stats.yaml").read_text()
    uuid = "GPU-00000000-fa6e-4000-8000-000000000000"
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"+callbacks.gpu_stats.device_uuids=['{uuid}']"])
    check_targets(cfg.callbacks.gpu_stats, "callbacks.gpu_stats")  # the preflight accepts it
    assert instantiate(cfg.callbacks.gpu_stats).device_uuids == [uuid]


# --------------------------------------------------------------------------- setup
def test_setup_for_another_stage_does_nothing(use_fake) -> None:
    fake = use_fake(FakeNvml(1))
    monitor = GpuStatsMonitor(device_uuids=[fake.gpus[0].uuid])
    monitor.setup(stub_trainer(), None, "validate")
    assert fake.total_calls() == 0 and monitor.identities == []


def test_gpus_that_cannot_be_opened_are_named_and_the_run_goes_on(
    monkeypatch, use_fake, caplog
) -> None:
    fake = use_fake(FakeNvml([FakeGpu().fail("memory", "unknown")]))  # fails at the probe
    absent = "GPU-00000000-0000-4000-8000-00000000dead"
    cpu = torch.device("cpu")
    trainer = stub_trainer(strategy=SimpleNamespace(parallel_devices=[cpu, cpu], root_device=cpu))
    monitor = GpuStatsMonitor(device_uuids=[absent, fake.gpus[0].uuid])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(trainer, None, "fit")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines[0] == (
        logging.WARNING,
        f"gpu_stats: rank 0 (node 0): cuda0: no NVML device with UUID {absent!r}",
    )
    assert lines[1][0] == logging.WARNING
    assert lines[1][1].startswith("gpu_stats: rank 0 (node 0): cuda1: NVMLError_Unknown: ")
    assert lines[2:] == [
        (
            logging.WARNING,
            "gpu_stats: rank 0: off: no usable GPU; training continues without GPU statistics",
        )
    ]
    assert fake.balanced and not fake.initialised  # NVML shut down at once
    (payload,) = monitor.identities
    assert payload["status"] == "off: no usable GPU" and payload["gpus"] == []


def test_ranks_in_the_same_state_share_one_line() -> None:
    monitor = GpuStatsMonitor()
    records: list[tuple[int, str]] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append((r.levelno, r.getMessage()))  # type: ignore[method-assign]
    logger = logging.getLogger(gpu_callback.__name__)
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        monitor._report_setup(
            [
                {"rank": 0, "node": 0, "status": "off: x", "gpus": [], "quiet": True},
                {"rank": 1, "node": 0, "status": "off: x", "gpus": [], "quiet": True},
                {"rank": 2, "node": 1, "status": "off: x", "gpus": []},
                {"rank": 3, "node": 1, "status": "off: y", "gpus": [], "problems": ["p"]},
                {
                    "rank": 4,
                    "node": 1,
                    "status": "on",
                    "gpus": [
                        {
                            "label": "cuda0",
                            "name": "n",
                            "uuid": "MIG-1",
                            "nvml_index": 3,
                            "pci_bus_id": "b",
                            "mig": True,
                            "unsupported": ["fan", "utilization"],
                        }
                    ],
                },
            ]
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    suffix = "; training continues without GPU statistics"
    assert records == [
        (logging.WARNING, "gpu_stats: rank 3 (node 1): p"),
        (
            logging.INFO,
            "gpu_stats: node1/cuda0 = n, MIG-1, NVML index 3, PCI b (MIG slice); "
            "not supported: fan, utilization",
        ),
        (logging.INFO, f"gpu_stats: rank 0,1: off: x{suffix}"),
        (logging.WARNING, f"gpu_stats: rank 2: off: x{suffix}"),
        (logging.WARNING, f"gpu_stats: rank 3: off: y{suffix}"),
    ]


def boom(trainer: Any) -> Any:
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("case", "level", "status"),
    [
        ("cpu", logging.INFO, "off: this run uses no CUDA device"),
        ("no driver", logging.WARNING, "off: NVML is not available ("),
        ("a bug", logging.WARNING, "failed to start (RuntimeError: boom)"),
    ],
)
def test_a_run_without_gpu_statistics_says_why_in_one_line(
    monkeypatch, use_fake, caplog, case, level, status
) -> None:
    fake = use_fake(FakeNvml(1, init_error="driver_not_loaded" if case == "no driver" else None))
    if case == "a bug":
        monkeypatch.setattr(gpu_callback, "process_devices", boom)
    monitor = GpuStatsMonitor(device_uuids=None if case == "cpu" else [fake.gpus[0].uuid])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(stub_trainer(), None, "fit")
    ((logged, line),) = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logged, line[: len("gpu_stats: rank 0: ") + len(status)]) == (
        level,
        f"gpu_stats: rank 0: {status}",
    )
    assert line.endswith("; training continues without GPU statistics")
    assert case != "no driver" or "Driver Not Loaded" in line  # NVML's own reason
    assert monitor.identities[0]["status"].startswith(status) and fake.balanced


def test_too_few_device_uuids_is_raised_after_nvml_is_shut_down(use_fake) -> None:
    fake = use_fake(FakeNvml(2))
    cpu = torch.device("cpu")
    trainer = stub_trainer(
        strategy=SimpleNamespace(parallel_devices=[cpu, cpu], root_device=cpu),
        world_size=2,
        local_rank=1,
        node_rank=3,
        global_rank=7,
    )
    monitor = GpuStatsMonitor(device_uuids=[fake.gpus[0].uuid])
    with pytest.raises(ValueError) as raised:
        monitor.setup(trainer, None, "fit")
    assert str(raised.value) == (
        "GpuStatsMonitor: device_uuids has 1 entries but this process drives "
        "parallel_devices[1]; give one UUID a device"
    )
    assert fake.init_count == fake.shutdown_count


def test_an_exception_closes_nvml(use_fake) -> None:
    fake = use_fake(FakeNvml(1))
    monitor = GpuStatsMonitor(interval_s=1000.0, device_uuids=[fake.gpus[0].uuid])
    trainer = stub_trainer()
    monitor.setup(trainer, None, "fit")
    assert fake.initialised
    monitor.on_exception(trainer, None, RuntimeError("x"))
    assert fake.balanced and not fake.initialised
    monitor.on_exception(trainer, None, RuntimeError("x"))  # twice is fine


# --------------------------------------------------------------------------- hooks
class RecordingLogger:
    """Stands in for a Lightning logger: what ``log_metrics`` received, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((dict(metrics), step))


def stub_trainer(**overrides: Any) -> SimpleNamespace:
    """The attributes of ``pl.Trainer`` the callback reads, for one CPU process."""
    cpu = torch.device("cpu")
    values: dict[str, Any] = dict(
        strategy=SimpleNamespace(parallel_devices=[cpu], root_device=cpu),
        world_size=1,
        num_nodes=1,
        local_rank=0,
        node_rank=0,
        global_rank=0,
        is_global_zero=True,
        sanity_checking=False,
        callbacks=[],
        loggers=[RecordingLogger()],
        callback_metrics={},
        current_epoch=0,
        global_step=12,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=12)),
        train_dataloader=SimpleNamespace(num_workers=0, pin_memory=False, batch_size=4),
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def monitor_on(
    monkeypatch: pytest.MonkeyPatch, fake: FakeNvml, loop_clock: FakeClock, **kwargs: Any
) -> GpuStatsMonitor:
    monkeypatch.setattr(gpu_callback, "LoopTimer", lambda: LoopTimer(loop_clock))
    kwargs.setdefault("device_uuids", [fake.gpus[0].uuid])
    return GpuStatsMonitor(interval_s=1000.0, **kwargs)


def train_steps(monitor: GpuStatsMonitor, trainer: Any, clock: FakeClock, waits: list[float]):
    """One training step per wait: ``wait`` s fetching the batch (8 samples), then 1 s of step."""
    for wait in waits:
        clock.advance(wait)
        monitor.on_train_batch_start(trainer, None, None, 0)
        clock.advance(1.0)
        monitor.on_train_batch_end(trainer, None, None, (torch.zeros(8, 2), torch.zeros(8)), 0)


def test_an_epoch_with_validation_logs_exact_figures_once_each(
    monkeypatch, use_fake, no_thread, caplog, capsys
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    clock = FakeClock()
    gpu = FakeGpu(
        name="Fake H100",
        util_gpu=[(0, 20), (5, 60)],
        power_mw=200_000,
        power_limit_mw=400_000,
        temperature=[(0, 40), (5, 50)],
    )
    fake = use_fake(FakeNvml([gpu], clock=clock))
    monitor = monitor_on(monkeypatch, fake, clock)
    logger = RecordingLogger()
    trainer = stub_trainer(loggers=[logger])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(trainer, None, "fit")
    (identity_line,) = [r.getMessage() for r in caplog.records]
    assert identity_line == (
        f"gpu_stats: node0/cuda0 = Fake H100, {gpu.uuid}, NVML index 0, PCI "
        f"{gpu.pci_bus_id}; not supported: gpm"
    )
    assert [p["status"] for p in monitor.identities] == ["on"]

    monitor.on_train_epoch_start(trainer, None)
    train_steps(monitor, trainer, clock, [1.0, 0.5])  # t = 3.5
    clock.set(4.0)
    monitor.on_validation_epoch_start(trainer, None)
    clock.set(5.0)
    read(monitor)  # t=5 (util 60, temp 50) for the validation
    monitor.on_validation_epoch_end(trainer, None)
    clock.set(9.0)
    train_steps(monitor, trainer, clock, [0.5])  # the 5 s of validation are not waiting
    clock.set(11.0)
    read(monitor)  # t=11 for training
    monitor.on_train_epoch_end(trainer, None)
    monitor.on_fit_end(trainer, None)
    monitor.teardown(trainer, None, "fit")

    (val, val_step), (train, step) = logger.calls
    assert (val_step, step) == (12, 11)  # 12 batches stepped; Lightning's epoch row is at 11
    assert val == {
        "gpu_val/node0/cuda0/util_mean": 60.0,
        "gpu_val/node0/cuda0/util_max": 60.0,
        "gpu_val/node0/cuda0/util_min": 60.0,
        "gpu_val/node0/cuda0/mem_util_mean": 0.0,
        "gpu_val/node0/cuda0/mem_util_max": 0.0,
        "gpu_val/node0/cuda0/mem_used_gib_mean": 0.0,
        "gpu_val/node0/cuda0/mem_used_gib_max": 0.0,
        "gpu_val/node0/cuda0/mem_total_gib": 80.0,
        "gpu_val/node0/cuda0/temp_c_mean": 50.0,
        "gpu_val/node0/cuda0/temp_c_max": 50.0,
        "gpu_val/node0/cuda0/power_w_mean": 200.0,
        "gpu_val/node0/cuda0/power_w_max": 200.0,
        "gpu_val/node0/cuda0/power_ratio_mean": 0.5,
        "gpu_val/node0/cuda0/power_ratio_max": 0.5,
        "gpu_val/node0/cuda0/sm_clock_mhz_mean": 1980.0,
        "gpu_val/node0/cuda0/sm_clock_mhz_min": 1980.0,
        "gpu_val/node0/cuda0/throttle_power_frac": 0.0,
        "gpu_val/node0/cuda0/throttle_thermal_frac": 0.0,
        "gpu_val/node0/cuda0/throttle_hw_frac": 0.0,
        "gpu_val/node0/cuda0/throttle_any_frac": 0.0,
        "gpu_val/node0/cuda0/samples": 1.0,
        "epoch": 0,
    }
    # the first sample (t=5, validation) primes the energy counter; t=11 closes 6 s at 200 W
    assert train["gpu/node0/cuda0/energy_j"] == pytest.approx(1200.0)
    # training had asked for a reading at its start: the first to come (t=5) is its too
    assert train["gpu/node0/cuda0/samples"] == 2.0
    assert train["gpu/node0/cuda0/util_mean"] == 60.0
    # loop: t=0 to the last step's end (10.5) less validation (4 to 9.5); waits 1 + 0.5 + 0.5 s
    assert train["loop/data_wait_frac"] == pytest.approx(2.0 / 5.0)
    assert train["loop/samples_per_s"] == pytest.approx(24 / 5.0)  # 3 batches of 8
    assert not any("sample_ms" in k or "/all/" in k for k in train)
    assert monitor.state_dict() == {
        "version": 1,
        "energy_j": {"node0/cuda0": pytest.approx(1200.0)},
        "train_samples": 24.0,
    }
    (row,) = monitor.run_summary()
    assert row["gpu"] == "node0/cuda0" and row["name"] == "Fake H100" and row["uuid"] == gpu.uuid
    assert (
        row["util_mean"] == 60.0 and row["samples"] == 2 and row["energy_j"] == pytest.approx(1200)
    )
    out = capsys.readouterr().out
    assert "GPU statistics over the run" in out and "1.20" in out  # kJ
    assert fake.balanced and not fake.initialised


def test_a_phase_whose_reading_is_not_in_is_published_later_at_its_own_step(
    monkeypatch, use_fake, no_thread
) -> None:
    clock, free = FakeClock(), threading.Event()

    def utilization(t: float) -> int:  # a reading on the "held" thread waits until freed
        if threading.current_thread().name == "held":
            free.wait(timeout=10)
        return 30

    def held_reading() -> threading.Thread:
        free.clear()
        thread = threading.Thread(target=read, args=(monitor,), name="held")
        thread.start()
        return thread

    fake = use_fake(FakeNvml([FakeGpu(util_gpu=utilization)], clock=clock))
    monitor = monitor_on(monkeypatch, fake, clock)
    trainer = stub_trainer()
    logger, steps = trainer.loggers[0], trainer.fit_loop.epoch_loop
    monitor.setup(trainer, None, "fit")
    monitor.on_train_epoch_start(trainer, None)
    read(monitor)
    train_steps(monitor, trainer, clock, [0.0])
    monitor.on_validation_epoch_start(trainer, None)
    reading = held_reading()  # begun in the validation, ends after it
    monitor.on_validation_epoch_end(trainer, None)  # waits for nothing, logs nothing
    assert logger.calls == [] and reading.is_alive()
    free.set()
    reading.join()
    steps._batches_that_stepped = 20
    monitor.on_train_epoch_end(trainer, None)
    assert [(sorted(row)[0], step) for row, step in logger.calls] == [
        ("epoch", 12),  # the validation, at its own step
        ("epoch", 19),  # the epoch, at Lightning's row of it
    ]
    assert logger.calls[0][0]["gpu_val/node0/cuda0/samples"] == 1.0
    monitor.on_train_epoch_start(trainer, None)
    train_steps(monitor, trainer, clock, [0.0])
    reading = held_reading()
    steps._batches_that_stepped = 30
    monitor.on_train_epoch_end(trainer, None)
    assert len(logger.calls) == 2  # its reading is not in
    threading.Timer(0.05, free.set).start()
    monitor.on_train_end(trainer, None)  # waits for it
    monitor.teardown(trainer, None, "fit")
    row, step = logger.calls[2]
    assert step == 29 and row["gpu/node0/cuda0/util_mean"] == 30.0 and row["epoch"] == 0
    assert row["loop/samples_per_s"] == 8.0


def starvation_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("loop:")]


def run_cpu_epoch(monkeypatch, waits: list[float], caplog, **kwargs: Any) -> RecordingLogger:
    clock = FakeClock()
    monkeypatch.setattr(gpu_callback, "LoopTimer", lambda: LoopTimer(clock))
    monitor = GpuStatsMonitor(**kwargs)
    logger = RecordingLogger()
    trainer = stub_trainer(loggers=[logger], current_epoch=3)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(trainer, None, "fit")
        monitor.on_train_epoch_start(trainer, None)
        train_steps(monitor, trainer, clock, waits)
        monitor.on_train_epoch_end(trainer, None)
        monitor.teardown(trainer, None, "fit")
    return logger


def test_a_starved_epoch_without_gpu_readings_gets_one_line_naming_the_settings(
    monkeypatch, caplog
) -> None:
    logger = run_cpu_epoch(monkeypatch, [3.0, 1.0], caplog)  # waited 4 s of a 6 s loop
    ((row, step),) = logger.calls
    assert row == {"loop/data_wait_frac": pytest.approx(4 / 6), "loop/samples_per_s": 16 / 6,
                   "epoch": 3}  # fmt: skip
    assert step == 11  # Lightning's own row of the epoch: its last batch's (12 stepped)
    (line,) = starvation_lines(caplog)
    assert line == (
        "loop: epoch 3 waited for the next batch 67% of its training time (4.0 s) and no GPU "
        "reading: the input pipeline holds training back. What helps: more loader processes "
        "(data.num_workers), pinned memory (data.pin_memory), a larger batch (data.batch_size); "
        "now data.num_workers=0, data.pin_memory=False, data.batch_size=4"
    )
    assert [r.levelno for r in caplog.records if r.getMessage().startswith("loop:")] == [
        logging.WARNING
    ]


@pytest.mark.parametrize(
    ("waits", "kwargs", "warned"),
    [
        ([0.5, 0.5], {"data_wait_warning": 0.0}, True),  # a 1.0 s wait is enough
        ([0.4, 0.5], {"data_wait_warning": 0.0}, False),  # 0.9 s is not, whatever the share
        ([1.0, 1.0], {"data_wait_warning": 0.5}, False),  # exactly the threshold: no line
        ([1.0, 1.1], {"data_wait_warning": 0.5}, True),
    ],
)
def test_the_starvation_line_needs_both_the_share_and_a_second_of_waiting(
    monkeypatch, caplog, waits, kwargs, warned
) -> None:
    run_cpu_epoch(monkeypatch, waits, caplog, **kwargs)
    assert len(starvation_lines(caplog)) == (1 if warned else 0)


@pytest.mark.parametrize(("util", "idle_below", "warned"), [(49, 50.0, True), (50, 50.0, False)])
def test_a_busy_gpu_means_no_starvation_line(
    monkeypatch, use_fake, no_thread, caplog, util, idle_below, warned
) -> None:
    clock = FakeClock()
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=util)], clock=clock))
    monitor = monitor_on(monkeypatch, fake, clock, gpu_idle_below_pct=idle_below)
    trainer = stub_trainer()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(trainer, None, "fit")
        monitor.on_train_epoch_start(trainer, None)
        train_steps(monitor, trainer, clock, [3.0])
        read(monitor)
        monitor.on_train_epoch_end(trainer, None)
        monitor.teardown(trainer, None, "fit")
    lines = starvation_lines(caplog)
    assert lines == ([lines[0]] if warned else [])
    if warned:
        assert f"and the GPUs were {util}% busy: the input pipeline" in lines[0]


def test_a_rank_other_than_zero_feeds_monitors_but_not_loggers(
    monkeypatch, use_fake, no_thread, caplog
) -> None:
    clock = FakeClock()
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=30)], clock=clock))
    monitor = monitor_on(monkeypatch, fake, clock, summary_table=True)
    watcher = SimpleNamespace(monitor="gpu/node0/cuda0/util_mean")
    trainer = stub_trainer(
        is_global_zero=False,
        callbacks=[monitor, watcher, SimpleNamespace(monitor=None)],
        lr_scheduler_configs=[SimpleNamespace(monitor="loop/data_wait_frac")],
    )
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(trainer, None, "fit")
        monitor.on_train_epoch_start(trainer, None)
        train_steps(monitor, trainer, clock, [3.0])  # starved, but only rank 0 says so
        read(monitor)
        monitor.on_train_epoch_end(trainer, None)
        monitor.on_fit_end(trainer, None)
        monitor.teardown(trainer, None, "fit")
    assert trainer.loggers[0].calls == []
    assert caplog.records == []  # neither the identity line nor the starvation line
    metrics = trainer.callback_metrics
    assert set(metrics) == {"gpu/node0/cuda0/util_mean", "loop/data_wait_frac"}
    assert isinstance(metrics["gpu/node0/cuda0/util_mean"], torch.Tensor)
    assert metrics["gpu/node0/cuda0/util_mean"].item() == 30.0
    assert metrics["loop/data_wait_frac"].item() == pytest.approx(0.75)


def test_without_loggers_monitors_still_get_their_keys(monkeypatch, caplog) -> None:
    clock = FakeClock()
    monkeypatch.setattr(gpu_callback, "LoopTimer", lambda: LoopTimer(clock))
    monitor = GpuStatsMonitor()
    trainer = stub_trainer(loggers=[], callbacks=[SimpleNamespace(monitor="loop/samples_per_s")])
    monitor.setup(trainer, None, "fit")
    monitor.on_train_epoch_start(trainer, None)
    train_steps(monitor, trainer, clock, [0.0])
    monitor.on_train_epoch_end(trainer, None)
    assert trainer.callback_metrics["loop/samples_per_s"].item() == 8.0


def test_no_step_means_nothing_is_logged(monkeypatch) -> None:
    logger = RecordingLogger()
    monitor = GpuStatsMonitor()
    trainer = stub_trainer(loggers=[logger])
    monitor.setup(trainer, None, "fit")
    monitor.on_train_epoch_start(trainer, None)
    monitor.on_train_epoch_end(trainer, None)  # an epoch with no batch: no figures, no call
    assert logger.calls == [] and monitor.run_samples() == 0.0


def test_sanity_checking_and_disabled_validation_log_no_validation_figures(
    monkeypatch, use_fake, no_thread
) -> None:
    clock = FakeClock()
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=10)], clock=clock))
    monitor = monitor_on(monkeypatch, fake, clock, report_validation=False)
    logger = RecordingLogger()
    trainer = stub_trainer(loggers=[logger], sanity_checking=True)
    monitor.setup(trainer, None, "fit")
    for hook in ("on_validation_epoch_start", "on_validation_epoch_end"):
        getattr(monitor, hook)(trainer, None)  # the sanity check: nothing happens
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 1  # the probe's only
    trainer.sanity_checking = False
    monitor.on_train_epoch_start(trainer, None)
    train_steps(monitor, trainer, clock, [1.0])  # t = 2
    monitor.on_validation_epoch_start(trainer, None)
    clock.set(4.0)
    monitor.on_validation_epoch_end(trainer, None)  # logs nothing
    assert logger.calls == []
    assert monitor.run_samples() == 8.0  # the epoch so far counts, for a checkpoint saved now
    clock.set(6.0)
    train_steps(monitor, trainer, clock, [0.0])  # validation 2..6 left out; t = 7
    read(monitor)
    monitor.on_train_epoch_end(trainer, None)
    monitor.teardown(trainer, None, "fit")
    ((row, _),) = logger.calls
    assert row["gpu/node0/cuda0/util_mean"] == 10.0
    assert row["loop/data_wait_frac"] == pytest.approx(1.0 / 3.0)
    assert not any(k.startswith("gpu_val/") for k in row)
    assert monitor.run_samples() == 16.0


def test_two_epochs_add_up_and_an_unsized_batch_makes_the_sample_count_unknown(
    monkeypatch,
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(gpu_callback, "LoopTimer", lambda: LoopTimer(clock))
    monitor = GpuStatsMonitor()
    trainer = stub_trainer()
    monitor.setup(trainer, None, "fit")
    for _ in range(2):
        monitor.on_train_epoch_start(trainer, None)
        train_steps(monitor, trainer, clock, [0.0, 0.0])
        monitor.on_train_epoch_end(trainer, None)
    assert monitor.run_samples() == 32.0 and monitor.state_dict()["train_samples"] == 32.0
    monitor.on_train_epoch_start(trainer, None)
    monitor.on_train_batch_start(trainer, None, None, 0)
    monitor.on_train_batch_end(trainer, None, None, ["no tensor"], 0)
    monitor.on_train_epoch_end(trainer, None)
    assert monitor.run_samples() is None
    monitor.on_train_epoch_start(trainer, None)
    train_steps(monitor, trainer, clock, [0.0])
    monitor.on_train_epoch_end(trainer, None)
    assert monitor.run_samples() is None  # unknown once, unknown for the run


def test_a_bug_in_the_bookkeeping_stops_sampling_with_one_line(
    monkeypatch, use_fake, no_thread, caplog
) -> None:
    clock = FakeClock()
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=10)], clock=clock))
    monitor = monitor_on(monkeypatch, fake, clock)
    trainer = stub_trainer()
    monitor.setup(trainer, None, "fit")

    def broken() -> None:
        raise KeyError("oops")

    monitor._peaks = SimpleNamespace(clear=broken)  # PyTorch's peaks, failing
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monitor.on_train_epoch_start(trainer, None)
    assert [r.getMessage() for r in caplog.records] == [
        "gpu_stats: peak reset failed (KeyError: 'oops'); sampling stops"
    ]
    assert fake.balanced and not fake.initialised  # NVML is shut down at once
    train_steps(monitor, trainer, clock, [0.0])
    monitor.on_train_epoch_end(trainer, None)  # the epoch still ends (and gathers), without GPUs
    ((row, _),) = trainer.loggers[0].calls
    assert not any(k.startswith("gpu/") for k in row) and "loop/data_wait_frac" in row


def run_epoch_with_validation(monitor: GpuStatsMonitor, trainer: Any, clock: FakeClock) -> None:
    monitor.on_train_epoch_start(trainer, None)
    train_steps(monitor, trainer, clock, [0.0])
    monitor.on_validation_epoch_start(trainer, None)
    clock.advance(1.0)
    read(monitor)
    monitor.on_validation_epoch_end(trainer, None)
    train_steps(monitor, trainer, clock, [0.0])
    read(monitor)
    monitor.on_train_epoch_end(trainer, None)


def test_two_slices_of_one_gpu_count_its_energy_once(monkeypatch, use_fake, no_thread) -> None:
    clock = FakeClock()
    parent = FakeGpu(power_mw=300_000, mig=[FakeGpu(name="s0"), FakeGpu(name="s1")])
    fake = use_fake(FakeNvml([parent], clock=clock))
    cpu = torch.device("cpu")
    trainer = stub_trainer(strategy=SimpleNamespace(parallel_devices=[cpu, cpu], root_device=cpu))
    monitor = monitor_on(
        monkeypatch, fake, clock, device_uuids=[parent.mig[0].uuid, parent.mig[1].uuid]
    )
    monitor.setup(trainer, None, "fit")
    run_epoch_with_validation(monitor, trainer, clock)  # t = 0..3: validation primes at t=2
    monitor.teardown(trainer, None, "fit")
    (_, _), (train, _) = trainer.loggers[0].calls
    assert train["gpu/node0/cuda0/energy_j"] == pytest.approx(300.0)  # the board's, t = 2..3
    assert train["gpu/node0/cuda1/energy_j"] == pytest.approx(300.0)
    assert train["gpu/all/energy_j_sum"] == pytest.approx(300.0)  # one board, counted once
    assert monitor.run_energy_j() == {"node0/cuda0": pytest.approx(300.0)}


def test_energy_of_ranks_without_boards_is_counted_per_node_and_label() -> None:
    monitor = GpuStatsMonitor()
    monitor._add_energy(
        [
            {"node": 0, "energy_total_j": {"cuda0": 1.0}},
            {"node": 1, "energy_total_j": {"cuda0": 2.0}},
            {"node": 1},
        ]
    )
    assert monitor.run_energy_j() == {"node0/cuda0": 1.0, "node1/cuda0": 2.0}


# --------------------------------------------------------------------------- energy
def monitor_with(state: dict) -> GpuStatsMonitor:
    monitor = GpuStatsMonitor()
    monitor.load_state_dict(state)
    return monitor


@pytest.mark.parametrize(
    ("state", "report"),
    [
        (
            {"energy_j": {"node0/cuda0": 7200.0, "node0/cuda1": 1800.0}, "train_samples": 900},
            {"energy_j": 9000.0, "energy_kwh": 9000.0 / 3.6e6, "energy_j_per_training_sample": 10.0,
             "training_samples": 900,
             "energy_j_per_gpu": {"node0/cuda0": 7200.0, "node0/cuda1": 1800.0}},
        ),
        (
            {"energy_j": {"node0/cuda0": 0.1234567}, "train_samples": None},  # samples unknown
            {"energy_j": 0.123, "energy_kwh": 0.1234567 / 3.6e6,
             "energy_j_per_training_sample": None, "training_samples": None,
             "energy_j_per_gpu": {"node0/cuda0": 0.123}},
        ),
        (
            {"energy_j": {"node0/cuda0": 0}, "train_samples": 0},  # zero is a valid reading
            {"energy_j": 0.0, "energy_kwh": 0.0, "energy_j_per_training_sample": None,
             "training_samples": 0, "energy_j_per_gpu": {"node0/cuda0": 0.0}},
        ),
        ({"energy_j": {}, "train_samples": 5}, None),  # no reading: no report
    ],
)  # fmt: skip
def test_energy_report_of_a_resumed_run(state, report) -> None:
    monitor = monitor_with(state)
    assert energy_report(SimpleNamespace(callbacks=[object(), monitor])) == report
    assert monitor.state_dict() == {"version": 1, **state}
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


def test_gpu_busy_is_the_mean_utilisation_or_sm_activity() -> None:
    everyone = [
        {"gpus": {"cuda0": {"util_mean": 20.0}, "cuda1": {"sm_active_mean": 60.0}}},
        {"gpus": {"cuda0": {"util_mean": 40.0, "sm_active_mean": 99.0}, "cuda1": {}}},
        {},
    ]
    assert gpu_busy_pct(everyone) == pytest.approx((20 + 60 + 40) / 3)
    assert gpu_busy_pct([{"gpus": {"cuda0": {}}}]) is None
    assert gpu_busy_pct([]) is None


def test_monitored_keys_come_from_callbacks_and_schedulers() -> None:
    trainer = SimpleNamespace(
        callbacks=[EarlyStopping(monitor="gpu/a"), object()],
        lr_scheduler_configs=[SimpleNamespace(monitor="gpu/b"), SimpleNamespace(monitor=None)],
    )
    assert gpu_callback.monitored_keys(trainer) == {"gpu/a", "gpu/b"}


# --------------------------------------------------------------------------- real fits
class SlowData(torch.utils.data.Dataset):
    """A data set that takes ``delay_s`` per sample, like one decoding files on one core."""

    def __init__(self, delay_s: float, n: int = 64) -> None:
        self.delay_s, self.x, self.y = delay_s, torch.randn(n, 4), torch.randint(0, 2, (n,))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


class TinyModel(pl.LightningModule):
    def __init__(self, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.fail_at_step = fail_at_step

    def training_step(self, batch, batch_idx):
        if self.fail_at_step is not None and self.global_step >= self.fail_at_step:
            raise RuntimeError("model blew up")
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.layer(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(slow_s: float = 0.0, batch_size: int = 4) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(SlowData(slow_s), batch_size=batch_size)


class CallsPerStep(pl.Callback):
    """Records the fake's NVML call count from the training thread at every step."""

    def __init__(self, fake: FakeNvml, step_s: float = 0.0) -> None:
        self.fake = fake
        self.step_s = step_s  # a floor on step time: an epoch outlasts the sampler interval
        self.counts: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.counts.setdefault(trainer.current_epoch, []).append(self.fake.calls_in_thread())
        time.sleep(self.step_s)


def fit(
    tmp_path: Path,
    monitor: Any,
    *callbacks,
    loggers=None,
    model=None,
    epochs=2,
    train_loader=None,
    ckpt_path=None,
    **options,
) -> pl.Trainer:
    options = {
        "limit_train_batches": 12,
        "limit_val_batches": 2,
        "num_sanity_val_steps": 1,
        **options,
    }
    trainer = pl.Trainer(
        **options,
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        logger=loggers if loggers is not None else CSVLogger(tmp_path, name="csv", version=0),
        callbacks=[monitor, *callbacks],
    )
    trainer.fit(model or TinyModel(), train_loader or loader(), loader(), ckpt_path=ckpt_path)
    return trainer


class SamplesInBatches(pl.Callback):
    """Per epoch: the samples in the batches trained on, and the monitor's count of them."""

    def __init__(self, monitor: GpuStatsMonitor) -> None:
        self.monitor = monitor
        self.pairs: list[tuple[int, float]] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.seen = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen += len(batch[0])

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.pairs.append((self.seen, self.monitor._loop.summary()["samples"]))


@pytest.mark.parametrize("batch_size", [4, 5, 6])  # 64 samples: 16 whole, 13 whole, 10 + 4
def test_a_fit_counts_its_samples_from_its_loader_exactly(tmp_path, use_fake, batch_size) -> None:
    # limit_train_batches=12 stops before the last batch at 4 and 5, not at 6.
    fake = use_fake(FakeNvml([FakeGpu()]))
    monitor = GpuStatsMonitor(interval_s=1000.0, device_uuids=[fake.gpus[0].uuid])
    truth = SamplesInBatches(monitor)
    fit(tmp_path, monitor, truth, train_loader=loader(batch_size=batch_size))
    assert truth.pairs == [(min(64, 12 * batch_size), min(64, 12 * batch_size))] * 2


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_fit_on_cpu_writes_gpu_columns_to_metrics_csv(
    tmp_path, use_fake, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # Rich wraps the table at 80 columns otherwise
    fake = use_fake(
        FakeNvml(
            [
                FakeGpu(
                    name="Fake H100",
                    util_gpu=40,
                    util_memory=20,
                    memory_used=10 * GIB,
                    power_mw=350_000,
                    temperature=61,
                    processes=[FakeProcess("self", 2 * GIB)],
                )
            ]
        )
    )
    monitor = GpuStatsMonitor(
        interval_s=0.02, device_uuids=[fake.gpus[0].uuid], extras=["sample_ms"]
    )
    steps = CallsPerStep(fake, step_s=0.01)  # 12 steps of >= 10 ms: several 20 ms samples
    fit(tmp_path, monitor, steps)

    rows = read_csv(tmp_path / "csv" / "version_0" / "metrics.csv")
    train = [r for r in rows if r.get("gpu/node0/cuda0/util_mean")]
    val = [r for r in rows if r.get("gpu_val/node0/cuda0/util_mean")]
    assert len(train) == 2 and len(val) == 2  # one row per epoch; the sanity check is not logged
    for row in train:
        assert float(row["gpu/node0/cuda0/util_mean"]) == 40
        assert float(row["gpu/node0/cuda0/util_max"]) == 40
        assert float(row["gpu/node0/cuda0/mem_util_mean"]) == 20
        assert float(row["gpu/node0/cuda0/mem_used_gib_max"]) == 10
        assert float(row["gpu/node0/cuda0/proc_mem_gib_max"]) == 2
        assert float(row["gpu/node0/cuda0/power_ratio_mean"]) == 0.5
        assert float(row["gpu/node0/cuda0/temp_c_max"]) == 61
        assert float(row["gpu/node0/cuda0/energy_j"]) > 0
        assert float(row["gpu/node0/cuda0/samples"]) >= 2
        assert float(row["gpu/node0/cuda0/sample_ms"]) >= 0
        assert float(row["loop/data_wait_frac"]) < 1 and float(row["loop/samples_per_s"]) > 0
    assert not any(k.startswith("gpu/all/") for k in rows[0])  # one GPU: no copies of its keys
    assert "gpu/node0/cuda0/fan_pct_mean" not in rows[0]  # option off
    assert not any("torch_peak" in k for k in rows[0])  # no CUDA device, so no torch peaks
    # no NVML call from the training thread between steps of an epoch
    for epoch, counts in steps.counts.items():
        assert len(counts) == 12 and len(set(counts[1:])) == 1, (epoch, counts)
    assert fake.balanced and not fake.initialised
    out = capsys.readouterr().out
    assert "GPU statistics over the run" in out and "Fake H100" in out
    (row,) = monitor.run_summary()
    assert row["util_mean"] == 40 and row["mem_used_gib_max"] == 10


def test_fit_with_several_loggers(tmp_path, use_fake) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoardLogger needs tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fake = use_fake(FakeNvml([FakeGpu(util_gpu=55)]))
    monitor = GpuStatsMonitor(
        interval_s=0.05, device_uuids=[fake.gpus[0].uuid], summary_table=False
    )
    loggers = [
        CSVLogger(tmp_path, name="csv", version=0),
        TensorBoardLogger(tmp_path, name="tb", version=0),
    ]
    fit(tmp_path, monitor, loggers=loggers, epochs=1)
    rows = read_csv(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert [
        float(r["gpu/node0/cuda0/util_mean"]) for r in rows if r.get("gpu/node0/cuda0/util_mean")
    ] == [55]
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    assert [e.value for e in events.Scalars("gpu/node0/cuda0/util_mean")] == [55]
    assert fake.balanced


def test_exception_in_training_still_shuts_nvml_down(tmp_path, use_fake) -> None:
    fake = use_fake(FakeNvml(1))
    monitor = GpuStatsMonitor(interval_s=0.05, device_uuids=[fake.gpus[0].uuid])
    with pytest.raises(RuntimeError, match="model blew up"):
        fit(tmp_path, monitor, model=TinyModel(fail_at_step=3))
    assert fake.init_count == 1 and fake.balanced and not fake.initialised


def test_fit_with_gpu_lost_keeps_training(tmp_path, use_fake, caplog) -> None:
    clock = FakeClock()
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=70)], clock=clock))
    # the test loses the GPU in this process's fake: the sampler must read it here
    monitor = GpuStatsMonitor(interval_s=30.0, device_uuids=[fake.gpus[0].uuid])

    class LoseAfterFirstEpoch(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            fake.gpus[0].lose(at=clock.advance(1.0))

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer = fit(tmp_path, monitor, LoseAfterFirstEpoch(), epochs=3)
    assert trainer.current_epoch == 3  # every epoch ran
    rows = read_csv(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert [
        float(r["gpu/node0/cuda0/util_mean"]) for r in rows if r.get("gpu/node0/cuda0/util_mean")
    ] == [70]
    assert sum("stopped sampling cuda0" in r.message for r in caplog.records) == 1
    assert fake.balanced


def test_cpu_run_without_device_uuids_does_not_touch_nvml(tmp_path, use_fake, caplog) -> None:
    fake = use_fake(FakeNvml(1))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        fit(tmp_path, GpuStatsMonitor(), epochs=1)
    assert fake.total_calls() == 0
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]
    assert "uses no CUDA device" in line


NO_NVML_SCRIPT = textwrap.dedent(
    """
    import logging, sys, warnings
    warnings.simplefilter("error")  # any warning from us (or a pynvml wrapper) is fatal
    if sys.argv[1] == "no-bindings":
        sys.modules["pynvml"] = None  # as if nvidia-ml-py were not installed
    import torch
    import lightning.pytorch as pl
    from lightning.fabric.utilities.warnings import PossibleUserWarning
    warnings.filterwarnings("ignore", category=PossibleUserWarning)  # Lightning's own advice
    # Lightning 2.6.6's own FutureWarning under torch >= 2.10, raised inside Lightning, not ours
    warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec", category=FutureWarning)
    from runkit.gpu_stats.callback import GpuStatsMonitor
    logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)
        def training_step(self, batch, i):
            return self.layer(batch[0]).sum()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    monitor = GpuStatsMonitor(device_uuids=["GPU-00000000-fa6e-4000-8000-000000000000"])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[monitor])
    trainer.fit(M(), torch.utils.data.DataLoader(data, batch_size=4))
    print("FIT DONE")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["no-bindings", "no-driver"])
def test_no_nvml_under_warnings_as_errors(tmp_path, variant) -> None:
    script = tmp_path / "run.py"
    script.write_text(NO_NVML_SCRIPT)
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("PROJECT_")}
    result = subprocess.run(
        [sys.executable, "-W", "error", str(script), variant],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "FIT DONE" in output and "Traceback" not in output
    ours = [line for line in output.splitlines() if line.startswith(f"LOG {LOGGER}")]
    assert len(ours) == 1, output
    if variant == "no-bindings":
        assert "not installed" in ours[0]
    elif not torch.cuda.is_available():
        assert "NVML is not available" in ours[0]


@pytest.mark.gpu
def test_real_gpu_values(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with an NVIDIA driver (torch.cuda.is_available() is False)")
    nvml.use_library(None)
    monitor = GpuStatsMonitor(interval_s=0.1)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=50,
        limit_val_batches=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=CSVLogger(tmp_path, name="csv", version=0),
        callbacks=[monitor],
    )
    trainer.fit(TinyModel(), loader(), loader())
    (row,) = [
        r
        for r in read_csv(tmp_path / "csv" / "version_0" / "metrics.csv")
        if r.get("gpu/node0/cuda0/samples")
    ]
    assert 0 <= float(row["gpu/node0/cuda0/util_mean"]) <= 100
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    assert float(row["gpu/node0/cuda0/mem_total_gib"]) == pytest.approx(total, rel=0.05)
    assert 0 < float(row["gpu/node0/cuda0/torch_peak_alloc_gib"]) < total
    assert float(row["gpu/node0/cuda0/proc_mem_gib_max"]) > 0
    (ident,) = monitor.identities[0]["gpus"]
    assert ident["uuid"].startswith(("GPU-", "MIG-"))


def gpu_rows(tmp_path: Path, key: str = "gpu/node0/cuda0/samples") -> list[dict[str, str]]:
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
        return [r for r in csv.DictReader(handle) if r.get(key)]


class CountingCsvLogger(CSVLogger):
    """The real CSV logger, counting the calls that carry GPU figures."""

    gpu_calls = 0

    def log_metrics(self, metrics, step=None):
        if any(k.startswith(("gpu/", "gpu_val/")) for k in metrics):
            self.gpu_calls += 1
        super().log_metrics(metrics, step)


def test_gpm_in_a_real_fit_reaches_csv_table_and_frees_its_samples(
    tmp_path, use_fake, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("COLUMNS", "220")
    fake = use_fake(FakeNvml([FakeGpu(name="Fake H200", util_gpu=90, gpm=HOPPER_GPM)]))
    monitor = GpuStatsMonitor(interval_s=0.02, device_uuids=[fake.gpus[0].uuid])
    fit(tmp_path, monitor, epochs=1, train_loader=loader(0.01))
    (row,) = gpu_rows(tmp_path)
    assert float(row["gpu/node0/cuda0/sm_active_mean"]) == pytest.approx(60)
    assert float(row["gpu/node0/cuda0/tensor_active_max"]) == pytest.approx(20)
    assert float(row["gpu/node0/cuda0/dram_active_mean"]) == pytest.approx(45)
    assert "gpu/node0/cuda0/fp16_active_mean" not in row  # not scripted: absent
    table = capsys.readouterr().out
    assert "SM active %" in table and "60.0" in table
    assert fake.gpm_samples_live == 0 and fake.balanced


@pytest.mark.slow
def test_figures_reach_the_logger_in_one_call_and_monitors_still_see_them(
    tmp_path, use_fake
) -> None:
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=[(0, 70)], gpm=HOPPER_GPM)]))
    monitor = GpuStatsMonitor(interval_s=0.05, device_uuids=[fake.gpus[0].uuid])
    key = "gpu/node0/cuda0/util_mean"
    stop = EarlyStopping(monitor=key, mode="max", patience=0, check_on_train_epoch_end=True)
    best = ModelCheckpoint(
        dirpath=tmp_path / "ckpt",
        monitor="gpu/node0/cuda0/sm_active_mean",
        mode="max",
        save_on_train_epoch_end=True,
    )
    logger = CountingCsvLogger(tmp_path, name="csv", version=0)
    trainer = fit(tmp_path, monitor, stop, best, epochs=5, loggers=logger)
    assert trainer.current_epoch == 2  # the constant key did not improve after epoch 0: stopped
    assert float(best.best_model_score) == pytest.approx(60)
    assert logger.gpu_calls == 2 * 2  # per epoch: one training call, one validation call
    assert set(trainer.callback_metrics) >= {key, "gpu/node0/cuda0/sm_active_mean"}
    assert "gpu/node0/cuda0/temp_c_max" not in trainer.callback_metrics  # no monitor asks
    assert [float(r[key]) for r in gpu_rows(tmp_path)] == [70, 70]


@pytest.mark.slow
def test_validation_figures_come_at_the_validations_step_and_at_once_to_a_monitor(
    tmp_path, use_fake
) -> None:
    free, timed_out = threading.Event(), []

    def utilization(t: float) -> int:  # the sampler thread's reading waits while held
        timed_out.append(not free.wait(timeout=10))
        return 70

    fake = use_fake(FakeNvml([FakeGpu(util_gpu=utilization)]))
    free.set()
    uuids = [fake.gpus[0].uuid]
    key = "gpu_val/node0/cuda0/util_mean"

    class AtValidationEnd(pl.Callback):
        def __init__(self) -> None:
            self.seen = []

        def on_validation_end(self, trainer, pl_module) -> None:
            self.seen.append(trainer.callback_metrics.get(key))

    class HoldsTheSampler(pl.Callback):
        """Holds the sampler's readings over the monitor's validation: a wait for the reading
        at its end would last until the reading's own time-out."""

        def on_validation_epoch_start(self, trainer, pl_module) -> None:
            free.clear()

        def on_validation_end(self, trainer, pl_module) -> None:
            free.set()

    # Unwatched, they are logged once the reading is in, each at the step of its validation
    # (two validations an epoch), and nothing waits for them at the validation. The steps are
    # those of Lightning's own rows: its val_loss, its train_loss of the epoch.
    unwatched = AtValidationEnd()
    monitor = GpuStatsMonitor(interval_s=0.05, device_uuids=uuids)
    fit(
        tmp_path,
        HoldsTheSampler(),
        monitor,
        unwatched,
        val_check_interval=0.5,
        num_sanity_val_steps=0,
    )
    assert not any(timed_out)
    rows = gpu_rows(tmp_path, key)
    lightnings = [r["step"] for r in gpu_rows(tmp_path, "val_loss")]
    assert [r["step"] for r in rows] == lightnings and len(rows) == 4
    epochs = [r["step"] for r in gpu_rows(tmp_path, "train_loss")]
    assert [r["step"] for r in gpu_rows(tmp_path)] == epochs == ["11", "23"]
    assert [float(r[key]) for r in rows] == [70.0] * 4 and unwatched.seen == [None] * 4
    # Watched, a monitor has them at the validation's end, every time.
    watched = AtValidationEnd()
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor=key, mode="max")
    monitor = GpuStatsMonitor(interval_s=0.05, device_uuids=uuids)
    fit(
        tmp_path / "watched", monitor, best, watched, val_check_interval=0.5, num_sanity_val_steps=0
    )
    assert [float(v) for v in watched.seen] == [70.0] * 4 and float(best.best_model_score) == 70


@pytest.mark.slow
def test_an_epoch_shorter_than_the_interval_is_read_from_its_start(tmp_path, use_fake) -> None:
    # Its end used to find no reading of the epoch and take one of every GPU on the training
    # thread (about 10 ms for 8 GPUs at 0.3 ms a call). Now the epoch's start has the sampler
    # process begin the epoch's first reading, and the end finds it done. The utilization is
    # 40 until the epoch's last step has seen a reading begun in the epoch, 90 after it: the
    # epoch's figure says which reading it got.
    reads, late = tmp_path / "reads", tmp_path / "late"

    def utilization(t: float) -> int:  # runs in the sampler process
        with reads.open("a") as handle:
            handle.write(f"{time.monotonic()}\n")
        return 90 if late.exists() else 40

    class LastStepAfterAReading(pl.Callback):
        """Before the monitor: stamps the epoch's start; its last step waits for a reading."""

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.started = time.monotonic()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx + 1 < trainer.num_training_batches:
                return
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                float(t) > self.started for t in reads.read_text().split()
            ):
                time.sleep(0.01)
            late.touch()

    fake = use_fake(FakeNvml([FakeGpu(util_gpu=utilization)]))
    monitor = GpuStatsMonitor(interval_s=1000.0, device_uuids=[fake.gpus[0].uuid])
    fit(tmp_path, LastStepAfterAReading(), monitor, epochs=1, limit_val_batches=0)
    (row,) = gpu_rows(tmp_path)
    assert (row["gpu/node0/cuda0/samples"], row["gpu/node0/cuda0/util_mean"]) == ("1.0", "40.0")
    assert late.exists()


@pytest.mark.slow
def test_energy_continues_across_a_resume_and_reaches_metrics_json(tmp_path, use_fake) -> None:
    fake = use_fake(FakeNvml([FakeGpu(power_mw=300_000)]))
    uuids = [fake.gpus[0].uuid]
    last = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    first = GpuStatsMonitor(interval_s=0.02, device_uuids=uuids, summary_table=False)
    fit(tmp_path / "a", first, last, epochs=2, train_loader=loader(0.002))
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["callbacks"]
    state = saved["GpuStatsMonitor"]
    assert state["train_samples"] == 2 * 12 * 4
    assert state["energy_j"]["node0/cuda0"] > 0
    second = GpuStatsMonitor(interval_s=0.02, device_uuids=uuids, summary_table=False)
    trainer = fit(
        tmp_path / "b",
        second,
        ModelCheckpoint(dirpath=tmp_path / "ckpt2"),
        epochs=4,
        train_loader=loader(0.002),
        ckpt_path=tmp_path / "ckpt" / "last.ckpt",
    )
    report = energy_report(trainer)
    assert report["training_samples"] == 4 * 12 * 4  # both runs' samples
    assert report["energy_j"] > state["energy_j"]["node0/cuda0"]  # continued, not restarted
    assert report["energy_kwh"] == pytest.approx(report["energy_j"] / 3.6e6)
    assert report["energy_j_per_training_sample"] == pytest.approx(report["energy_j"] / 192)
    run_files.save_metrics({}, tmp_path, None, trainer, started=time.time(), energy=report)
    written = json.loads((tmp_path / "metrics.json").read_text())["energy"]
    assert written["energy_j_per_gpu"] == {"node0/cuda0": pytest.approx(report["energy_j"])}


@pytest.mark.slow
def test_a_starved_cpu_loop_is_measured_and_named_once_per_epoch(
    tmp_path, use_fake, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(gpu_callback, "MIN_WAIT_WARNING_S", 0.2)
    use_fake(FakeNvml(1))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        fit(
            tmp_path, GpuStatsMonitor(), epochs=2, train_loader=loader(0.025)
        )  # CPU: no GPU figures
    rows = gpu_rows(tmp_path, "loop/data_wait_frac")
    assert len(rows) == 2 and not any(k.startswith("gpu/") and v for k, v in rows[0].items())
    for row in rows:
        assert float(row["loop/data_wait_frac"]) > 0.5  # 100 ms of loading per batch
        assert 0 < float(row["loop/samples_per_s"]) < 4 / 0.1
    starved = [r.getMessage() for r in caplog.records if "waited for the next batch" in r.message]
    assert len(starved) == 2 and all(
        r.levelno == logging.WARNING for r in caplog.records if "waited" in r.getMessage()
    )
    assert "no GPU reading" in starved[0]
    for setting in ("data.num_workers=0", "data.pin_memory=False", "data.batch_size=4"):
        assert setting in starved[0]


@pytest.mark.gpu
def test_real_gpm_on_a_hopper_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with an NVIDIA driver (torch.cuda.is_available() is False)")
    nvml.use_library(None)
    with nvml.nvml_session() as lib:
        found = nvml.find_handle(lib, gpu_callback.cuda_device_uuid(0))
        assert found is not None
        reader = GpuReader(lib, found[0], "cuda0", DEFAULT_GROUPS)
        reader.probe()
        try:
            if "gpm" not in reader.groups:
                pytest.skip(f"GPM is not supported here ({reader.unsupported.get('gpm')})")
            a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
            end = time.monotonic() + 1.0
            while time.monotonic() < end:  # tensor-core work for a second
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
            values, _ = reader.read()
        finally:
            reader.close()
    assert 0 < values["sm_active"] <= 100 and 0 < values["tensor_active"] <= 100
    assert 0 <= values["sm_occupancy"] <= 100 and 0 <= values["dram_active"] <= 100


# --------------------------------------------------------------------------- DDP
SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from runkit.gpus import nvml
    from runkit.gpu_stats.callback import GpuStatsMonitor
    from runkit.testing.fake_nvml import FakeGpu, FakeNvml

    variant, out_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning for the launched rank 1
    broken = variant == "rank1_no_nvml" and rank == 1
    fake = FakeNvml([FakeGpu(util_gpu=30, name="gpu0"), FakeGpu(util_gpu=80, name="gpu1")],
                    init_error="driver_not_loaded" if broken else None)
    nvml.use_library(fake)

    class LoseGpu1(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if variant == "rank1_lost" and trainer.global_rank == 1:
                fake.gpus[1].lose(at=0.0)  # the real clock is past 0: lost from now on

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)
        def training_step(self, batch, i):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x), y)
        def validation_step(self, batch, i):
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.layer(x), y))
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    monitor = GpuStatsMonitor(interval_s=0.05, device_uuids=[g.uuid for g in fake.gpus],
                              summary_table=False)
    # Monitors on GPU keys: each rank must find them in its own trainer.callback_metrics.
    watchers = []
    if variant == "ok":
        watchers = [
            EarlyStopping(monitor="gpu/all/util_mean_max", mode="max", patience=5,
                          check_on_train_epoch_end=True),
            ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), mode="max",
                            monitor="gpu/node0/cuda1/util_mean", save_on_train_epoch_end=True),
        ]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, log_every_n_steps=1,
        logger=CSVLogger(out_dir, name="csv", version=0), enable_checkpointing=bool(watchers),
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[monitor, LoseGpu1(), *watchers],
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer.fit(M(), loader, loader)
    if watchers:
        print(f"RANK {trainer.global_rank} BEST {float(watchers[1].best_model_score)} "
              f"SAMPLES {monitor.run_samples()} GPUS {sorted(monitor.run_energy_j())}", flush=True)
    print(f"RANK {trainer.global_rank} DONE balanced={fake.balanced} inits={fake.init_count}",
          flush=True)
    """
)


def run_ddp(tmp_path: Path, variant: str) -> tuple[str, list[dict[str, str]]]:
    script = tmp_path / "ddp_run.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROJECT_", "LOCAL_RANK"))}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, str(script), variant, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,  # a hang in a collective fails here instead of blocking the suite
        env=env,
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    return output, rows


def column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key)]


@pytest.mark.slow
def test_ddp_gathers_every_rank_gpu(tmp_path: Path) -> None:
    output, rows = run_ddp(tmp_path, "ok")
    assert column(rows, "gpu/node0/cuda0/util_mean") == [30, 30]
    assert column(rows, "gpu/node0/cuda1/util_mean") == [80, 80]  # only rank 1 sampled it
    assert column(rows, "gpu/all/util_mean_min") == [30, 30]
    assert column(rows, "gpu/all/util_mean_max") == [80, 80]
    assert column(rows, "gpu/all/util_mean_mean") == [55, 55]
    assert len(column(rows, "loop/data_wait_frac")) == 2
    # each validation's figures, every rank's, reach rank 0 with the epoch's exchange
    assert column(rows, "gpu_val/node0/cuda1/util_mean") == [80, 80]
    assert column(rows, "gpu_val/all/util_mean_mean") == [55, 55]
    for rank in (0, 1):
        assert f"RANK {rank} DONE balanced=True inits=1" in output, output
        # rank 1's monitors saw rank 1's own key and the aggregates, without any all-reduce;
        # 2 epochs x 4 batches per rank x 4 samples x 2 ranks; each rank knows both GPUs' energy
        gpus = "['node0/cuda0', 'node0/cuda1']"
        expected = f"RANK {rank} BEST 80.0 SAMPLES 64.0 GPUS {gpus}"
        assert expected in output, output


@pytest.mark.slow
def test_ddp_rank_without_nvml_still_joins_the_gather(tmp_path: Path) -> None:
    output, rows = run_ddp(tmp_path, "rank1_no_nvml")
    assert column(rows, "gpu/node0/cuda0/util_mean") == [30, 30]
    assert not column(rows, "gpu/node0/cuda1/util_mean")
    assert "RANK 1 DONE balanced=True inits=0" in output, output
    assert "rank 1: off: NVML is not available" in output


@pytest.mark.slow
def test_ddp_gpu_lost_on_one_rank_mid_run(tmp_path: Path) -> None:
    output, rows = run_ddp(tmp_path, "rank1_lost")
    assert column(rows, "gpu/node0/cuda0/util_mean") == [30, 30]
    assert column(rows, "gpu/node0/cuda1/util_mean") == [80]  # epoch 0 only
    assert "RANK 1 DONE balanced=True inits=1" in output, output
