"""GpuStatsMonitor on machines without a GPU: the fake NVML stands in for the driver.

The sampler is driven by hand against a FakeClock where exact statistics are checked; full
``Trainer.fit`` runs use the ``device_uuids`` argument to say which fake GPU the CPU "device" is.
"""

from __future__ import annotations

import csv
import functools
import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pynvml
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from conftest import stand_in
from runkit.gpu_stats import callback as gpu_callback
from runkit.gpu_stats.callback import GpuStatsMonitor, cuda_device_uuid, process_devices
from runkit.gpu_stats.exchange import RankExchange
from runkit.gpu_stats.loop import LoopTimer
from runkit.gpu_stats.sampler import DEFAULT_GROUPS, TRAIN, VAL, GpuReader, GpuSampler
from runkit.gpu_stats.statistics import flatten_epoch
from runkit.gpus import nvml
from runkit.gpus.nvml import find_handle
from runkit.testing.fake_nvml import GIB, FakeClock, FakeGpu, FakeNvml, FakeProcess

SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap
LOGGER = "runkit.gpu_stats"  # every module of the package logs under it
REPO = Path(__file__).resolve().parents[3]


def open_reader(fake: FakeNvml, index: int, groups=DEFAULT_GROUPS) -> GpuReader:
    handle = fake.nvmlDeviceGetHandleByIndex(index)
    reader = GpuReader(fake, handle, f"cuda{index}", groups)
    reader.probe()
    return reader


# --------------------------------------------------------------------------- device mapping
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


def test_callback_setup_resolves_cuda_devices_by_uuid(monkeypatch, use_fake, caplog) -> None:
    """The whole setup path with CUDA devices (faked torch side): cuda0 -> physical GPU 2."""
    fake = use_fake(FakeNvml([FakeGpu(name=f"gpu{i}") for i in range(4)]))
    uuids = visible_uuids(fake, "2,3", fastest_first=False)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i])
    )
    trainer = stand_in("cuda:0", "cuda:1")
    monitor = GpuStatsMonitor()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(trainer, None, "fit")
    try:
        (payload,) = monitor.identities
        assert [(g["label"], g["name"], g["nvml_index"]) for g in payload["gpus"]] == [
            ("cuda0", "gpu2", 2),
            ("cuda1", "gpu3", 3),
        ]
        assert any(
            "node0/cuda0 = gpu2" in r.message and fake.gpus[2].uuid in r.message
            for r in caplog.records
        )
    finally:
        monitor.teardown(trainer, None, "fit")
    assert fake.balanced and not fake.initialised


def test_process_devices_one_process_many_gpus_vs_one_per_rank() -> None:
    cuda = [torch.device("cuda", i) for i in range(2)]
    # one process drives both (DataParallel-like): both are sampled here
    assert [p for p, _ in process_devices(stand_in(*cuda))] == [0, 1]
    # DDP: rank 1 drives parallel_devices[1] only
    ddp = stand_in(*cuda, world_size=2, local_rank=1)
    assert process_devices(ddp) == [(1, torch.device("cuda", 1))]
    single = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        world_size=1,
        num_nodes=1,
        local_rank=0,
    )
    assert process_devices(single) == [(0, torch.device("cpu"))]


# --------------------------------------------------------------------------- statistics
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
    sampler.set_phase(TRAIN)  # t=0
    for _ in range(3):  # t=1, 2, 3
        clock.advance(1)
        sampler.sample_now()
    clock.advance(1)  # t=4: the closing sample
    sampler.sample_now()
    summary = sampler.summaries(TRAIN)["cuda0"]
    # A boundary sample belongs to the phase it closes: the t=0 one closed "no phase", so the
    # epoch's samples are t = 1, 2, 3, 4.
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


