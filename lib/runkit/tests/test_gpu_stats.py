"""GpuStatsMonitor on the fake NVML: hooks driven by hand on a FakeClock for exact figures, and
real fits (``device_uuids`` names the CPU device's fake GPU) sharing one trained run."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LambdaCallback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, default_collate

from conftest import stand_in
from runkit.gpu_stats import callback as gpu_callback
from runkit.gpu_stats.callback import GpuStatsMonitor, LoopTimer
from runkit.gpu_stats.exchange import RankExchange
from runkit.gpu_stats.sampler import GpuSampler
from runkit.gpus import nvml
from runkit.run import run_files
from runkit.testing.fake_nvml import GIB, FakeClock, FakeGpu, FakeNvml, FakeProcess

LOGGER = "runkit.gpu_stats"  # every module of the package logs under it
HOPPER_GPM = {"SM_UTIL": 60, "SM_OCCUPANCY": 30, "ANY_TENSOR_UTIL": 20, "DRAM_BW_UTIL": 45}


# --------------------------------------------------------------------------- devices, arguments
def test_callback_setup_resolves_cuda_devices_by_uuid(monkeypatch, use_fake, caplog) -> None:
    # find_handle's UUID spellings (bare, MIG-): test_devices.py
    fake = use_fake(FakeNvml([FakeGpu(name=f"gpu{i}") for i in range(4)]))
    uuids = [g.uuid.split("-", 1)[1] for g in fake.gpus[2:]]  # torch: bare UUIDs, cuda:0 = GPU 2
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))  # fmt: skip
    trainer, monitor = stand_in("cuda:0", "cuda:1"), GpuStatsMonitor()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(trainer, None, "fit")
    monitor.teardown(trainer, None, "fit")
    (payload,) = monitor.identities
    assert [(g["label"], g["name"], g["nvml_index"]) for g in payload["gpus"]] == [("cuda0", "gpu2", 2), ("cuda1", "gpu3", 3)]  # fmt: skip
    assert any("node0/cuda0 = gpu2" in r.message and fake.gpus[2].uuid in r.message for r in caplog.records)  # fmt: skip
    assert fake.balanced and not fake.initialised
    cuda = [torch.device("cuda", i) for i in range(2)]
    devices = gpu_callback.process_devices
    assert [p for p, _ in devices(stand_in(*cuda))] == [0, 1]  # one process drives both
    ddp = stand_in(*cuda, world_size=2, local_rank=1)  # DDP: rank 1 drives its own only
    assert devices(ddp) == [(1, torch.device("cuda", 1))]
    single = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")),
                             world_size=1, num_nodes=1, local_rank=0)  # fmt: skip
    assert devices(single) == [(0, torch.device("cpu"))]


BAD_ARGUMENTS = [
    ("interval_s", (-1.0, "1", 0), "seconds > 0"),
    ("gather_timeout_s", (0,), "seconds > 0"),
    ("device_uuids", (["GPU-1", 2], "GPU-1"), "a list of NVML UUID strings"),
    ("key_prefix", ("", "a/b"), "a word without '/'"),
    ("per_gpu_keys_up_to", (True, 2.0, -1), "a GPU count >= 0"),
    ("data_wait_warning", (True, -0.1), "a number in [0, 1]"),
    ("gpu_idle_below_pct", (100.5, "x"), "a number in [0, 100]"),
]


@pytest.mark.parametrize(
    ("name", "value", "accepted"), [(n, v, a) for n, values, a in BAD_ARGUMENTS for v in values]
)
def test_each_bad_argument_is_named_with_what_is_accepted(name, value, accepted) -> None:
    with pytest.raises(ValueError) as raised:
        GpuStatsMonitor(**{name: value})
    assert str(raised.value) == f"GpuStatsMonitor: {name}={value!r}; give {accepted}"


def test_device_uuids_is_an_override_not_in_the_yaml_and_too_few_is_a_clear_error(use_fake) -> None:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    yaml = (Path(__file__).parents[3] / "configs" / "callbacks" / "gpu_stats.yaml").read_text()
    assert "device_uuids" not in yaml
    uuid = "GPU-00000000-fa6e-4000-8000-000000000000"
    cfg = OmegaConf.merge(OmegaConf.create(yaml), {"gpu_stats": {"device_uuids": [uuid]}})
    assert instantiate(cfg.gpu_stats).device_uuids == [uuid]
    fake = use_fake(FakeNvml(1))
    trainer = stand_in("cpu", "cpu", world_size=2, local_rank=1)
    with pytest.raises(ValueError, match=r"device_uuids has 1 entries .*parallel_devices\[1\]"):
        GpuStatsMonitor(device_uuids=[fake.gpus[0].uuid]).setup(trainer, None, "fit")
    assert fake.balanced


# --------------------------------------------------------------------------- the hooks, by hand
class RecordingLogger(list):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.append((dict(metrics), step))


class Hand:
    """A monitor driven hook by hook, its loop and the fake NVML on one FakeClock; the sampler's
    thread ends at once, so only setup's reading and :meth:`sample` count. Also the module."""

    def __init__(self, monkeypatch, gpus=(), trainer=None, devices=("cpu",), **kwargs) -> None:
        self.clock = FakeClock()
        monkeypatch.setattr(gpu_callback, "LoopTimer", lambda: LoopTimer(self.clock))
        monkeypatch.setattr(GpuSampler, "_run", lambda sampler: None)
        self.fake = FakeNvml(list(gpus), clock=self.clock)
        monkeypatch.setattr(nvml, "load_library", lambda: self.fake)
        if gpus:
            kwargs.setdefault("device_uuids", [self.fake.gpus[0].uuid])
        self.monitor = GpuStatsMonitor(interval_s=1000.0, **kwargs)
        values: dict[str, Any] = dict(
            callbacks=[], loggers=[RecordingLogger()], callback_metrics={}, current_epoch=0,
            global_step=12, train_dataloader=SimpleNamespace(num_workers=0, pin_memory=False, batch_size=4),
        )  # fmt: skip
        self.trainer = SimpleNamespace(**{**vars(stand_in(*devices)), **values, **(trainer or {})})
        self.module = self

    def log(self, name: str, value: float, **kwargs: Any) -> None:  # as LightningModule.log
        assert kwargs == {"logger": False, "batch_size": 1}
        self.trainer.callback_metrics[name] = torch.tensor(value)

    @property
    def calls(self) -> list[tuple[dict[str, float], int]]:
        return self.trainer.loggers[0]

    def sample(self, t: float) -> None:
        self.clock.set(t)
        self.monitor._sampler.sample_now()

    def steps(self, *waits: float, batch: Any = None) -> None:
        """One training step per wait: ``wait`` s fetching the batch (8 samples), then 1 s."""
        for wait in waits:
            self.clock.advance(wait)
            self.monitor.on_train_batch_start(self.trainer, None, None, 0)
            self.clock.advance(1.0)
            batch_ = (torch.zeros(8, 2), torch.zeros(8)) if batch is None else batch
            self.monitor.on_train_batch_end(self.trainer, None, None, batch_, 0)

    def validate(self, start: float, end: float) -> None:
        self.clock.set(start)
        self.monitor.on_validation_epoch_start(self.trainer, self.module)
        self.clock.set(end)
        self.monitor.on_validation_epoch_end(self.trainer, self.module)

    def epoch(self, *waits: float, end: bool = True) -> None:
        self.monitor.on_train_epoch_start(self.trainer, None)
        self.steps(*waits)
        if end:
            self.monitor.on_train_epoch_end(self.trainer, self.module)

    def run(self, *waits: float, caplog=None) -> None:
        """Setup, one epoch of ``waits``, the fit's end and teardown."""
        with caplog.at_level(logging.INFO, logger=LOGGER) if caplog else warnings.catch_warnings():
            self.monitor.setup(self.trainer, None, "fit")
            self.epoch(*waits)
            self.monitor.on_fit_end(self.trainer, None)
            self.monitor.teardown(self.trainer, None, "fit")


