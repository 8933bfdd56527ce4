"""GPU statistics, part by part, in milliseconds: the callback's hooks on a stand-in trainer, the
sampler, GPM pairs, the statistics, the loop timer and the end-of-run report.

Each test pins values a user reads (a logged key's value, a log line, a table cell), so that a
small change to ``machinery/gpu_stats/`` fails one (``make mutate MODULE=gpu_stats``) without
training a model. NVML is the fake, on a clock driven by hand; the real ``Trainer.fit`` runs in
``test_gpu_stats.py`` and ``test_gpu_telemetry.py`` prove the same parts with real components.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from runkit.gpu_stats import callback as gpu_callback
from runkit.gpu_stats.callback import (
    GpuStatsMonitor,
    count_samples,
    process_devices,
)
from runkit.gpu_stats.exchange import RankExchange
from runkit.gpu_stats.gpm import GpmCounters, GpmUnsupported
from runkit.gpu_stats.loop import LoopTimer, Ticker, batch_length, fixed_batches
from runkit.gpu_stats.report import RunSummary, print_table
from runkit.gpu_stats.sampler import (
    GIB,
    THROTTLE_MASKS,
    TRAIN,
    VAL,
    GpuReader,
    GpuSampler,
)
from runkit.gpu_stats.statistics import (
    GpuAccumulator,
    RunningStat,
    flatten_epoch,
    flatten_loop,
)
from runkit.testing.fake_nvml import FakeClock, FakeGpu, FakeNvml, FakeProcess

LOGGER = "runkit.gpu_stats"


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
    monitor.on_validation_start(trainer, None)
    monitor.on_validation_epoch_start(trainer, None)
    clock.set(5.0)
    monitor.on_validation_epoch_end(trainer, None)  # samples t=5 (util 60, temp 50) for val
    clock.set(9.0)
    train_steps(monitor, trainer, clock, [0.5])  # the 5 s of validation are not waiting
    clock.set(11.0)
    monitor.on_train_epoch_end(trainer, None)  # samples t=11 for training
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
    monitor = monitor_on(monkeypatch, fake, clock, report_validation=False, key_prefix="dev")
    logger = RecordingLogger()
    trainer = stub_trainer(loggers=[logger], sanity_checking=True)
    monitor.setup(trainer, None, "fit")
    for hook in ("on_validation_start", "on_validation_epoch_start", "on_validation_epoch_end"):
        getattr(monitor, hook)(trainer, None)  # the sanity check: nothing happens
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 1  # the probe's only
    trainer.sanity_checking = False
    monitor.on_train_epoch_start(trainer, None)
    train_steps(monitor, trainer, clock, [1.0])  # t = 2
    monitor.on_validation_start(trainer, None)
    monitor.on_validation_epoch_start(trainer, None)
    clock.set(4.0)
    monitor.on_validation_epoch_end(trainer, None)  # logs nothing, reads no GPU
    assert logger.calls == []
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 1  # no closing sample: not reported
    assert monitor.run_samples() == 8.0  # the epoch so far counts, for a checkpoint saved now
    clock.set(6.0)
    train_steps(monitor, trainer, clock, [0.0])  # validation 2..6 left out; t = 7
    monitor.on_train_epoch_end(trainer, None)
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
    monitor.on_train_epoch_end(trainer, None)  # the epoch still ends (and gathers), without GPUs
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
        ({"key_prefix": ""}, "key_prefix=''; give a word without '/'"),
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
    assert (default.interval_s, default.key_prefix, default.per_gpu_keys_up_to) == (1.0, "gpu", 8)
    assert (default.data_wait_warning, default.gpu_idle_below_pct) == (0.3, 50.0)
    assert default.report_validation and default.summary_table and not default.log_sampler_cost
    every = GpuStatsMonitor(fan=True, pcie=True, ecc=True, memory_temperature=True, gpm=False)
    assert every.groups[-4:] == ["fan", "pcie", "ecc", "memory_temperature"]
    assert "gpm" not in every.groups and len(every.groups) == 12
    assert GpuStatsMonitor(pcie=True).groups[-2:] == ["gpm", "pcie"]


# --------------------------------------------------------------------------- helpers
def test_process_devices_falls_back_to_the_root_device() -> None:
    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]
    two_nodes = SimpleNamespace(
        strategy=SimpleNamespace(parallel_devices=cuda, root_device=cuda[1]),
        world_size=4,
        num_nodes=2,
        local_rank=1,
    )
    assert process_devices(two_nodes) == [(1, cuda[1])]
    one_per_node = SimpleNamespace(
        strategy=SimpleNamespace(parallel_devices=cuda, root_device=cuda[0]),
        world_size=2,
        num_nodes=2,
        local_rank=0,
    )
    assert process_devices(one_per_node) == list(enumerate(cuda))  # several devices, one process
    odd = SimpleNamespace(
        strategy=SimpleNamespace(parallel_devices=cuda[:1], root_device=cuda[0]),
        world_size=2,
        num_nodes=1,
        local_rank=1,
    )
    assert process_devices(odd) == [(0, cuda[0])]  # a local rank beyond the list: position 0


def test_the_exchange_without_a_process_group_is_this_ranks_payload() -> None:
    thing = {"a": 1}
    exchange = RankExchange("epoch end")
    assert exchange.gather(SimpleNamespace(world_size=1, global_rank=0), thing) == [thing]
    not_initialised = SimpleNamespace(world_size=2, global_rank=0)
    assert exchange.gather(not_initialised, thing) == [thing]


def test_count_samples_of_every_rank() -> None:
    assert count_samples([{"samples": 3.0}, None, {"samples": 5.0}]) == 8.0
    assert count_samples([{"samples": 3.0}, {"loop_s": 1.0}]) is None
    assert count_samples([None]) == 0


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
    assert timer.batch_end({"x": torch.zeros(5)}) is True  # counted one by one: every step
    # 10 s since the epoch start, less 4 s of validation (from the first pause to the batch)
    assert timer.summary() == {"loop_s": 6.0, "data_wait_s": 2.0, "steps": 2.0, "samples": 10.0}
    timer.batch_start()
    clock.advance(1.0)
    timer.batch_end("no tensor")
    summary = timer.summary()
    assert "samples" not in summary and summary["steps"] == 3.0
    timer.batch_start()
    assert timer.batch_end(torch.zeros(5)) is True
    assert "samples" not in timer.summary()  # unknown for the rest of the epoch
    timer.start_epoch()
    assert timer.summary() is None and timer.samples == 0 and timer.wait_s == 0.0
    timer.batch_start()
    timer.batch_end(torch.zeros(2))
    assert timer.summary() == {"loop_s": 0.0, "data_wait_s": 0.0, "steps": 1.0, "samples": 2.0}


def run_steps(timer: LoopTimer, clock: FakeClock, indices: range, measured: bool) -> list[bool]:
    """Steps of 1 ms waiting and 2 ms in the step; the hooks called only if ``measured``."""
    said = []
    for index in indices:
        clock.advance(0.001)
        if measured:
            timer.batch_start()
        clock.advance(0.002)
        if measured:
            said.append(timer.batch_end((torch.zeros(4),), index))
    return said


@pytest.mark.parametrize("first", [0, 2], ids=["epoch", "resumed at batch 2"])
def test_fast_steps_are_measured_in_windows_and_the_epoch_still_adds_up(first) -> None:
    clock = FakeClock()
    timer = LoopTimer(clock, window_steps=3, slow_step_s=0.005)
    timer.start_epoch((4, 9, 2))  # 10 batches of 4, the last of 2
    clock.advance(1.0)  # the loader's workers start: the first wait, 1.001 s
    # the first window holds the start-up, so it is slow and a second one follows
    assert run_steps(timer, clock, range(first, first + 6), True) == [True] * 5 + [False]
    assert timer.windowed
    run_steps(timer, clock, range(first + 6, 8), False)  # the hooks are off
    assert timer.batch_end((torch.zeros(4),), 7) is True  # back within a step: not counted
    run_steps(timer, clock, range(8, 10), True)  # a window again: its first wait is unseen
    clock.advance(0.5)  # after the last step, which was seen: not in the loop
    steps = 10 - first
    summary = timer.summary(9)
    assert summary == {
        "loop_s": pytest.approx(1.0 + 0.003 * steps),
        "data_wait_s": pytest.approx(1.0 + 0.001 * steps),  # the unseen ones at the mean
        "steps": steps,
        "samples": 4 * steps - 2,
    }


def test_slow_steps_and_batches_counted_one_by_one_are_measured_at_every_step() -> None:
    clock = FakeClock()
    for fixed, step_s in (((4, 9, 2), 0.006), (None, 0.001)):
        timer = LoopTimer(clock, window_steps=3, slow_step_s=0.005)
        timer.start_epoch(fixed)
        for index in range(10):
            timer.batch_start()
            clock.advance(step_s)
            assert timer.batch_end((torch.zeros(2),), index) is True
        assert timer.windowed is False
        summary = timer.summary(9)  # measured at every step: the batch index changes nothing
        assert (summary["steps"], summary["samples"]) == (10.0, 38.0 if fixed else 20.0)
        assert summary == timer.summary(None)


def test_a_validation_after_a_closed_window_is_left_out_and_opens_the_next() -> None:
    clock = FakeClock()
    timer = LoopTimer(clock, window_steps=2, slow_step_s=0.005)
    timer.start_epoch((4, -1, 4))
    assert run_steps(timer, clock, range(2), True) == [True, False]
    run_steps(timer, clock, range(2, 6), False)
    timer.pause()  # validation: 5 s
    clock.advance(5.0)
    assert run_steps(timer, clock, range(6, 9), True) == [True, True, False]
    run_steps(timer, clock, range(9, 10), False)
    timer.pause()  # validation at the end, the last step unseen: the loop ends as it begins
    clock.advance(3.0)
    # the first batch after the validation waited inside it: its wait is none, not the mean's
    assert timer.summary(9) == {
        "loop_s": pytest.approx(10 * 0.003 - 0.001),
        "data_wait_s": pytest.approx(9 * 0.001),
        "steps": 10.0,
        "samples": 40.0,
    }


def test_each_reopened_window_leaves_one_wait_unseen_that_the_mean_fills() -> None:
    clock = FakeClock()
    timer = LoopTimer(clock, window_steps=2, slow_step_s=0.005)
    timer.start_epoch((4, -1, 4))
    clock.advance(0.003)  # the loader starting: a first wait of 4 ms, not typical
    assert run_steps(timer, clock, range(2), True) == [True, False]
    run_steps(timer, clock, range(2, 4), False)
    for start in (4, 9):  # a later window's first wait is unseen: it measures 2 steps more
        assert run_steps(timer, clock, range(start, start + 3), True) == [True, True, False]
        run_steps(timer, clock, range(start + 3, start + 5), False)
    summary = timer.summary(13)
    assert summary["steps"] == 14.0 and summary["samples"] == 56.0
    # seen: the first wait and five typical ones; the later windows' first and the unseen: mean
    assert summary["data_wait_s"] == pytest.approx(0.003 + 14 * 0.001)
    assert summary["loop_s"] == pytest.approx(0.003 + 14 * 0.003)  # closed: until now


@pytest.mark.parametrize("window_steps", [1, 2])
def test_a_window_with_no_typical_step_or_one_estimates_from_what_it_has(window_steps) -> None:
    clock = FakeClock()
    timer = LoopTimer(clock, window_steps=window_steps, slow_step_s=0.005)
    timer.start_epoch((4, -1, 4))
    measured = run_steps(timer, clock, range(window_steps), True)
    assert measured == [True] * (window_steps - 1) + [False]
    run_steps(timer, clock, range(window_steps, 5), False)
    summary = timer.summary(4)
    # one step measured: no typical wait, the unseen count as none; two: the second's, 1 ms
    typical_s = 0.0 if window_steps == 1 else 0.001
    seen_s = 0.001 * window_steps
    assert summary["data_wait_s"] == pytest.approx(seen_s + typical_s * (5 - window_steps))
    assert summary["loop_s"] == pytest.approx(5 * 0.003)


def test_an_epoch_resumed_at_its_short_last_batch_counts_that_batch_alone() -> None:
    clock = FakeClock()
    timer = LoopTimer(clock, window_steps=1, slow_step_s=0.005)
    timer.start_epoch((4, 2, 2))  # 3 batches, the last of 2
    assert run_steps(timer, clock, range(2, 3), True) == [False]  # a window of 1 fast step
    assert timer.summary(2)["samples"] == 2.0


def test_a_window_exactly_as_slow_as_the_limit_is_measured_on() -> None:
    clock = FakeClock()
    timer = LoopTimer(clock, window_steps=2, slow_step_s=0.5)
    timer.start_epoch((4, -1, 4))
    for index in range(2):
        timer.batch_start()
        clock.advance(0.5)  # 2 steps of exactly the limit: slow, the hooks stay on
        assert timer.batch_end((torch.zeros(4),), index) is True
    assert timer.windowed is False


def test_the_loaders_fixed_batches_are_its_size_and_last_batch() -> None:
    data = torch.utils.data.TensorDataset(torch.zeros(10, 2))
    loader = torch.utils.data.DataLoader
    assert fixed_batches(loader(data, batch_size=4)) == (4, 2, 2)
    assert fixed_batches(loader(data, batch_size=4, drop_last=True)) == (4, -1, 4)
    assert fixed_batches(loader(data, batch_size=5)) == (5, -1, 5)


def test_a_ticker_ticks_from_its_daemon_thread_until_stopped() -> None:
    threads = []
    ticked = threading.Event()

    def tick() -> None:
        threads.append(threading.current_thread())
        ticked.set()

    ticker = Ticker(0.001, tick)
    assert ticked.wait(5.0)
    ticker.stop()
    (thread,) = set(threads)
    assert thread.name == "runkit-loop-windows" and thread.daemon and not thread.is_alive()
    calls = len(threads)
    time.sleep(0.02)
    assert len(threads) == calls


def samples_seen(loader: Any, fixed: Any, window: tuple[int, int | None]) -> float:
    """The samples a LoopTimer counts over the batches ``window`` (start, stop) of ``loader``."""
    timer = LoopTimer()
    timer.start_epoch(fixed)
    for index, batch in itertools.islice(enumerate(loader), *window):
        timer.batch_start()
        timer.batch_end(batch, index)
    return timer.summary()["samples"]


def loaders() -> dict[str, Any]:
    data = torch.utils.data.TensorDataset(torch.zeros(10, 2), torch.zeros(10))
    loader = torch.utils.data.DataLoader
    rank_1_of_3 = torch.utils.data.DistributedSampler(data, num_replicas=3, rank=1, shuffle=False)
    return {
        "last-short": loader(data, batch_size=4),
        "drop-last": loader(data, batch_size=4, drop_last=True),
        "exact": loader(data, batch_size=5),
        "ddp-rank": loader(data, batch_size=3, sampler=rank_1_of_3),
        "batch-sampler": loader(
            data, batch_sampler=torch.utils.data.BatchSampler(range(7), 3, drop_last=False)
        ),
    }


@pytest.mark.parametrize("name", list(loaders()))
@pytest.mark.parametrize("window", [(0, None), (0, 1), (1, None), (1, 2)], ids=str)
def test_samples_counted_from_the_loader_are_those_in_its_batches(name, window) -> None:
    # (1, None) is a resumed epoch; (0, 1) a limit_train_batches that never reaches the last
    loader = loaders()[name]
    fixed = fixed_batches(loader)
    assert fixed is not None
    in_batches = sum(len(batch[0]) for _, batch in itertools.islice(enumerate(loader), *window))
    assert samples_seen(loader, fixed, window) == in_batches
    assert samples_seen(loader, None, window) == in_batches  # counted batch by batch


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.zeros(10, 2))


class OwnLoader(torch.utils.data.DataLoader):
    pass


class OwnBatches(torch.utils.data.BatchSampler):
    pass


def test_only_loaders_whose_batch_sizes_torch_fixes_are_counted_without_their_batches() -> None:
    data = torch.utils.data.TensorDataset(torch.zeros(10, 2))
    loader = torch.utils.data.DataLoader
    for other in (
        None,
        [loader(data, batch_size=4)],  # several loaders: Lightning's batch holds each one's
        loader(data, batch_size=4, collate_fn=lambda samples: samples[:1]),
        loader(data, batch_sampler=OwnBatches(range(10), 4, drop_last=False)),
        OwnLoader(data, batch_size=4),
        loader(data, batch_size=None),
        loader(Stream(), batch_size=4),
    ):
        assert fixed_batches(other) is None, other


def test_loop_timer_uses_the_wall_clock_by_default() -> None:
    timer = LoopTimer()
    timer.batch_start()
    timer.batch_end(torch.zeros(1))
    summary = timer.summary()
    assert 0.0 <= summary["data_wait_s"] <= summary["loop_s"] < 5.0


# --------------------------------------------------------------------------- the run's report
def test_run_summary_rows_over_epochs(capsys, monkeypatch) -> None:
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
    monkeypatch.setenv("COLUMNS", "200")
    print_table([first, second])
    lines = capsys.readouterr().out.splitlines()
    assert "GPU statistics over the run (training epochs)" in lines[0]
    header = next(line for line in lines if "GPU" in line and "name" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == [
        "GPU", "name", "util %", "peak mem GiB", "torch peak GiB", "energy kJ", "samples",
        "NVML ms/sample",
    ]  # fmt: skip
    cells = [[c.strip() for c in line.strip("│ ").split("│")] for line in lines if "node" in line]
    assert cells == [
        ["node0/cuda3", "?", "n/a", "n/a", "n/a", "n/a", "0", "n/a"],
        ["node1/cuda0", "H", "50.0", "3.00", "2.50", "1.50", "4", "3.50"],
    ]
    # left-aligned names, right-aligned numbers
    row = next(line for line in lines if "node1/cuda0" in line).split("│")
    assert row[2].startswith(" H ") and row[3].endswith(" 50.0 ") and row[3].startswith("  ")


def test_the_table_shows_gpm_columns_only_when_a_gpu_has_gpm(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    row = {
        "gpu": "node0/cuda0", "name": "H", "util_mean": 1.0, "sm_active_mean": 12.34,
        "sm_occupancy_mean": None, "tensor_active_mean": 5.0, "dram_active_mean": 7.0,
        "mem_used_gib_max": None, "torch_peak_alloc_gib": None, "energy_j": None, "samples": 1,
        "sample_ms": None,
    }  # fmt: skip
    print_table([row])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "name" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == [
        "GPU", "name", "util %", "SM active %", "tensor %", "DRAM bw %", "peak mem GiB",
        "torch peak GiB", "energy kJ", "samples", "NVML ms/sample",
    ]  # fmt: skip
    (cells,) = [[c.strip() for c in ln.strip("│ ").split("│")] for ln in lines if "node0" in ln]
    assert cells == ["node0/cuda0", "H", "1.0", "12.3", "5.0", "7.0", "n/a", "n/a", "n/a", "1",
                     "n/a"]  # fmt: skip


def test_the_table_is_not_wrapped_in_a_log_file_however_narrow_the_default(
    capsys, monkeypatch
) -> None:
    """Rich assumes 80 columns when stdout is not a terminal; a CI log or a SLURM .out has room."""
    monkeypatch.delenv("COLUMNS", raising=False)
    row = {
        "gpu": "node0/cuda0", "name": "NVIDIA H100 80GB HBM3", "util_mean": 1.0,
        "sm_active_mean": 12.34, "sm_occupancy_mean": 3.0, "tensor_active_mean": 5.0,
        "dram_active_mean": 7.0, "mem_used_gib_max": 1.0, "torch_peak_alloc_gib": 0.5,
        "energy_j": 2000.0, "samples": 1, "sample_ms": 0.25,
    }  # fmt: skip
    print_table([row])
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) > 80  # wider than Rich's default
    (cells,) = [[c.strip() for c in ln.strip("│ ").split("│")] for ln in lines if "node0" in ln]
    assert cells == ["node0/cuda0", "NVIDIA H100 80GB HBM3", "1.0", "12.3", "3.0", "5.0", "7.0",
                     "1.00", "0.50", "2.00", "1", "0.25"]  # fmt: skip


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
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(messages) == 2  # both samples tried
    assert all(level == logging.DEBUG for level, _ in messages)
    assert messages[0][1].startswith("gpu_stats: cuda0: freeing a GPM sample failed: ")
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


# --------------------------------------------------------------------------- one GPU's reader
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


# --------------------------------------------------------------------------- the sampler
def sampler_on(fake: FakeNvml, groups: list[str], count: int = 1) -> GpuSampler:
    readers = []
    for i in range(count):
        reader = GpuReader(fake, fake.nvmlDeviceGetHandleByIndex(i), f"cuda{i}", groups)
        reader.probe()
        readers.append(reader)
    return GpuSampler(readers, interval_s=1.0)


@pytest.mark.parametrize("parallel", [False, True])
def test_several_gpus_are_read_on_a_pool_only_when_asked_and_report_their_energy(parallel) -> None:
    clock = FakeClock()
    fake = opened_fake([FakeGpu(power_mw=100_000), FakeGpu(power_mw=50_000)], clock)
    readers = sampler_on(fake, ["utilization", "energy"], count=2).readers
    reported: list[tuple[str, float]] = []
    threads: set[str] = set()
    sampler = GpuSampler(
        readers, interval_s=1.0, parallel=parallel, on_energy=lambda *r: reported.append(r)
    )
    read = sampler._read
    sampler._read = lambda reader: threads.add(threading.current_thread().name) or read(reader)
    sampler.set_phase(TRAIN, sample=False)
    sampler.sample_now()  # primes both counters
    clock.set(2.0)
    sampler.sample_now()
    assert reported == [("cuda0", pytest.approx(200.0)), ("cuda1", pytest.approx(100.0))]
    train = sampler.collect(TRAIN, sample=False)
    assert {gpu: figures["samples"] for gpu, figures in train.items()} == {"cuda0": 2, "cuda1": 2}
    pool = {name for name in threads if name.startswith("gpu-stats-read")}
    assert (len(pool) > 0) is parallel and (
        threading.current_thread().name in threads
    ) is not parallel
    assert GpuSampler(readers[:1], interval_s=1.0, parallel=True)._pool is None  # one: no pool
    sampler.stop()
    fake.nvmlShutdown()


def test_phases_energy_and_the_runs_energy_totals() -> None:
    clock = FakeClock()
    fake = opened_fake([FakeGpu(power_mw=100_000, util_gpu=[(0, 10), (3, 30)])], clock)
    sampler = sampler_on(fake, ["utilization", "energy"])
    assert sampler.phase is None and sampler.energy_totals_j() == {}
    assert not sampler.has_samples(TRAIN)
    sampler.sample_now()  # t=0, no phase: primes the counter
    clock.set(2.0)
    sampler.sample_now()  # no phase still: counts for the run, not for a phase
    assert sampler.energy_totals_j() == {"cuda0": pytest.approx(200.0)}
    assert sampler.collect(TRAIN) == {}
    sampler.set_phase(TRAIN, sample=False)
    assert not sampler.has_samples(TRAIN)
    clock.set(3.0)
    sampler.sample_now()
    assert sampler.has_samples(TRAIN) and not sampler.has_samples(VAL)
    clock.set(4.0)
    sampler.set_phase(VAL)  # closes training at t=4
    clock.set(6.0)
    sampler.set_phase(TRAIN, reset=False)  # closes validation at t=6, training goes on
    clock.set(7.0)
    train = sampler.collect(TRAIN)  # current: a closing sample at t=7
    val = sampler.collect(VAL)  # not current: no sample
    assert train["cuda0"]["samples"] == 3 and train["cuda0"]["util_mean"] == 30.0
    assert train["cuda0"]["energy_j"] == pytest.approx(100.0 * 3)  # 2..4 and 6..7
    assert val["cuda0"] == {
        "util_mean": 30.0, "util_max": 30.0, "util_min": 30.0, "mem_util_mean": 0.0,
        "mem_util_max": 0.0, "energy_j": pytest.approx(200.0), "samples": 1.0,
        "sample_ms": pytest.approx(val["cuda0"]["sample_ms"]),
    }  # fmt: skip
    assert 0.0 <= val["cuda0"]["sample_ms"] < 1000.0
    assert sampler.energy_totals_j() == {"cuda0": pytest.approx(700.0)}
    sampler.set_phase(TRAIN, reset=False, sample=False)
    assert sampler.collect(TRAIN, sample=False)["cuda0"]["samples"] == 3  # kept
    sampler.set_phase(TRAIN, sample=False)  # reset: a new epoch
    assert sampler.collect(TRAIN, sample=False) == {}
    sampler.set_phase(VAL, reset=False, sample=False)
    assert sampler.collect(VAL, sample=False)["cuda0"]["samples"] == 1  # reset=False keeps it
    sampler.set_phase(None, sample=False)
    assert sampler.phase is None
    fake.nvmlShutdown()


def test_has_samples_needs_every_live_gpu(caplog) -> None:
    clock = FakeClock()
    fake = opened_fake([FakeGpu(), FakeGpu().lose(at=1.0)], clock)
    sampler = sampler_on(fake, ["utilization"], count=2)
    sampler.set_phase(TRAIN, sample=False)
    clock.set(1.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sampler.sample_now()  # GPU 1 is lost: cuda0 has a sample, cuda1 never will
    assert [r.label for r in sampler.alive] == ["cuda0"]
    assert sampler.has_samples(TRAIN)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("gpu_stats: stopped sampling cuda1 (NVIDIA H100 80GB HBM3): ")
    assert "GpuIsLost" in line and line.endswith("; training continues")
    assert sampler.readers[1].dead.startswith("NVMLError_GpuIsLost: ")
    fake.nvmlShutdown()


def test_the_background_thread_samples_until_stopped() -> None:
    fake = opened_fake([FakeGpu(gpm={"SM_UTIL": 5})], clock=None)
    sampler = sampler_on(fake, ["utilization", "gpm"])
    sampler.interval_s = 0.01
    sampler.set_phase(TRAIN, sample=False)
    sampler.start()
    thread = sampler._thread
    assert thread is not None and thread.name == "gpu-stats-sampler" and thread.daemon
    sampler.start()  # already running: the same thread
    assert sampler._thread is thread
    for _ in range(500):
        if fake.calls["nvmlDeviceGetUtilizationRates"] >= 4:
            break
        threading.Event().wait(0.01)
    assert fake.calls["nvmlDeviceGetUtilizationRates"] >= 4  # the first sample, then every 10 ms
    sampler.stop()
    assert sampler._thread is None and not thread.is_alive()
    assert fake.gpm_samples_live == 0  # the readers are closed
    calls = fake.total_calls()
    sampler.sample_now()  # stopped: the readers are closed, nothing is read
    assert fake.total_calls() == calls
    fake.nvmlShutdown()


def test_a_wake_adds_a_sample_and_leaves_the_intervals_where_they_were(monkeypatch) -> None:
    # The sampler process wakes its thread at each validation's start. Were every wake to
    # restart the interval, validations closer together than it would leave the training
    # between them without a sample of its own (each epoch end would then wait for one).
    from runkit.gpu_stats import sampler as sampler_module

    clock = FakeClock()
    sampler = GpuSampler([], interval_s=1.0)
    script = [(0.4, True), (0.6, False), (0.3, True), (0.2, True), (0.5, False)]
    waits, samples = [], []

    class ScriptedWake:
        """Each wait takes the script's time and says whether a wake ended it."""

        def wait(self, timeout: float) -> bool:
            waits.append(round(timeout, 6))
            seconds, woken = script.pop(0)
            clock.advance(seconds)
            if not script:
                sampler._stop.set()
            return woken

        def clear(self) -> None:
            pass

    monkeypatch.setattr(sampler_module.time, "monotonic", clock)
    monkeypatch.setattr(GpuSampler, "alive", [object()])
    monkeypatch.setattr(sampler, "sample_now", lambda: samples.append(clock()))
    sampler._wake = ScriptedWake()
    sampler._run(first_sample=False)
    # woken at 0.4: a sample, and the interval's sample still at 1.0; woken at 1.3 and 1.5:
    # two samples, the next still at 2.0
    assert samples == pytest.approx([0.4, 1.0, 1.3, 1.5])
    assert waits == pytest.approx([1.0, 0.6, 1.0, 0.7, 0.5])