def test_validation_is_split_out_of_the_training_epoch() -> None:
    clock = FakeClock()
    fake = FakeNvml(
        [
            FakeGpu(
                util_gpu=[(0, 80), (2, 10), (3, 80)],
                power_mw=[(0, 400_000), (2, 100_000), (3, 400_000)],
            )
        ],
        clock=clock,
    )
    fake.nvmlInit()
    sampler = GpuSampler([open_reader(fake, 0)], interval_s=1.0)
    sampler.sample_now()  # t=0: primes the energy counter
    sampler.set_phase(TRAIN)
    clock.set(1)
    sampler.sample_now()
    clock.set(2)
    sampler.sample_now()  # closes train with t=2 (util 10 counts for train)
    sampler.set_phase(VAL)
    clock.set(3)
    sampler.sample_now()  # closing sample t=3 (util 80)
    val = sampler.summaries(VAL)["cuda0"]
    sampler.set_phase(TRAIN, reset=False)
    clock.set(4)
    sampler.sample_now()
    train = sampler.summaries(TRAIN)["cuda0"]
    # A boundary sample belongs to the phase it closes: train has t = 1 (80), 2 (10), 4 (80);
    # validation has t = 3 (80).
    assert train["samples"] == 3 and val["samples"] == 1
    assert train["util_mean"] == pytest.approx((80 + 10 + 80) / 3)
    assert val["util_mean"] == 80
    # energy: train gets t 0..2 (2 s x 400 W) and 3..4 (400 W); val gets 2..3 (100 W)
    assert train["energy_j"] == pytest.approx(800 + 400)
    assert val["energy_j"] == pytest.approx(100)
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
    sampler = GpuSampler([plain, mig], interval_s=1.0)
    sampler.set_phase(TRAIN)
    out = sampler.summaries(TRAIN)  # one sample: the phase had none
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
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sampler.set_phase(TRAIN)
        for _ in range(4):
            clock.advance(1)
            sampler.sample_now()
        sampler.sample_now()
    out = sampler.summaries(TRAIN)
    # samples at t = 1, 2, 3, 4 and the closing one at t = 4; the lost GPU only has t = 1
    assert out["cuda0"]["samples"] == 5 and out["cuda0"]["util_mean"] == 30
    assert out["cuda1"]["samples"] == 1 and out["cuda1"]["util_mean"] == 60
    lost = [r for r in caplog.records if "stopped sampling cuda1" in r.message]
    assert len(lost) == 1 and "GpuIsLost" in lost[0].message
    assert [r.label for r in sampler.alive] == ["cuda0"]
    fake.nvmlShutdown()


def test_flatten_keys_per_node_and_across_gpus() -> None:
    payloads = [
        {"node": 0, "gpus": {"cuda0": {"util_mean": 90.0, "energy_j": 10.0, "sample_ms": 1.0}}},
        {"node": 1, "gpus": {"cuda0": {"util_mean": 30.0, "energy_j": 20.0, "sample_ms": 2.0}}},
        {"node": 1, "gpus": {}},  # a rank whose NVML failed still takes part
    ]
    logged = flatten_epoch(payloads, "gpu", log_cost=False)
    assert logged["gpu/node0/cuda0/util_mean"] == 90 and logged["gpu/node1/cuda0/util_mean"] == 30
    assert (logged["gpu/all/util_mean_min"], logged["gpu/all/util_mean_max"]) == (30, 90)
    assert logged["gpu/all/util_mean_mean"] == 60 and logged["gpu/all/energy_j_sum"] == 30
    assert not any("sample_ms" in k for k in logged)
    assert "gpu/node1/cuda0/sample_ms" in flatten_epoch(payloads, "gpu", log_cost=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval_s": -1.0}, "interval_s=-1.0; give seconds > 0"),
        ({"interval_s": "1"}, "interval_s='1'; give seconds > 0"),
        (
            {"device_uuids": ["GPU-1", 2]},
            "device_uuids=['GPU-1', 2]; give a list of NVML UUID strings",
        ),
        ({"key_prefix": ""}, "key_prefix=''; give a word without '/'"),
        ({"per_gpu_keys_up_to": True}, "per_gpu_keys_up_to=True; give a GPU count >= 0"),
        ({"per_gpu_keys_up_to": 2.0}, "per_gpu_keys_up_to=2.0; give a GPU count >= 0"),
        ({"data_wait_warning": True}, "data_wait_warning=True; give a number in [0, 1]"),
        ({"data_wait_warning": -0.1}, "data_wait_warning=-0.1; give a number in [0, 1]"),
        ({"gpu_idle_below_pct": 100.5}, "gpu_idle_below_pct=100.5; give a number in [0, 100]"),
        ({"interval_s": 0}, "interval_s=0; give seconds > 0"),
        ({"device_uuids": "GPU-1"}, "device_uuids='GPU-1'; give a list of NVML UUID strings"),
        ({"key_prefix": "a/b"}, "key_prefix='a/b'; give a word without '/'"),
        ({"per_gpu_keys_up_to": -1}, "per_gpu_keys_up_to=-1; give a GPU count >= 0"),
        ({"sampler": "x"}, "sampler='x'; give one of process, thread"),
        ({"gpu_idle_below_pct": "x"}, "gpu_idle_below_pct='x'; give a number in [0, 100]"),
    ],
)
def test_each_bad_argument_is_named_with_what_is_accepted(kwargs, message) -> None:
    with pytest.raises(ValueError) as raised:
        GpuStatsMonitor(**kwargs)
    assert str(raised.value).startswith(f"GpuStatsMonitor: {message}")