@pytest.mark.parametrize(("bindings", "words"), [(True, "Driver Not Loaded"), (False, "not installed")])  # fmt: skip
def test_no_driver_or_no_bindings_is_one_line_and_no_warning(monkeypatch, caplog, bindings, words) -> None:  # fmt: skip
    real = nvml.load_library
    hand = Hand(monkeypatch, [FakeGpu()])
    fake = FakeNvml(1, init_error="driver_not_loaded")
    monkeypatch.setattr(nvml, "load_library", (lambda: fake) if bindings else real)
    if not bindings:  # as if nvidia-ml-py were not installed
        monkeypatch.setitem(sys.modules, "pynvml", None)
        monkeypatch.delenv(nvml.BACKEND_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning from us is fatal
        hand.run(caplog=caplog)  # inactive: no log
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]
    assert words in line and fake.init_count == fake.shutdown_count == 0
    assert hand.calls == []


def test_an_epoch_with_validation_logs_exact_figures_once_each(monkeypatch, caplog, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    peaks, resets = [0.0, 0.0], []  # PyTorch's peaks on the stand-in cuda:0, GiB
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peaks[0] * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: peaks[1] * GIB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: resets.append(d) or peaks.__setitem__(slice(None), [0.0, 0.0]))  # fmt: skip
    gpu = FakeGpu(name="Fake H100", util_gpu=[(0, 20), (5, 60)], power_mw=200_000,
                  power_limit_mw=400_000, temperature=[(0, 40), (5, 50)])  # fmt: skip
    hand = Hand(monkeypatch, [gpu], devices=("cuda:0",))
    hand.trainer.loggers.append(RecordingLogger())
    monitor, trainer, fake = hand.monitor, hand.trainer, hand.fake
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(trainer, None, "fit")  # the first reading, t=0: primes the energy counter
    assert [r.getMessage() for r in caplog.records] == [
        f"gpu_stats: node0/cuda0 = Fake H100, {gpu.uuid}, NVML index 0, PCI "
        f"{gpu.pci_bus_id}; not supported: gpm"
    ]
    assert [p["status"] for p in monitor.identities] == ["on"]
    hand.epoch(1.0, 0.5, end=False)  # t = 3.5
    peaks[:] = [3.0, 4.0]
    hand.sample(3.5)  # training: util 20, 3.5 s at 200 W
    hand.clock.set(4.0)
    monitor.on_validation_epoch_start(trainer, hand.module)  # training's torch peaks kept aside
    peaks[:] = [1.0, 5.0]
    hand.sample(5.0)  # t=5 counts for validation: util 60, temp 50, 1.5 s at 200 W
    calls = fake.total_calls()
    monitor.on_validation_epoch_end(trainer, hand.module)
    assert fake.total_calls() == calls  # the hooks read no GPU: a snapshot of the thread's
    peaks[:] = [2.0, 1.0]
    hand.clock.set(9.0)
    hand.steps(0.5)  # the 5 s of validation are not waiting
    hand.sample(11.0)  # t=11 counts for training, which goes on: 6 s at 200 W
    reads = fake.total_calls()
    monitor.on_train_epoch_end(trainer, hand.module)
    assert fake.total_calls() == reads
    (val, val_step), (train, step) = hand.calls
    assert trainer.loggers[1] == hand.calls  # every logger, one call each
    assert val_step == step == 11  # Lightning's own rows of both moments: global_step - 1
    assert len(val) == 25 and val["epoch"] == 0  # 22 keys of the default groups, 2 torch peaks
    assert {k.split("/")[-1]: v for k, v in val.items() if k != "epoch"}.items() >= {
        "util_mean": 60.0, "util_min": 60.0, "mem_total_gib": 80.0, "temp_c_max": 50.0,
        "power_w_mean": 200.0, "power_ratio_max": 0.5, "sm_clock_mhz_min": 1980.0,
        "throttle_any_frac": 0.0, "samples": 1.0, "energy_j": pytest.approx(300.0),
        "torch_peak_alloc_gib": 1.0, "torch_peak_reserved_gib": 5.0,
    }.items()  # fmt: skip
    assert {k.split("/")[-1]: v for k, v in train.items() if k.startswith("gpu/")}.items() >= {
        "samples": 2.0, "util_mean": 40.0, "util_min": 20.0, "energy_j": pytest.approx(1900.0),
        "torch_peak_alloc_gib": 3.0, "torch_peak_reserved_gib": 4.0,  # validation's left out
    }.items()  # fmt: skip
    # loop: t=0 to the last step's end (10.5) less validation (4 to 9.5); waits 1 + 0.5 + 0.5 s
    assert train["loop/data_wait_frac"] == pytest.approx(2.0 / 5.0)
    assert train["loop/samples_per_s"] == pytest.approx(24 / 5.0)  # 3 batches of 8
    assert not any("sample_ms" in k or "/all/" in k for k in train)
    assert monitor.state_dict() == {
        "version": 1, "energy_j": {"node0/cuda0": pytest.approx(2200.0)}, "train_samples": 24.0,
    }  # fmt: skip
    hand.epoch(0.0, end=False)  # a second epoch: its peaks start from nothing
    peaks[:] = [0.5, 0.5]
    hand.sample(12.0)
    monitor.on_train_epoch_end(trainer, hand.module)
    assert hand.calls[-1][0]["gpu/node0/cuda0/torch_peak_alloc_gib"] == 0.5
    assert resets == [torch.device("cuda", 0)] * 6  # each epoch's start and end, validation's two
    monitor.on_fit_end(trainer, None)
    monitor.teardown(trainer, None, "fit")
    (row,) = monitor.run_summary()
    assert (row["gpu"], row["name"], row["uuid"]) == ("node0/cuda0", "Fake H100", gpu.uuid)
    assert row["util_mean"] == pytest.approx(140 / 3) and row["samples"] == 3
    assert row["energy_j"] == pytest.approx(2100)  # training epochs: 1900 J, then 200 J
    out = capsys.readouterr().out
    assert "GPU statistics over the run" in out and "2.10" in out  # kJ
    assert fake.balanced and not fake.initialised


