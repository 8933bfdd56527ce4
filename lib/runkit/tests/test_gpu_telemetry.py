"""GPU telemetry beyond utilisation: GPM, the run's energy across a resume, data starvation, and
the epoch's figures reaching the loggers in one call (issues #12 and #13).

Everything runs on the CPU: the fake NVML stands in for the driver (with GPM and MIG), a
FakeClock drives the sampler where exact numbers are checked, and real ``Trainer.fit`` runs use
``device_uuids`` to say which fake GPU the CPU "device" is.
"""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_gpu_stats import fit, gpu_rows, loader

from runkit.gpu_stats import callback as gpu_callback
from runkit.gpu_stats.callback import GpuStatsMonitor, energy_report
from runkit.gpu_stats.gpm import GPM_METRICS, GpmCounters
from runkit.gpu_stats.loop import LoopTimer, batch_length
from runkit.gpu_stats.report import RunSummary
from runkit.gpu_stats.sampler import (
    DEFAULT_GROUPS,
    GIB,
    TRAIN,
    GpuReader,
    GpuSampler,
    TorchPeakMemory,
)
from runkit.gpu_stats.statistics import flatten_epoch, flatten_loop
from runkit.gpus import nvml
from runkit.run import run_files
from runkit.testing.fake_nvml import FakeClock, FakeGpu, FakeNvml

LOGGER = "runkit.gpu_stats"
HOPPER_GPM = {"SM_UTIL": 60, "SM_OCCUPANCY": 30, "ANY_TENSOR_UTIL": 20, "DRAM_BW_UTIL": 45}


def reader_for(fake: FakeNvml, handle, label: str = "cuda0") -> GpuReader:
    reader = GpuReader(fake, handle, label, DEFAULT_GROUPS)
    reader.probe()
    return reader


# --------------------------------------------------------------------------- GPM
def test_gpm_readings_cover_each_sampling_interval_exactly() -> None:
    clock = FakeClock()
    gpm = {**HOPPER_GPM, "SM_UTIL": [(0, 20), (2, 80)]}  # 20 % until t=2, then 80 %
    fake = FakeNvml([FakeGpu(gpm=gpm)], clock=clock)
    fake.nvmlInit()
    reader = reader_for(fake, fake.nvmlDeviceGetHandleByIndex(0))  # first sample at t=0
    assert "gpm" in reader.groups and fake.gpm_samples_live == 2
    sampler = GpuSampler([reader], interval_s=1.0)
    sampler.set_phase(TRAIN)
    for t in (1.0, 3.0, 4.0):  # intervals 0-1 (20 %), 1-3 (half 20, half 80 %), 3-4 (80 %)
        clock.set(t)
        sampler.sample_now()
    summary = sampler.summaries(TRAIN)["cuda0"]
    assert summary["sm_active_mean"] == pytest.approx((20 + 50 + 80) / 3)
    assert summary["sm_active_max"] == pytest.approx(80)
    assert summary["sm_occupancy_mean"] == 30 and summary["tensor_active_max"] == 20
    assert summary["dram_active_mean"] == 45
    assert not any(k.startswith(("fp16", "fp32", "fp64")) for k in summary)  # absent, never 0
    sampler.stop()
    assert fake.gpm_samples_live == 0  # the pair is freed when sampling stops
    fake.nvmlShutdown()


def test_gpm_of_a_mig_slice_comes_from_the_mig_sample_call() -> None:
    clock = FakeClock()
    slices = [FakeGpu(gpm={"SM_UTIL": 10}), FakeGpu(gpm={"SM_UTIL": 70})]
    fake = FakeNvml([FakeGpu(mig=slices)], clock=clock)
    fake.nvmlInit()
    board = fake.nvmlDeviceGetHandleByIndex(0)
    second = fake.nvmlDeviceGetMigDeviceHandleByIndex(board, 1)
    reader = reader_for(fake, second)
    clock.advance(1)
    values, _ = reader.read()
    assert values["sm_active"] == 70  # the second slice's, not the first's nor the GPU's
    assert fake.calls["nvmlGpmMigSampleGet"] == 2 and fake.calls["nvmlGpmSampleGet"] == 0
    assert reader.board_uuid == fake.gpus[0].uuid  # energy is counted per physical GPU
    reader.close()
    assert fake.gpm_samples_live == 0
    fake.nvmlShutdown()