def test_device_uuids_is_not_in_the_users_yaml_but_an_override_still_reaches_it() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from tinyapp import config_dir
    from runkit.run.preflight import check_targets

    assert "device_uuids" not in (REPO / "configs" / "callbacks" / "gpu_stats.yaml").read_text()
    uuid = "GPU-00000000-fa6e-4000-8000-000000000000"
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"+callbacks.gpu_stats.device_uuids=['{uuid}']"])
    check_targets(cfg.callbacks.gpu_stats, "callbacks.gpu_stats")  # the preflight accepts it
    assert instantiate(cfg.callbacks.gpu_stats).device_uuids == [uuid]


def test_too_few_device_uuids_is_a_clear_error(use_fake) -> None:
    fake = use_fake(FakeNvml(1))
    trainer = stand_in("cpu", "cpu", world_size=2, local_rank=1)
    with pytest.raises(ValueError, match=r"device_uuids has 1 entries .*parallel_devices\[1\]"):
        GpuStatsMonitor(device_uuids=[fake.gpus[0].uuid]).setup(trainer, None, "fit")
    assert fake.balanced


def test_nvml_init_failure_is_one_line_and_nothing_else(use_fake, caplog) -> None:
    fake = use_fake(FakeNvml(1, init_error="driver_not_loaded"))
    trainer = stand_in("cpu")
    monitor = GpuStatsMonitor(device_uuids=[fake.gpus[0].uuid])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(trainer, None, "fit")
        monitor.on_train_epoch_start(trainer, None)
        monitor.on_train_epoch_end(
            trainer, Module(trainer)
        )  # would need pl_module.log if it were active
        monitor.teardown(trainer, None, "fit")
    lines = [r for r in caplog.records if r.name.startswith(LOGGER)]
    assert len(lines) == 1 and "Driver Not Loaded" in lines[0].getMessage()
    assert fake.init_count == fake.shutdown_count == 0


# --------------------------------------------------------------------------- the hooks, by hand
class RecordingLogger:
    """Stands in for a Lightning logger: what ``log_metrics`` received, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((dict(metrics), step))


class Module:
    """Stands in for the LightningModule: ``log`` puts a value where monitors read it."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def log(self, name: str, value: float, **kwargs: Any) -> None:
        assert kwargs == {"logger": False, "batch_size": 1}
        self.trainer.callback_metrics[name] = torch.tensor(value)


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