STARVED = (
    "loop: epoch 3 waited for the next batch 67% of its training time (4.0 s) and no GPU "
    "reading: the input pipeline holds training back. What helps: more loader processes "
    "(data.num_workers), pinned memory (data.pin_memory), a larger batch (data.batch_size); "
    "now data.num_workers=0, data.pin_memory=False, data.batch_size=4"
)


@pytest.mark.parametrize(
    ("waits", "kwargs", "warned"),
    [
        ([3.0, 1.0], {}, STARVED),  # waited 4 s of a 6 s loop, no GPU reading
        ([0.5, 0.5], {"data_wait_warning": 0.0}, True),  # a 1.0 s wait is enough
        ([0.4, 0.5], {"data_wait_warning": 0.0}, False),  # 0.9 s is not, whatever the share
        ([1.0, 1.0], {"data_wait_warning": 0.5}, False),  # exactly the threshold: no line
        ([1.0, 1.1], {"data_wait_warning": 0.5}, True),
        ([3.0], {"util": 49, "gpu_idle_below_pct": 50.0}, "the GPUs were 49% busy"),
        ([3.0], {"util": 50, "gpu_idle_below_pct": 50.0}, False),  # busy enough: no line
    ],
)
def test_the_starvation_line_needs_the_share_a_second_of_waiting_and_idle_gpus(monkeypatch, caplog, waits, kwargs, warned) -> None:  # fmt: skip
    kwargs = dict(kwargs)  # the parametrisation's own dict stays as it is, for a rerun
    util = kwargs.pop("util", None)
    hand = Hand(monkeypatch, [] if util is None else [FakeGpu(util_gpu=util)],
                trainer={"current_epoch": 3}, **kwargs)  # fmt: skip
    hand.run(*waits, caplog=caplog)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.getMessage().startswith("loop:")]  # fmt: skip
    assert len(lines) == (1 if warned else 0) and {level for level, _ in lines} <= {logging.WARNING}
    assert not isinstance(warned, str) or warned in lines[0][1]
    if warned == STARVED:
        assert lines[0][1] == STARVED
        assert hand.calls == [({"loop/data_wait_frac": pytest.approx(4 / 6), "loop/samples_per_s": 16 / 6,
                                "epoch": 3}, 11)]  # Lightning's own row: its last batch's  # fmt: skip