def test_the_thread_ends_when_every_gpu_is_lost_and_never_starts_without_one() -> None:
    clock = FakeClock()
    fake = opened_fake([FakeGpu().lose(at=1.0)], clock)
    sampler = sampler_on(fake, ["utilization"])
    sampler.interval_s = 0.01
    clock.set(1.0)
    sampler.start()
    thread = sampler._thread
    thread.join(timeout=10)
    assert not thread.is_alive() and sampler.alive == []
    sampler.stop()
    idle = GpuSampler(sampler.readers, interval_s=1.0)
    idle.start()
    assert idle._thread is None
    idle.stop()
    fake.nvmlShutdown()


# --------------------------------------------------------------------------- setup paths
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
    monitor.on_validation_start(trainer, None)
    monitor.on_validation_epoch_start(trainer, None)
    peaks.update(alloc=1.0, reserved=1.5)
    monitor.on_validation_epoch_end(trainer, None)
    peaks.update(alloc=0.5, reserved=0.5)
    monitor.on_train_epoch_end(trainer, None)
    monitor.teardown(trainer, None, "fit")
    (val, _), (train, _) = logger.calls
    assert val["gpu_val/node0/cuda1/torch_peak_alloc_gib"] == 1.0
    assert val["gpu_val/node0/cuda1/torch_peak_reserved_gib"] == 1.5
    assert train["gpu/node0/cuda1/torch_peak_alloc_gib"] == 2.0  # training's peak, kept aside
    assert train["gpu/node0/cuda1/torch_peak_reserved_gib"] == 3.0
    assert train["gpu/node0/cuda1/util_mean"] == 25.0
    assert len(resets) == 3  # epoch start, validation start, validation end