@pytest.fixture
def no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """No background sampling: the hooks' own closing samples are the only ones (exact sums).

    The sampler is driven by hand in this process (a thread sampler that never starts its
    thread), so ``GpuStatsMonitor``'s default becomes ``sampler="thread"`` here.
    """
    monkeypatch.setattr(GpuSampler, "start", lambda self: None)
    init = functools.partialmethod(GpuStatsMonitor.__init__, sampler="thread")
    monkeypatch.setattr(GpuStatsMonitor, "__init__", init)  # a test's own sampler= still wins


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


# --------------------------------------------------------------------------- the callback's hooks
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
    logger, other = RecordingLogger(), RecordingLogger()
    trainer = stub_trainer(loggers=[logger, other])
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
    monitor.on_validation_start(trainer, None)
    monitor.on_validation_epoch_start(trainer, None)
    clock.set(5.0)
    monitor.on_validation_epoch_end(
        trainer, Module(trainer)
    )  # samples t=5 (util 60, temp 50) for val
    clock.set(9.0)
    train_steps(monitor, trainer, clock, [0.5])  # the 5 s of validation are not waiting
    clock.set(11.0)
    monitor.on_train_epoch_end(trainer, Module(trainer))  # samples t=11 for training
    monitor.on_fit_end(trainer, None)
    monitor.teardown(trainer, None, "fit")

    (val, val_step), (train, step) = logger.calls
    assert other.calls == logger.calls  # every logger, one call each
    assert (val_step, step) == (12, 11)  # 12 batches stepped; Lightning's epoch row is at 11
    assert len(val) == 22 and val["epoch"] == 0  # 21 keys of the default groups, and the epoch
    assert {k.split("/")[-1]: v for k, v in val.items() if k != "epoch"}.items() >= {
        "util_mean": 60.0, "util_min": 60.0, "mem_total_gib": 80.0, "temp_c_max": 50.0,
        "power_w_mean": 200.0, "power_ratio_max": 0.5, "sm_clock_mhz_min": 1980.0,
        "throttle_any_frac": 0.0, "samples": 1.0,
    }.items()  # fmt: skip
    # the first sample (t=5, validation) primes the energy counter; t=11 closes 6 s at 200 W
    assert train["gpu/node0/cuda0/energy_j"] == pytest.approx(1200.0)
    assert train["gpu/node0/cuda0/samples"] == 1.0
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
        row["util_mean"] == 60.0 and row["samples"] == 1 and row["energy_j"] == pytest.approx(1200)
    )
    out = capsys.readouterr().out
    assert "GPU statistics over the run" in out and "1.20" in out  # kJ
    assert fake.balanced and not fake.initialised


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
        monitor.on_train_epoch_end(trainer, Module(trainer))
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
        monitor.on_train_epoch_end(trainer, Module(trainer))
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
        monitor.on_train_epoch_end(trainer, Module(trainer))
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
    monitor.on_train_epoch_end(trainer, Module(trainer))
    assert trainer.callback_metrics["loop/samples_per_s"].item() == 8.0


def test_no_step_means_nothing_is_logged(monkeypatch) -> None:
    logger = RecordingLogger()
    monitor = GpuStatsMonitor()
    trainer = stub_trainer(loggers=[logger])
    monitor.setup(trainer, None, "fit")
    monitor.on_train_epoch_start(trainer, None)
    monitor.on_train_epoch_end(
        trainer, Module(trainer)
    )  # an epoch with no batch: no figures, no call
    assert logger.calls == [] and monitor.run_samples() == 0.0