@pytest.mark.parametrize("rank_zero", [False, True])  # True: rank 0 without any logger
def test_monitors_get_their_keys_on_every_rank_and_without_loggers(monkeypatch, caplog, rank_zero) -> None:  # fmt: skip
    watchers = {
        "is_global_zero": rank_zero, "loggers": [] if rank_zero else [RecordingLogger()],
        "callbacks": [SimpleNamespace(monitor="gpu/node0/cuda0/util_mean"), SimpleNamespace(monitor=None)],
        "lr_scheduler_configs": [SimpleNamespace(monitor="loop/data_wait_frac")],
    }  # fmt: skip
    hand = Hand(monkeypatch, [FakeGpu(util_gpu=30)], trainer=watchers, summary_table=True)
    hand.run(3.0, caplog=caplog)  # starved, but only rank 0 says so
    if not rank_zero:
        assert hand.calls == [] and caplog.records == []  # no identity line, no starvation line
    metrics = hand.trainer.callback_metrics
    assert set(metrics) == {"gpu/node0/cuda0/util_mean", "loop/data_wait_frac"}
    assert isinstance(metrics["gpu/node0/cuda0/util_mean"], torch.Tensor)
    assert metrics["gpu/node0/cuda0/util_mean"].item() == 30.0
    assert metrics["loop/data_wait_frac"].item() == pytest.approx(0.75)


def test_no_step_no_new_reading_and_another_stage_log_only_what_there_is(monkeypatch) -> None:
    hand = Hand(monkeypatch, [FakeGpu()])
    hand.monitor.setup(hand.trainer, None, "validate")
    assert hand.fake.total_calls() == 0 and hand.monitor.identities == []
    hand.run()  # no batch: no call
    assert hand.calls[0][0].keys() >= {"gpu/node0/cuda0/util_mean"}
    assert not any(k.startswith("loop/") for k in hand.calls[0][0])
    cpu = Hand(monkeypatch)
    cpu.run()
    assert cpu.calls == [] and cpu.monitor.run_samples() == 0.0
    late = Hand(monkeypatch, [FakeGpu(util_gpu=[(0, 30), (1, 90)])])
    late.monitor.setup(late.trainer, None, "fit")  # t=0: util 30
    calls = late.fake.total_calls()
    late.clock.set(2.0)  # util 90 now, but no reading since
    late.epoch(0.0)
    assert late.fake.total_calls() == calls  # the training thread read no GPU
    late.monitor.teardown(late.trainer, None, "fit")
    ((row, _),) = late.calls
    assert row["gpu/node0/cuda0/util_mean"] == 30 and "gpu/node0/cuda0/energy_j" not in row