def test_gpm_taken_by_a_profiler_pauses_with_one_line_and_comes_back(caplog) -> None:
    clock = FakeClock()
    gpu = FakeGpu(gpm={"SM_UTIL": 50})
    fake = FakeNvml([gpu], clock=clock)
    fake.nvmlInit()
    reader = reader_for(fake, fake.nvmlDeviceGetHandleByIndex(0))
    gpu.fail("nvmlGpmSampleGet", "in_use", start=1.5)  # DCGM or Nsight takes the counters
    readings = []
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for t in (1, 2, 3, 4):
            clock.set(t)
            if t == 4:
                gpu.heal("nvmlGpmSampleGet")
            readings.append(reader.read()[0].get("sm_active"))
        clock.set(5)
        readings.append(reader.read()[0].get("sm_active"))
    # t=2, 3 refused; t=4 starts a fresh pair (no figure yet); t=5 has one again
    assert readings == [50, None, None, None, 50]
    assert "gpm" in reader.groups and reader.dead is None  # the other metrics never stopped
    messages = [r.getMessage() for r in caplog.records]
    assert sum("GPM refused (InUse)" in m and "profiler" in m for m in messages) == 1
    assert sum("GPM figures are back" in m for m in messages) == 1
    reader.close()
    fake.nvmlShutdown()


def test_gpm_unsupported_or_missing_is_left_out_and_allocates_nothing() -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu(gpm=HOPPER_GPM).fail("gpm", "function_not_found")])
    fake.nvmlInit()
    for index in range(2):
        reader = reader_for(fake, fake.nvmlDeviceGetHandleByIndex(index))
        assert "gpm" not in reader.groups and "gpm" in reader.unsupported
        assert not set(GPM_METRICS) & set(reader.read()[0])
    assert fake.calls["nvmlGpmSampleAlloc"] == 0 and fake.gpm_samples_live == 0
    fake.nvmlShutdown()


def test_gpm_open_failing_after_alloc_frees_the_samples() -> None:
    fake = FakeNvml([FakeGpu(gpm=HOPPER_GPM).fail("nvmlGpmSampleGet", "gpu_is_lost")])
    fake.nvmlInit()
    counters = GpmCounters(fake, fake.nvmlDeviceGetHandleByIndex(0), "cuda0", None)
    with pytest.raises(fake.NVMLError_GpuIsLost):
        counters.open()
    assert fake.calls["nvmlGpmSampleAlloc"] == 2 and fake.gpm_samples_live == 0
    fake.nvmlShutdown()