def test_a_cpu_run_says_so_once_at_info(caplog) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        GpuStatsMonitor().setup(stub_trainer(), None, "fit")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.INFO,
            "gpu_stats: rank 0: off: this run uses no CUDA device; training continues without "
            "GPU statistics",
        )
    ]


def test_no_nvml_is_one_warning(use_fake, caplog) -> None:
    fake = use_fake(FakeNvml(1, init_error="driver_not_loaded"))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        GpuStatsMonitor(device_uuids=[fake.gpus[0].uuid]).setup(stub_trainer(), None, "fit")
    ((level, line),) = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert level == logging.WARNING
    assert line.startswith("gpu_stats: rank 0: off: ") and "Driver Not Loaded" in line
    assert line.endswith("; training continues without GPU statistics")


def test_a_failure_while_starting_is_one_warning_and_training_goes_on(
    monkeypatch, use_fake, caplog
) -> None:
    fake = use_fake(FakeNvml(1))

    def boom(trainer: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu_callback, "process_devices", boom)
    monitor = GpuStatsMonitor(device_uuids=[fake.gpus[0].uuid])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(stub_trainer(), None, "fit")
    assert [r.getMessage() for r in caplog.records] == [
        "gpu_stats: rank 0: failed to start (RuntimeError: boom); training continues without "
        "GPU statistics"
    ]
    assert monitor.identities == [
        {
            "status": "failed to start (RuntimeError: boom)",
            "gpus": [],
            "node": 0,
            "rank": 0,
        }
    ]


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