def test_sanity_checking_and_disabled_validation_log_no_validation_figures(monkeypatch) -> None:
    hand = Hand(monkeypatch, [FakeGpu(util_gpu=10)], trainer={"sanity_checking": True},
                report_validation=False, key_prefix="dev")  # fmt: skip
    monitor, fake = hand.monitor, hand.fake
    monitor.setup(hand.trainer, None, "fit")
    hand.validate(0.0, 0.0)  # the sanity check: nothing happens
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 2  # the probe's and the first reading's
    hand.trainer.sanity_checking = False
    hand.epoch(1.0, end=False)  # t = 2
    hand.validate(2.0, 4.0)  # logs nothing, reads no GPU
    assert hand.calls == [] and fake.calls["nvmlDeviceGetUtilizationRates"] == 2
    assert monitor.run_samples() == 8.0  # the epoch so far counts, for a checkpoint saved now
    hand.clock.set(6.0)
    hand.steps(0.0)  # validation 2..6 left out; t = 7
    monitor.on_train_epoch_end(hand.trainer, hand.module)
    monitor.teardown(hand.trainer, None, "fit")
    ((row, _),) = hand.calls
    assert row["dev/node0/cuda0/util_mean"] == 10.0
    assert row["loop/data_wait_frac"] == pytest.approx(1.0 / 3.0)
    assert not any(k.startswith("dev_val/") for k in row)
    assert monitor.run_samples() == 16.0


def test_two_epochs_add_up_and_an_unsized_batch_makes_the_sample_count_unknown(monkeypatch) -> None:
    length = gpu_callback.batch_length
    assert length({"x": [torch.zeros(5, 2)], "y": torch.zeros(5)}) == 5  # as Lightning
    assert length(torch.tensor(3.0)) == 1 and length(["text"]) is None
    hand = Hand(monkeypatch)
    hand.monitor.setup(hand.trainer, None, "fit")
    hand.epoch(0.0, 0.0)
    hand.epoch(0.0, 0.0)
    assert hand.monitor.run_samples() == 32.0 and hand.monitor.state_dict()["train_samples"] == 32.0
    hand.monitor.on_train_epoch_start(hand.trainer, None)
    hand.steps(0.0, batch=["no tensor"])
    hand.monitor.on_train_epoch_end(hand.trainer, hand.module)
    assert hand.monitor.run_samples() is None and "loop/samples_per_s" not in hand.calls[-1][0]
    hand.epoch(0.0)
    assert hand.monitor.run_samples() is None  # unknown once, unknown for the run


def test_unusable_gpus_are_named_the_run_goes_on_and_ranks_in_one_state_share_a_line(monkeypatch, caplog) -> None:  # fmt: skip
    absent = "GPU-00000000-0000-4000-8000-00000000dead"
    cpu = torch.device("cpu")
    strategy = SimpleNamespace(parallel_devices=[cpu, cpu], root_device=cpu)
    hand = Hand(monkeypatch, [FakeGpu().fail("memory", "unknown")], trainer={"strategy": strategy})  # fails at the probe  # fmt: skip
    monitor = GpuStatsMonitor(device_uuids=[absent, hand.fake.gpus[0].uuid])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(hand.trainer, None, "fit")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines[0] == (logging.WARNING, f"gpu_stats: rank 0 (node 0): cuda0: no NVML device with UUID {absent!r}")  # fmt: skip
    assert lines[1][0] == logging.WARNING
    assert lines[1][1].startswith("gpu_stats: rank 0 (node 0): cuda1: NVMLError_Unknown: ")
    assert lines[2:] == [(logging.WARNING, "gpu_stats: rank 0: off: no usable GPU; training continues without GPU statistics")]  # fmt: skip
    assert hand.fake.balanced and not hand.fake.initialised  # NVML shut down at once
    (payload,) = monitor.identities
    assert payload["status"] == "off: no usable GPU" and payload["gpus"] == []
    caplog.clear()
    gpu = {"label": "cuda0", "name": "n", "uuid": "MIG-1", "nvml_index": 3, "pci_bus_id": "b",
           "mig": True, "unsupported": ["fan", "utilization"]}  # fmt: skip
    with caplog.at_level(logging.INFO, logger=LOGGER):
        GpuStatsMonitor()._report_setup([
            {"rank": 0, "node": 0, "status": "off: x", "gpus": [], "quiet": True},
            {"rank": 1, "node": 0, "status": "off: x", "gpus": [], "quiet": True},
            {"rank": 2, "node": 1, "status": "off: x", "gpus": []},
            {"rank": 3, "node": 1, "status": "off: y", "gpus": [], "problems": ["p"]},
            {"rank": 4, "node": 1, "status": "on", "gpus": [gpu]},
        ])  # fmt: skip
    suffix = "; training continues without GPU statistics"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "gpu_stats: rank 3 (node 1): p"),
        (logging.INFO, "gpu_stats: node1/cuda0 = n, MIG-1, NVML index 3, PCI b (MIG slice); "
                       "not supported: fan, utilization"),
        (logging.INFO, f"gpu_stats: rank 0,1: off: x{suffix}"),
        (logging.WARNING, f"gpu_stats: rank 2: off: x{suffix}"),
        (logging.WARNING, f"gpu_stats: rank 3: off: y{suffix}"),
    ]  # fmt: skip