def test_gpm_in_a_real_fit_reaches_csv_table_and_frees_its_samples(
    tmp_path, use_fake, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("COLUMNS", "220")
    fake = use_fake(FakeNvml([FakeGpu(name="Fake H200", util_gpu=90, gpm=HOPPER_GPM)]))
    monitor = GpuStatsMonitor(interval_s=0.02, device_uuids=[fake.gpus[0].uuid])
    fit(tmp_path, monitor, epochs=1, train_loader=loader(0.01), num_sanity_val_steps=0)
    (row,) = gpu_rows(tmp_path)
    assert float(row["gpu/node0/cuda0/sm_active_mean"]) == pytest.approx(60)
    assert float(row["gpu/node0/cuda0/tensor_active_max"]) == pytest.approx(20)
    assert float(row["gpu/node0/cuda0/dram_active_mean"]) == pytest.approx(45)
    assert "gpu/node0/cuda0/fp16_active_mean" not in row  # not scripted: absent
    table = capsys.readouterr().out
    assert "SM active %" in table and "60.0" in table
    assert fake.gpm_samples_live == 0 and fake.balanced


# --------------------------------------------------------------------------- keys
def payload(node, gpus, boards=None, rank=0):
    return {"node": node, "rank": rank, "gpus": gpus, "boards": boards or {}}


def test_one_gpu_has_no_aggregate_copies_of_its_own_keys() -> None:
    logged = flatten_epoch(
        [payload(0, {"cuda0": {"util_mean": 50.0, "energy_j": 3.0}})], "gpu", False
    )
    assert logged == {"gpu/node0/cuda0/util_mean": 50.0, "gpu/node0/cuda0/energy_j": 3.0}


def test_per_gpu_keys_up_to_n_per_node_then_aggregates_only() -> None:
    big = {f"cuda{i}": {"util_mean": float(i), "energy_j": 1.0} for i in range(16)}
    small = {"cuda0": {"util_mean": 99.0, "energy_j": 1.0}}
    logged = flatten_epoch([payload(0, big), payload(1, small)], "gpu", False, 8)
    assert not any(k.startswith("gpu/node0/") for k in logged)  # 16 > 8: aggregates only
    assert logged["gpu/node1/cuda0/util_mean"] == 99
    assert (logged["gpu/all/util_mean_min"], logged["gpu/all/util_mean_max"]) == (0, 99)
    assert logged["gpu/all/energy_j_sum"] == 17
    assert len(flatten_epoch([payload(0, big)], "gpu", False, 16)) > len(logged)


def test_energy_of_mig_slices_of_one_gpu_is_counted_once() -> None:
    boards = {"cuda0": "GPU-a", "cuda1": "GPU-a"}  # two slices of one physical GPU
    gpus = {"cuda0": {"energy_j": 10.0}, "cuda1": {"energy_j": 10.0}}
    other = payload(0, {"cuda0": {"energy_j": 5.0}}, {"cuda0": "GPU-b"}, rank=1)
    logged = flatten_epoch([payload(0, gpus, boards), other], "gpu", False)
    assert logged["gpu/all/energy_j_sum"] == 15
    monitor = GpuStatsMonitor()
    monitor._add_energy(  # the run's energy: every rank's cumulative counters, each board once
        [
            {**payload(0, {}, boards), "energy_total_j": {"cuda0": 100.0, "cuda1": 101.0}},
            {**payload(1, {}, {"cuda0": "GPU-a"}), "energy_total_j": {"cuda0": 99.0}},
        ]
    )
    assert monitor.run_energy_j() == {"node0/cuda0": 100.0}


def test_loop_figures_take_the_slowest_rank_and_the_runs_throughput() -> None:
    loops = [
        {"loop_s": 10.0, "data_wait_s": 2.0, "steps": 10, "samples": 100.0},
        {"loop_s": 10.0, "data_wait_s": 5.0, "steps": 10, "samples": 100.0},
        None,  # a rank that ran no step
    ]
    assert flatten_loop(loops) == {"loop/data_wait_frac": 0.5, "loop/samples_per_s": 20.0}
    assert flatten_loop([None]) == {}
    assert "loop/samples_per_s" not in flatten_loop([{"loop_s": 1.0, "data_wait_s": 0.0}])


def test_run_summary_weights_gpm_means_by_samples() -> None:
    summary = RunSummary()
    summary.add_epoch([payload(0, {"cuda0": {"sm_active_mean": 10.0, "samples": 1.0}})])
    summary.add_epoch([payload(0, {"cuda0": {"sm_active_mean": 40.0, "samples": 3.0}})])
    (row,) = summary.rows([])
    assert row["sm_active_mean"] == pytest.approx((10 + 120) / 4) and row["util_mean"] is None


def test_loop_timer_counts_the_gaps_between_steps_and_leaves_validation_out() -> None:
    clock = FakeClock()
    timer = LoopTimer(clock)
    batch = (torch.zeros(8, 3), torch.zeros(8))
    for fetch, step in ((2.0, 1.0), (0.5, 1.0)):  # first gap includes the loader start-up
        clock.advance(fetch)
        timer.batch_start()
        clock.advance(step)
        timer.batch_end(batch)
    timer.pause()  # mid-epoch validation: 10 s that are neither waiting nor training
    clock.advance(10)
    timer.batch_start()  # back to training (the gap since validation started is left out)
    clock.advance(1.0)
    timer.batch_end(batch)
    timer.pause()  # validation after the last step: not in the loop's time either
    clock.advance(7)
    assert timer.summary() == {"loop_s": 5.5, "data_wait_s": 2.5, "steps": 3.0, "samples": 24.0}
    timer.start_epoch()
    assert timer.summary() is None


def test_batch_length_finds_the_first_tensor_or_gives_up() -> None:
    assert batch_length({"x": [torch.zeros(5, 2)], "y": torch.zeros(5)}) == 5
    assert batch_length(torch.tensor(3.0)) is None and batch_length(["text"]) is None


# --------------------------------------------------------------------------- real fits
class CountingCsvLogger(CSVLogger):
    """The real CSV logger, counting the calls that carry GPU figures."""

    gpu_calls = 0

    def log_metrics(self, metrics, step=None):
        if any(k.startswith(("gpu/", "gpu_val/")) for k in metrics):
            self.gpu_calls += 1
        super().log_metrics(metrics, step)


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
    trainer = fit(tmp_path, monitor, stop, best, epochs=5, loggers=logger, num_sanity_val_steps=0)
    assert trainer.current_epoch == 2  # the constant key did not improve after epoch 0: stopped
    assert float(best.best_model_score) == pytest.approx(60)
    assert logger.gpu_calls == 2 * 2  # per epoch: one training call, one validation call
    assert set(trainer.callback_metrics) >= {key, "gpu/node0/cuda0/sm_active_mean"}
    assert "gpu/node0/cuda0/temp_c_max" not in trainer.callback_metrics  # no monitor asks
    assert [float(r[key]) for r in gpu_rows(tmp_path)] == [70, 70]


@pytest.mark.slow
def test_validation_figures_come_at_the_validations_step_and_at_once_to_a_monitor(
    tmp_path, use_fake, monkeypatch, caplog
) -> None:
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=[(0, 70)])]))
    uuids = [fake.gpus[0].uuid]
    key = "gpu_val/node0/cuda0/util_mean"

    class AtValidationEnd(pl.Callback):
        def __init__(self) -> None:
            self.seen = []

        def on_validation_end(self, trainer, pl_module) -> None:
            self.seen.append(trainer.callback_metrics.get(key))

    # Unwatched, they are logged at each validation's end, at the step of Lightning's own rows
    # (its val_loss); the epoch's at the step of its train_loss.
    unwatched = AtValidationEnd()
    monitor = GpuStatsMonitor(interval_s=0.05, device_uuids=uuids)
    fit(tmp_path, monitor, unwatched, val_check_interval=0.5, num_sanity_val_steps=0)
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
def test_energy_continues_across_a_resume_and_reaches_metrics_json(tmp_path, use_fake) -> None:
    fake = use_fake(FakeNvml([FakeGpu(power_mw=300_000)]))
    uuids = [fake.gpus[0].uuid]
    last = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    first = GpuStatsMonitor(interval_s=0.02, device_uuids=uuids, summary_table=False)
    fit(tmp_path / "a", first, last, epochs=2, train_loader=loader(0.002), num_sanity_val_steps=0)
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
        num_sanity_val_steps=0,
    )
    report = energy_report(trainer)
    assert report["training_samples"] == 4 * 12 * 4  # both runs' samples
    assert report["energy_j"] > state["energy_j"]["node0/cuda0"]  # continued, not restarted
    assert report["energy_kwh"] == pytest.approx(report["energy_j"] / 3.6e6)
    assert report["energy_j_per_training_sample"] == pytest.approx(report["energy_j"] / 192)
    run_files.save_metrics({}, tmp_path, None, trainer, started=time.time(), energy=report)
    written = json.loads((tmp_path / "metrics.json").read_text())["energy"]
    assert written["energy_j_per_gpu"] == {"node0/cuda0": pytest.approx(report["energy_j"])}