# --------------------------------------------------------------------------- survivors of run 2
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


def test_a_strategy_without_parallel_devices_uses_its_root_device() -> None:
    cpu = torch.device("cpu")
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=cpu), world_size=1, num_nodes=1, local_rank=0
    )
    assert process_devices(trainer) == [(0, cpu)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval_s": 0}, "interval_s=0; give seconds > 0"),
        ({"key_prefix": "a/b"}, "key_prefix='a/b'; give a word without '/'"),
    ],
)
def test_zero_seconds_and_a_slash_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError) as raised:
        GpuStatsMonitor(**kwargs)
    assert str(raised.value) == f"GpuStatsMonitor: {message}"


def run_epoch_with_validation(monitor: GpuStatsMonitor, trainer: Any, clock: FakeClock) -> None:
    monitor.on_train_epoch_start(trainer, None)
    train_steps(monitor, trainer, clock, [0.0])
    monitor.on_validation_start(trainer, None)
    monitor.on_validation_epoch_start(trainer, None)
    clock.advance(1.0)
    monitor.on_validation_epoch_end(trainer, None)
    train_steps(monitor, trainer, clock, [0.0])
    monitor.on_train_epoch_end(trainer, None)


def test_sampler_cost_and_per_gpu_keys_reach_training_and_validation_alike(
    monkeypatch, use_fake, no_thread
) -> None:
    clock = FakeClock()
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=5)], clock=clock))
    costly = monitor_on(monkeypatch, fake, clock, log_sampler_cost=True)
    trainer = stub_trainer()
    costly.setup(trainer, None, "fit")
    run_epoch_with_validation(costly, trainer, clock)
    costly.teardown(trainer, None, "fit")
    (val, _), (train, _) = trainer.loggers[0].calls
    assert "gpu_val/node0/cuda0/sample_ms" in val and "gpu/node0/cuda0/sample_ms" in train
    terse = monitor_on(monkeypatch, fake, clock, per_gpu_keys_up_to=0)
    trainer = stub_trainer()
    terse.setup(trainer, None, "fit")
    run_epoch_with_validation(terse, trainer, clock)
    terse.teardown(trainer, None, "fit")
    ((train, _),) = trainer.loggers[0].calls  # validation: nothing left to log
    assert set(train) == {"loop/data_wait_frac", "loop/samples_per_s", "epoch"}


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
    flat = flatten_epoch(
        [
            {"node": 0, "gpus": {"cuda0": {"energy_j": 1.0}}},
            {"node": 1, "gpus": {"cuda0": {"energy_j": 2.0}}},
        ],
        "gpu",
        False,
    )
    assert flat["gpu/all/energy_j_sum"] == 3.0
    boards = {"cuda0": "GPU-a", "cuda1": "GPU-a"}
    same_board = [{"node": 0, "boards": boards, "gpus": {"cuda0": {"energy_j": 4.0},
                                                          "cuda1": {"energy_j": 4.0}}}]  # fmt: skip
    assert flatten_epoch(same_board, "gpu", False)["gpu/all/energy_j_sum"] == 4.0