def test_a_bug_in_the_bookkeeping_stops_sampling_with_one_line(monkeypatch, caplog) -> None:
    hand = Hand(monkeypatch, [FakeGpu(util_gpu=10)])
    hand.monitor.setup(hand.trainer, None, "fit")
    monkeypatch.setattr(GpuSampler, "set_phase", lambda *a, **k: {}["oops"])  # a KeyError
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        hand.epoch(0.0)  # still ends, no GPUs
    assert [r.getMessage() for r in caplog.records] == [
        "gpu_stats: epoch start failed (KeyError: 'oops'); sampling stops"
    ]
    assert hand.fake.balanced and not hand.fake.initialised  # NVML is shut down at once
    ((row, _),) = hand.calls
    assert not any(k.startswith("gpu/") for k in row) and "loop/data_wait_frac" in row


# --------------------------------------------------------------------------- ranks, through a store
@pytest.fixture
def store(monkeypatch):
    """The job's TCP store (rank 0's server), where ``MASTER_ADDR``/``MASTER_PORT`` point."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    return server


def ranked(rank: int, world: int = 2) -> SimpleNamespace:
    return SimpleNamespace(world_size=world, global_rank=rank)


def test_the_exchange_hands_rank_0_every_ranks_payload_and_waits_for_late_ones_once(store, caplog) -> None:  # fmt: skip
    mine, theirs = {"gpus": {"cuda0": {"util_mean": 1.0}}}, {"gpus": {"cuda1": {"util_mean": 2.0}}}
    # Rank 1 posts and goes on at once: it never waits for anyone.
    sender = RankExchange("epoch", timeout_s=5)
    assert sender.gather(ranked(1), theirs) == [theirs]
    gathered = RankExchange("epoch", timeout_s=5).gather(ranked(0), mine)
    assert gathered == [mine, theirs] and gathered[0] is mine and gathered[1] is not theirs
    for _ in range(2):  # two rounds on, its owner removes it
        sender.gather(ranked(1), theirs)
    assert not store.check(["runkit/epoch/1/1"]) and store.check(["runkit/epoch/3/1"])
    one = RankExchange("epoch", timeout_s=5)
    assert one.gather(ranked(0, world=1), mine) == [mine] and one._round == 0  # no store
    # With a monitor on any rank, every rank gets every payload.
    zero, first = {"node": 0, "r": 0}, {"node": 0, "r": 1}
    store.set("runkit/every/1/1", json.dumps(first))
    rank0 = RankExchange("every", timeout_s=5)
    assert rank0.gather(ranked(0), zero, every_rank=True) == [zero, first]
    assert json.loads(store.get("runkit/every/1/0")) == zero  # posted for rank 1 to read
    rank1 = RankExchange("every", timeout_s=5)
    assert rank1.gather(ranked(1), first, every_rank=True) == [zero, first]  # rank order
    assert store.check(["runkit/every/1/1"])  # its owner removes it, later (as above)
    # A late rank costs rank 0 the timeout and one warning.
    exchange = RankExchange("validation end", timeout_s=0.6)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert exchange.gather(ranked(0, world=3), {"node": 0}) == [{"node": 0}]
    assert 0.5 < time.monotonic() - started < 5
    (line,) = [r.getMessage() for r in caplog.records if "did not reach" in r.getMessage()]
    assert line == (
        "gpu_stats: rank 1,2 did not reach validation end within 1 s; its figures are left out "
        "this time (a rank held up elsewhere: look at that rank's log)"
    )


# --------------------------------------------------------------------------- real Trainer.fit
class TinyModel(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"], on_step=False, on_epoch=True)
        return out

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", super().validation_step(batch, batch_idx)["x"])


def loader(delay_s: float = 0.0, batch_size: int = 4) -> DataLoader:
    """64 samples, ``delay_s`` each to load, like decoding files on one core."""

    def slow(batch: list) -> Any:
        for _ in batch:  # one sleep per sample, as a Dataset's __getitem__ would
            time.sleep(delay_s)
        return default_collate(batch)

    return DataLoader(torch.randn(64, 32), batch_size=batch_size, collate_fn=slow)


def fit(tmp_path, monitor, *callbacks, epochs=2, model=None, train_loader=None,
        ckpt_path=None, **options):  # fmt: skip
    """A real fit on CPU, the monitor first; Trainer ``options`` override the defaults."""
    options = {"limit_train_batches": 12, "limit_val_batches": 2, "num_sanity_val_steps": 1,
               "log_every_n_steps": 1, **options}  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[monitor, *callbacks],
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        logger=CSVLogger(tmp_path, name="csv", version=0), **options,
    )  # fmt: skip
    trainer.fit(model or TinyModel(), train_loader or loader(), loader(), ckpt_path=ckpt_path)
    return trainer


def rows_with(tmp_path: Path, key: str = "gpu/node0/cuda0/samples") -> list[dict[str, str]]:
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
        return [r for r in csv.DictReader(handle) if r.get(key)]


VAL_KEY = "gpu_val/node0/cuda0/util_mean"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two epochs on a fake H100 with GPM, EarlyStopping, ModelCheckpoint (last.ckpt), batches of 6."""
    tmp_path = tmp_path_factory.mktemp("trained")
    gpu = FakeGpu(name="Fake H100", util_gpu=40, util_memory=20, memory_used=10 * GIB,
                  power_mw=350_000, temperature=61, processes=[FakeProcess("self", 2 * GIB)],
                  gpm=HOPPER_GPM)  # fmt: skip
    fake = FakeNvml([gpu])
    monitor = GpuStatsMonitor(interval_s=0.02, device_uuids=[gpu.uuid], log_sampler_cost=True)
    counts: list[int] = []  # NVML calls from the training thread so far, at each batch's start
    watch = LambdaCallback(  # each batch outlasts the sampler's interval
        on_train_batch_start=lambda *_: counts.append(fake.calls_in_thread()) or time.sleep(0.01)
    )
    stop = EarlyStopping("gpu/node0/cuda0/util_mean", patience=5, check_on_train_epoch_end=True)
    best = ModelCheckpoint(tmp_path / "ckpt", monitor=VAL_KEY, mode="max", save_last=True)
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()) as out:
        mp.setenv("COLUMNS", "220")  # Rich wraps the table at 80 columns otherwise
        mp.setattr(nvml, "load_library", lambda: fake)
        trainer = fit(tmp_path, monitor, watch, stop, best, train_loader=loader(batch_size=6))
    return SimpleNamespace(path=tmp_path, fake=fake, monitor=monitor, counts=counts, best=best,
                           trainer=trainer, out=out.getvalue())  # fmt: skip