def test_sanity_checking_and_disabled_validation_log_no_validation_figures(
    monkeypatch, use_fake, no_thread
) -> None:
    clock = FakeClock()
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=10)], clock=clock))
    monitor = monitor_on(monkeypatch, fake, clock, report_validation=False, key_prefix="dev")
    logger = RecordingLogger()
    trainer = stub_trainer(loggers=[logger], sanity_checking=True)
    monitor.setup(trainer, None, "fit")
    for hook in ("on_validation_start", "on_validation_epoch_start", "on_validation_epoch_end"):
        getattr(monitor, hook)(trainer, Module(trainer))  # the sanity check: nothing happens
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 1  # the probe's only
    trainer.sanity_checking = False
    monitor.on_train_epoch_start(trainer, None)
    train_steps(monitor, trainer, clock, [1.0])  # t = 2
    monitor.on_validation_start(trainer, None)
    monitor.on_validation_epoch_start(trainer, None)
    clock.set(4.0)
    monitor.on_validation_epoch_end(trainer, Module(trainer))  # logs nothing, reads no GPU
    assert logger.calls == []
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 1  # no closing sample: not reported
    assert monitor.run_samples() == 8.0  # the epoch so far counts, for a checkpoint saved now
    clock.set(6.0)
    train_steps(monitor, trainer, clock, [0.0])  # validation 2..6 left out; t = 7
    monitor.on_train_epoch_end(trainer, Module(trainer))
    monitor.teardown(trainer, None, "fit")
    ((row, _),) = logger.calls
    assert row["dev/node0/cuda0/util_mean"] == 10.0
    assert row["loop/data_wait_frac"] == pytest.approx(1.0 / 3.0)
    assert not any(k.startswith("dev_val/") for k in row)
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
        monitor.on_train_epoch_end(trainer, Module(trainer))
    assert monitor.run_samples() == 32.0 and monitor.state_dict()["train_samples"] == 32.0
    monitor.on_train_epoch_start(trainer, None)
    monitor.on_train_batch_start(trainer, None, None, 0)
    monitor.on_train_batch_end(trainer, None, None, ["no tensor"], 0)
    monitor.on_train_epoch_end(trainer, Module(trainer))
    assert monitor.run_samples() is None
    monitor.on_train_epoch_start(trainer, None)
    train_steps(monitor, trainer, clock, [0.0])
    monitor.on_train_epoch_end(trainer, Module(trainer))
    assert monitor.run_samples() is None  # unknown once, unknown for the run


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


def test_ranks_in_the_same_state_share_one_line(caplog) -> None:
    gpu = {"label": "cuda0", "name": "n", "uuid": "MIG-1", "nvml_index": 3, "pci_bus_id": "b",
           "mig": True, "unsupported": ["fan", "utilization"]}  # fmt: skip
    with caplog.at_level(logging.INFO, logger=LOGGER):
        GpuStatsMonitor()._report_setup(
            [
                {"rank": 0, "node": 0, "status": "off: x", "gpus": [], "quiet": True},
                {"rank": 1, "node": 0, "status": "off: x", "gpus": [], "quiet": True},
                {"rank": 2, "node": 1, "status": "off: x", "gpus": []},
                {"rank": 3, "node": 1, "status": "off: y", "gpus": [], "problems": ["p"]},
                {"rank": 4, "node": 1, "status": "on", "gpus": [gpu]},
            ]
        )
    suffix = "; training continues without GPU statistics"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
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


def test_a_bug_in_the_bookkeeping_stops_sampling_with_one_line(
    monkeypatch, use_fake, no_thread, caplog
) -> None:
    clock = FakeClock()
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=10)], clock=clock))
    monitor = monitor_on(monkeypatch, fake, clock)
    trainer = stub_trainer()
    monitor.setup(trainer, None, "fit")

    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError("oops")

    monkeypatch.setattr(GpuSampler, "set_phase", broken)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monitor.on_train_epoch_start(trainer, None)
    assert [r.getMessage() for r in caplog.records] == [
        "gpu_stats: epoch start failed (KeyError: 'oops'); sampling stops"
    ]
    assert fake.balanced and not fake.initialised  # NVML is shut down at once
    train_steps(monitor, trainer, clock, [0.0])
    monitor.on_train_epoch_end(
        trainer, Module(trainer)
    )  # the epoch still ends (and gathers), without GPUs
    ((row, _),) = trainer.loggers[0].calls
    assert not any(k.startswith("gpu/") for k in row) and "loop/data_wait_frac" in row