def test_teardown_stops_the_sampling_thread(use_fake) -> None:
    fake = use_fake(FakeNvml(1))
    monitor = GpuStatsMonitor(interval_s=0.01, device_uuids=[fake.gpus[0].uuid], sampler="thread")
    trainer = stub_trainer()
    monitor.setup(trainer, None, "fit")
    samplers = [t for t in threading.enumerate() if t.name == "gpu-stats-sampler"]
    assert samplers
    monitor.teardown(trainer, None, "fit")
    assert not any(t.is_alive() for t in samplers)
    assert fake.balanced and not fake.initialised


def test_hooks_make_no_nvml_call_once_a_phase_has_samples(monkeypatch, use_fake, no_thread) -> None:
    clock = FakeClock()
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=[(0, 10), (2, 90)])], clock=clock))
    monitor = monitor_on(monkeypatch, fake, clock)
    trainer = stub_trainer()
    monitor.setup(trainer, None, "fit")
    sampler = monitor._sampler
    monitor.on_train_epoch_start(trainer, None)
    clock.set(1.0)
    sampler.sample_now()  # what the background thread does: util 10, training
    monitor.on_validation_start(trainer, None)
    monitor.on_validation_epoch_start(trainer, None)
    clock.set(2.0)
    sampler.sample_now()  # util 90, validation
    calls = fake.total_calls()
    monitor.on_validation_epoch_end(trainer, None)
    clock.set(3.0)
    monitor.on_train_epoch_end(trainer, None)
    assert fake.total_calls() == calls  # no closing sample needed, none taken
    (val, _), (train, _) = trainer.loggers[0].calls
    assert val["gpu_val/node0/cuda0/samples"] == 1 and val["gpu_val/node0/cuda0/util_mean"] == 90
    # the training sample from before the validation is kept, and it is the only one
    assert train["gpu/node0/cuda0/samples"] == 1 and train["gpu/node0/cuda0/util_mean"] == 10
    monitor.teardown(trainer, None, "fit")