def test_a_fit_logs_exact_gpu_figures_once_per_epoch_feeds_monitors_and_reads_no_gpu_in_the_loop(trained) -> None:  # fmt: skip
    train, val = rows_with(trained.path), rows_with(trained.path, VAL_KEY)
    assert len(train) == 2 and len(val) == 2  # one row per epoch; the sanity check is not logged
    expected = {"util_mean": 40, "util_max": 40, "mem_util_mean": 20, "mem_used_gib_max": 10,
                "proc_mem_gib_max": 2, "power_ratio_mean": 0.5, "temp_c_max": 61,
                "sm_active_mean": 60, "tensor_active_max": 20, "dram_active_mean": 45}  # fmt: skip
    for row in train:
        assert {k: float(row[f"gpu/node0/cuda0/{k}"]) for k in expected} == expected
        assert float(row["gpu/node0/cuda0/energy_j"]) > 0
        assert float(row["gpu/node0/cuda0/samples"]) >= 2
        assert float(row["gpu/node0/cuda0/sample_ms"]) >= 0
        assert float(row["loop/data_wait_frac"]) < 1 and float(row["loop/samples_per_s"]) > 0
    row = train[0]
    assert "gpu/node0/cuda0/fp16_active_mean" not in row  # not scripted: absent, never 0
    assert not any(k.startswith("gpu/all/") and row[k] for k in row)  # one GPU: no copies
    assert "gpu/node0/cuda0/fan_pct_mean" not in row  # option off
    assert not any("torch_peak" in k for k in row)  # no CUDA device, so no torch peaks
    # at the step of Lightning's own rows: the epoch's train_loss, the validation's val_loss
    assert [r["step"] for r in train] == [r["step"] for r in rows_with(trained.path, "train_loss")]
    assert [r["step"] for r in val] == [r["step"] for r in rows_with(trained.path, "val_loss")]
    metrics = trained.trainer.callback_metrics
    assert float(metrics["gpu/node0/cuda0/util_mean"]) == 40  # EarlyStopping's key
    assert "gpu/node0/cuda0/temp_c_max" not in metrics  # no monitor asks
    assert float(trained.best.best_model_score) == 40  # the validation's key, at its end
    assert trained.monitor.run_samples() == 2 * 64  # per epoch 10 batches of 6 and one of 4
    counts = trained.counts  # no NVML call from the training thread while it trains
    assert len(counts) == 2 * 11 and len(set(counts)) == 1, counts
    assert trained.fake.balanced and not trained.fake.initialised
    assert trained.fake.gpm_samples_live == 0
    assert "GPU statistics over the run" in trained.out and "Fake H100" in trained.out
    assert "SM active %" in trained.out and "60.0" in trained.out
    (summary,) = trained.monitor.run_summary()
    assert summary["util_mean"] == 40 and summary["mem_used_gib_max"] == 10