def test_an_exception_closes_nvml(use_fake) -> None:
    fake = use_fake(FakeNvml(1))
    monitor = GpuStatsMonitor(interval_s=1000.0, device_uuids=[fake.gpus[0].uuid])
    trainer = stub_trainer()
    monitor.setup(trainer, None, "fit")
    assert fake.initialised
    monitor.on_exception(trainer, None, RuntimeError("x"))
    assert fake.balanced and not fake.initialised
    monitor.on_exception(trainer, None, RuntimeError("x"))  # twice is fine


# --------------------------------------------------------------------------- ranks, through a store
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
    import time

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


# --------------------------------------------------------------------------- real Trainer.fit
class TinyModel(pl.LightningModule):
    def __init__(self, fail_at_step: int | None = None, step_s: float = 0.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.fail_at_step, self.step_s = fail_at_step, step_s

    def training_step(self, batch, batch_idx):
        if self.fail_at_step is not None and self.global_step >= self.fail_at_step:
            raise RuntimeError("model blew up")
        time.sleep(self.step_s)
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.layer(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SlowData(torch.utils.data.Dataset):
    """A data set that takes ``delay_s`` per sample, like one decoding files on one core."""

    def __init__(self, delay_s: float = 0.0, n: int = 64) -> None:
        self.delay_s, self.x, self.y = delay_s, torch.randn(n, 4), torch.randint(0, 2, (n,))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        return self.x[i], self.y[i]


def loader(delay_s: float = 0.0) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(SlowData(delay_s), batch_size=4)


class CallsPerStep(pl.Callback):
    """Records the fake's NVML call count from the training thread at every step."""

    def __init__(self, fake: FakeNvml, step_s: float = 0.0) -> None:
        self.fake = fake
        self.step_s = step_s  # a floor on step time: an epoch outlasts the sampler interval
        self.counts: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.counts.setdefault(trainer.current_epoch, []).append(self.fake.calls_in_thread())
        time.sleep(self.step_s)


def fit(tmp_path, monitor, *callbacks, epochs=2, loggers=None, model=None, train_loader=None,
        ckpt_path=None, **options):  # fmt: skip
    """A real fit on CPU, the monitor first; Trainer ``options`` override the defaults."""
    options = {"limit_train_batches": 12, "limit_val_batches": 2, "num_sanity_val_steps": 1,
               "log_every_n_steps": 1, **options}  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        logger=loggers if loggers is not None else CSVLogger(tmp_path, name="csv", version=0),
        callbacks=[monitor, *callbacks],
        **options,
    )
    trainer.fit(model or TinyModel(), train_loader or loader(), loader(), ckpt_path=ckpt_path)
    return trainer


def gpu_rows(tmp_path: Path, key: str = "gpu/node0/cuda0/samples") -> list[dict[str, str]]:
    """The CSV rows that hold ``key``."""
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
        return [r for r in csv.DictReader(handle) if r.get(key)]


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


def test_a_fit_counts_the_samples_of_its_batches_exactly(tmp_path, use_fake) -> None:
    # 64 samples in batches of 6: 10 whole and a last one of 4.
    fake = use_fake(FakeNvml([FakeGpu()]))
    monitor = GpuStatsMonitor(interval_s=1000.0, device_uuids=[fake.gpus[0].uuid])
    truth = SamplesInBatches(monitor)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    fit(tmp_path, monitor, truth, train_loader=torch.utils.data.DataLoader(data, 6))
    assert truth.pairs == [(64, 64)] * 2


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
        interval_s=0.02, device_uuids=[fake.gpus[0].uuid], log_sampler_cost=True
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
    monitor = GpuStatsMonitor(interval_s=30.0, device_uuids=[fake.gpus[0].uuid], sampler="thread")

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