def test_each_epoch_and_each_validation_has_only_its_own_samples(
    monkeypatch, use_fake, no_thread
) -> None:
    clock = FakeClock()
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=lambda t: 10.0 * (1 + int(t)))], clock=clock))
    monitor = monitor_on(monkeypatch, fake, clock)
    trainer = stub_trainer()
    monitor.setup(trainer, None, "fit")
    for _ in range(2):
        run_epoch_with_validation(monitor, trainer, clock)  # samples at t = 2 (val), 3 (train)
    monitor.teardown(trainer, None, "fit")
    rows = [row for row, _ in trainer.loggers[0].calls]
    assert [r["gpu_val/node0/cuda0/util_mean"] for r in rows[0::2]] == [30.0, 60.0]
    assert [r["gpu/node0/cuda0/util_mean"] for r in rows[1::2]] == [40.0, 70.0]
    assert [r["gpu/node0/cuda0/samples"] for r in rows[1::2]] == [1.0, 1.0]


@pytest.mark.parametrize(
    ("failing", "when", "label"),
    [
        ("set_phase", lambda phase, reset: phase == TRAIN and reset, "epoch start"),
        ("set_phase", lambda phase, reset: phase == VAL, "validation start"),
        ("set_phase", lambda phase, reset: phase == TRAIN and not reset, "validation end"),
        ("set_phase", lambda phase, reset: phase is None, "epoch end"),
        ("clear", None, "peak reset"),
        ("stash", None, "peak reset"),
        ("restart", None, "peak reset"),
        ("peaks", None, "peaks"),
        ("collect", None, "validation summary"),
    ],
)
def test_a_failing_step_is_named_in_its_one_line(
    monkeypatch, use_fake, no_thread, caplog, failing, when, label
) -> None:
    from runkit.gpu_stats import sampler as sampler_module

    clock = FakeClock()
    fake = use_fake(FakeNvml(1, clock=clock))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: None)
    monitor = monitor_on(monkeypatch, fake, clock)
    trainer = stub_trainer()
    monitor.setup(trainer, None, "fit")
    monitor._peaks = sampler_module.TorchPeakMemory({"cuda0": torch.device("cuda", 0)})
    if failing == "set_phase":
        real = GpuSampler.set_phase

        def set_phase(self, phase, *, reset=True, sample=True):
            if when(phase, reset):
                raise KeyError("oops")
            return real(self, phase, reset=reset, sample=sample)

        monkeypatch.setattr(GpuSampler, "set_phase", set_phase)
    else:
        owner = GpuSampler if failing == "collect" else sampler_module.TorchPeakMemory

        def broken(*args: Any, **kwargs: Any) -> None:
            raise KeyError("oops")

        monkeypatch.setattr(owner, failing, broken)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run_epoch_with_validation(monitor, trainer, clock)
    assert [r.getMessage() for r in caplog.records] == [
        f"gpu_stats: {label} failed (KeyError: 'oops'); sampling stops"
    ]
    assert not fake.initialised
    monitor.teardown(trainer, None, "fit")