@pytest.mark.slow
def test_energy_continues_across_a_resume_and_reaches_metrics_json(trained, tmp_path, use_fake) -> None:  # fmt: skip
    fake = use_fake(FakeNvml([FakeGpu(power_mw=300_000)]))
    last = trained.path / "ckpt" / "last.ckpt"
    state = torch.load(last, weights_only=True)["callbacks"]["GpuStatsMonitor"]
    assert state["train_samples"] in (64, 128) and state["energy_j"]["node0/cuda0"] > 0
    monitor = GpuStatsMonitor(interval_s=0.02, device_uuids=[fake.gpus[0].uuid])
    trainer = fit(tmp_path, monitor, epochs=3, ckpt_path=last, num_sanity_val_steps=0,
                  train_loader=loader(0.002, batch_size=6))  # fmt: skip
    report = gpu_callback.energy_report(trainer)
    assert report["training_samples"] == 3 * 64  # both runs' samples
    assert report["energy_j"] > state["energy_j"]["node0/cuda0"]  # continued, not restarted
    assert report["energy_kwh"] == pytest.approx(report["energy_j"] / 3.6e6)
    assert report["energy_j_per_training_sample"] == pytest.approx(report["energy_j"] / 192)
    run_files.save_metrics({}, tmp_path, None, trainer, started=time.time(), energy=report)
    written = json.loads((tmp_path / "metrics.json").read_text())["energy"]
    assert written["energy_j_per_gpu"] == {"node0/cuda0": pytest.approx(report["energy_j"])}


def blow_up_at_step_3(trainer, pl_module, batch, batch_idx) -> None:
    if batch_idx == 3:
        raise RuntimeError("model blew up")


def test_an_exception_in_training_still_shuts_nvml_down(tmp_path, use_fake) -> None:
    fake = use_fake(FakeNvml(1))
    monitor = GpuStatsMonitor(interval_s=0.05, device_uuids=[fake.gpus[0].uuid])
    with pytest.raises(RuntimeError, match="model blew up"):
        fit(tmp_path, monitor, LambdaCallback(on_train_batch_start=blow_up_at_step_3))
    assert fake.init_count == 1 and fake.balanced and not fake.initialised


@pytest.mark.slow
def test_a_cpu_run_touches_no_nvml_and_a_starved_loop_is_named_once_per_epoch(tmp_path, use_fake, caplog, monkeypatch) -> None:  # fmt: skip
    monkeypatch.setattr(gpu_callback, "MIN_WAIT_WARNING_S", 0.2)
    fake = use_fake(FakeNvml(1))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        fit(tmp_path, GpuStatsMonitor(), train_loader=loader(0.0125), num_sanity_val_steps=0,
            limit_train_batches=6)  # fmt: skip
    assert fake.total_calls() == 0
    rows = rows_with(tmp_path, "loop/data_wait_frac")
    assert len(rows) == 2 and not any(k.startswith("gpu/") and v for k, v in rows[0].items())
    for row in rows:
        assert float(row["loop/data_wait_frac"]) > 0.5  # 50 ms of loading per batch
        assert 0 < float(row["loop/samples_per_s"]) < 4 / 0.05
    ours = [r for r in caplog.records if r.name.startswith(LOGGER)]
    assert "uses no CUDA device" in ours[0].getMessage() and ours[0].levelno == logging.INFO
    starved = [r for r in ours if "waited for the next batch" in r.getMessage()]
    assert len(starved) == 2 and {r.levelno for r in starved} == {logging.WARNING}
    assert "no GPU reading" in starved[0].getMessage()  # the whole line: the by-hand test


@pytest.mark.gpu
def test_real_gpu_values(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with an NVIDIA driver (torch.cuda.is_available() is False)")
    nvml.use_library(None)
    monitor = GpuStatsMonitor(interval_s=0.1)
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_epochs=1, limit_train_batches=50,
                         limit_val_batches=2, enable_progress_bar=False, enable_checkpointing=False,
                         logger=CSVLogger(tmp_path, name="csv", version=0), callbacks=[monitor])  # fmt: skip
    trainer.fit(TinyModel(), loader(), loader())
    (row,) = rows_with(tmp_path)
    assert 0 <= float(row["gpu/node0/cuda0/util_mean"]) <= 100
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    assert float(row["gpu/node0/cuda0/mem_total_gib"]) == pytest.approx(total, rel=0.05)
    assert 0 < float(row["gpu/node0/cuda0/torch_peak_alloc_gib"]) < total
    assert float(row["gpu/node0/cuda0/proc_mem_gib_max"]) > 0
    (ident,) = monitor.identities[0]["gpus"]
    assert ident["uuid"].startswith(("GPU-", "MIG-"))