@pytest.mark.parametrize(
    "state",
    [
        {"energy_j": {"node0/cuda0": float("nan")}},
        {"energy_j": "lots"},
        "garbage",
        {"energy_j": {}, "train_samples": -3},
    ],
)
def test_a_damaged_checkpoint_state_is_one_line_and_ignored(state, caplog) -> None:
    monitor = GpuStatsMonitor()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monitor.load_state_dict(state)
    assert monitor.run_energy_j() == {} and monitor.run_samples() == 0
    (line,) = [r.getMessage() for r in caplog.records]
    assert "energy counts from this resume on" in line


@pytest.mark.slow
def test_a_starved_cpu_loop_is_measured_and_named_once_per_epoch(
    tmp_path, use_fake, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(gpu_callback, "MIN_WAIT_WARNING_S", 0.2)
    use_fake(FakeNvml(1))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        fit(
            tmp_path,
            GpuStatsMonitor(),
            epochs=2,
            train_loader=loader(0.025),
            num_sanity_val_steps=0,
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


def test_monitored_keys_come_from_callbacks_and_schedulers() -> None:
    trainer = SimpleNamespace(
        callbacks=[EarlyStopping(monitor="gpu/a"), object()],
        lr_scheduler_configs=[SimpleNamespace(monitor="gpu/b"), SimpleNamespace(monitor=None)],
    )
    assert gpu_callback.monitored_keys(trainer) == {"gpu/a", "gpu/b"}


# --------------------------------------------------------------------------- a real Hopper GPU
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


# --------------------------------------------------------------------------- units, peaks, energy
def probed(fake: FakeNvml, index: int, groups: list[str]) -> GpuReader:
    reader = GpuReader(fake, fake.nvmlDeviceGetHandleByIndex(index), f"cuda{index}", groups)
    reader.probe()
    return reader


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


def test_torch_peaks_are_kept_per_phase(monkeypatch: pytest.MonkeyPatch) -> None:
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


def monitor_with(state: dict) -> GpuStatsMonitor:
    monitor = GpuStatsMonitor()
    monitor.load_state_dict(state)
    return monitor


def test_energy_report_from_a_resumed_run() -> None:
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