def test_setup_opens_what_it_can_and_frees_what_it_could_not_use(
    monkeypatch, use_fake, no_thread, caplog
) -> None:
    gpm = {"SM_UTIL": 1}
    fake = use_fake(
        FakeNvml(
            [
                FakeGpu(gpm=gpm).fail("memory", "unknown"),  # fails at the probe, GPM open
                FakeGpu().fail("name", "unknown"),  # fails before the probe
                FakeGpu(name="fine"),
            ]
        )
    )
    cpu = torch.device("cpu")
    trainer = stub_trainer(
        strategy=SimpleNamespace(parallel_devices=[cpu, cpu, cpu], root_device=cpu)
    )
    monitor = monitor_on(monkeypatch, fake, FakeClock(), device_uuids=[g.uuid for g in fake.gpus])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monitor.setup(trainer, None, "fit")
    problems = [r.getMessage() for r in caplog.records]
    assert len(problems) == 2
    assert problems[0].startswith("gpu_stats: rank 0 (node 0): cuda0: NVMLError_Unknown")
    assert problems[1].startswith("gpu_stats: rank 0 (node 0): cuda1: NVMLError_Unknown")
    assert fake.gpm_samples_live == 0  # the failed reader's GPM pair was freed
    ((gpu,),) = [p["gpus"] for p in monitor.identities]
    assert (gpu["label"], gpu["name"]) == ("cuda2", "fine")
    assert monitor.identities[0]["status"] == "on"
    monitor.teardown(trainer, None, "fit")


def test_a_cuda_device_with_an_index_is_that_device(monkeypatch, use_fake, no_thread) -> None:
    fake = use_fake(FakeNvml([FakeGpu(name="g0"), FakeGpu(name="g1")]))
    bare = [g.uuid.split("-", 1)[1] for g in fake.gpus]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=bare[i])
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: None)
    cuda0 = torch.device("cuda", 0)
    trainer = stub_trainer(strategy=SimpleNamespace(parallel_devices=[cuda0], root_device=cuda0))
    monitor = GpuStatsMonitor(gpm=False)
    monitor.setup(trainer, None, "fit")
    ((gpu,),) = [p["gpus"] for p in monitor.identities]
    assert (gpu["label"], gpu["name"], gpu["unsupported"]) == ("cuda0", "g0", [])
    monitor.teardown(trainer, None, "fit")


def test_the_identity_line_says_none_when_everything_is_supported(
    monkeypatch, use_fake, no_thread, caplog
) -> None:
    fake = use_fake(FakeNvml([FakeGpu(name="N")]))
    monitor = monitor_on(monkeypatch, fake, FakeClock(), gpm=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor.setup(stub_trainer(), None, "fit")
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.endswith("; not supported: none")
    monitor.teardown(stub_trainer(), None, "fit")


def test_a_cpu_run_with_validation_is_quiet_and_prints_no_table(
    monkeypatch, capsys, caplog
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(gpu_callback, "LoopTimer", lambda: LoopTimer(clock))
    monitor = GpuStatsMonitor()
    trainer = stub_trainer()
    monitor.setup(trainer, None, "fit")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        run_epoch_with_validation(monitor, trainer, clock)
        monitor.on_fit_end(trainer, None)
    assert caplog.records == [] and capsys.readouterr().out == ""
    ((row, _),) = trainer.loggers[0].calls  # training only: no GPU, no validation figures
    assert set(row) == {"loop/data_wait_frac", "loop/samples_per_s", "epoch"}


def test_no_table_when_switched_off_or_not_rank_zero(
    monkeypatch, use_fake, no_thread, capsys
) -> None:
    clock = FakeClock()
    fake = use_fake(FakeNvml(1, clock=clock))
    for kwargs, rank_zero in (({"summary_table": False}, True), ({}, False)):
        monitor = monitor_on(monkeypatch, fake, clock, **kwargs)
        trainer = stub_trainer(is_global_zero=rank_zero)
        monitor.setup(trainer, None, "fit")
        run_epoch_with_validation(monitor, trainer, clock)
        monitor.on_fit_end(trainer, None)
        monitor.teardown(trainer, None, "fit")
        assert monitor.run_summary() != []
    assert capsys.readouterr().out == ""


def test_the_starvation_line_rounds_the_share_and_tells_unknown_settings(
    monkeypatch, caplog
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(gpu_callback, "LoopTimer", lambda: LoopTimer(clock))
    monitor = GpuStatsMonitor()
    trainer = stub_trainer(train_dataloader=SimpleNamespace(batch_size=2))
    monitor.setup(trainer, None, "fit")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monitor.on_train_epoch_start(trainer, None)
        train_steps(monitor, trainer, clock, [4.0])  # waited 4 s of 5: 80 %
        monitor.on_train_epoch_end(trainer, None)
    (line,) = starvation_lines(caplog)
    assert "the next batch 80% of its training time (4.0 s)" in line
    assert line.endswith("now data.num_workers=?, data.pin_memory=?, data.batch_size=2")


# --------------------------------------------------------------------------- GPM, loop, report
def test_a_gpm_sample_that_cannot_be_freed_names_the_error(monkeypatch, caplog) -> None:
    fake = opened_fake([FakeGpu(gpm={"SM_UTIL": 1})])
    counters = GpmCounters(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda0", None)
    counters.open()

    def refuse(sample: Any) -> None:
        raise fake.NVMLError_Uninitialized()

    monkeypatch.setattr(fake, "nvmlGpmSampleFree", refuse)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        counters.close()
    assert {r.getMessage() for r in caplog.records} == {
        f"gpu_stats: cuda0: freeing a GPM sample failed: {fake.NVMLError_Uninitialized()}"
    }
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


def test_the_tables_title_columns_and_formats(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    summary = RunSummary()
    summary.add_epoch([{"node": 0}])  # a rank without GPUs
    summary.add_epoch(
        [
            {
                "node": 12,
                "gpus": {
                    "cuda10": {
                        "sm_occupancy_mean": 33.0,
                        "samples": 2.0,
                        "mem_used_gib_max": 0.5,
                        "torch_peak_alloc_gib": 0.25,
                        "energy_j": 10_000.0,
                    }
                },
            },
            {"node": 1, "gpus": {"cuda0": {"samples": 1.0, "proc_mem_gib_max": 9.0}}},
        ]
    )
    rows = summary.rows([{"node": 1}])
    assert [r["gpu"] for r in rows] == ["node1/cuda0", "node12/cuda10"]
    assert rows[0]["sample_ms"] is None and rows[0]["samples"] == 1
    assert rows[1]["mem_used_gib_max"] == 0.5 and rows[1]["torch_peak_alloc_gib"] == 0.25
    print_table(rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].strip() == "GPU statistics over the run (training epochs)"
    header = next(line for line in lines if "name" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == [
        "GPU", "name", "util %", "occupancy %", "peak mem GiB", "torch peak GiB", "energy kJ",
        "samples", "NVML ms/sample",
    ]  # fmt: skip
    first, second = (line.split("│") for line in lines if "node1" in line)
    assert first[1] == " node1/cuda0   " and first[2] == " ?    "  # left-aligned
    assert [c.strip() for c in second[1:-1]] == [
        "node12/cuda10", "?", "n/a", "33.0", "0.50", "0.25", "10.00", "2", "n/a"
    ]  # fmt: skip


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
