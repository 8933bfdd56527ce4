"""The GPU sampler in a process of its own (gpu_stats/process.py), on the fake NVML.

What it must keep: the thread's figures, to the last digit, on the same NVML sequence; no sampler
left behind however the trainer ends; a dead or hung sampler costing one line, never an epoch;
a thread where no process can be started.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
from test_gpu_stats import TinyModel
from test_gpu_stats import fit as shared_fit

from conftest import free_port
from runkit.gpu_stats import process as process_module
from runkit.gpu_stats.callback import GpuStatsMonitor
from runkit.gpu_stats.process import ProcessSampler
from runkit.gpu_stats.sampler import DEFAULT_GROUPS, TRAIN, VAL, GpuReader, GpuSampler
from runkit.gpus import nvml
from runkit.testing.fake_nvml import GIB, FakeGpu, FakeNvml, FakeProcess

LOGGER = "runkit.gpu_stats"
GPM = {"SM_UTIL": [(0, 30), (3, 70)], "SM_OCCUPANCY": 25, "DRAM_BW_UTIL": [(0, 10), (4, 50)]}


class SharedClock:
    """A fake clock both processes read: a double in shared memory, moved by the test."""

    def __init__(self) -> None:
        self.value = multiprocessing.get_context("fork").Value("d", 0.0, lock=False)

    def __call__(self) -> float:
        return self.value.value

    def advance(self, seconds: float) -> None:
        self.value.value += seconds


def scenario(clock: SharedClock) -> FakeNvml:
    """Two boards: one with GPM and changing figures, one split in MIG slices (one is ours)."""
    return FakeNvml(
        [
            FakeGpu(
                util_gpu=[(0, 10), (2, 50), (5, 90)],
                util_memory=[(0, 5), (3, 40)],
                power_mw=[(0, 100_000), (2, 350_000), (4, 500_000)],
                temperature=[(0, 40), (3, 65)],
                clocks_event_reasons=[(0, 0), (3, 0x4)],
                processes=[FakeProcess("self", [(0, 1 * GIB), (3, 3 * GIB)])],
                gpm=GPM,
            ),
            FakeGpu(
                power_mw=[(0, 200_000), (3, 250_000)],
                mig=[FakeGpu(memory_used=[(0, 2 * GIB), (4, 6 * GIB)]), FakeGpu()],
            ),
        ],
        clock=clock,
    )


def readers_of(fake: FakeNvml, gpus: list[tuple[str, str]] | None = None) -> list[GpuReader]:
    out = []
    for label, uuid in gpus_of(fake) if gpus is None else gpus:
        reader = GpuReader(fake, nvml.find_handle(fake, uuid)[0], label, DEFAULT_GROUPS)
        reader.probe()
        out.append(reader)
    return out


def gpus_of(fake: FakeNvml) -> list[tuple[str, str]]:
    return [("cuda0", fake.gpus[0].uuid), ("cuda1", fake.gpus[1].mig[0].uuid)]


def drive(sampler, clock: SharedClock) -> list:
    """One script of phases, the same for either sampler: what each phase end reported. The
    interval is long: every reading after the first is a phase end's own."""
    seen = []
    for phase, reset, seconds in [(TRAIN, True, 3), (VAL, True, 0.5), (TRAIN, False, 3)]:
        sampler.set_phase(phase, reset)
        clock.advance(seconds)
        seen.append(sampler.report(phase))
    sampler.set_phase(None)
    sampler.set_phase(TRAIN)
    seen.append(sampler.report(TRAIN))
    return [item for figures, energy in seen for item in (figures, energy)]


class ServingThread:
    """The child's serving in a thread of this process, for what only this process can see
    (the fake's GPM samples freed)."""

    exitcode = None

    def __init__(self, conn, gpus) -> None:
        self.pid = os.getpid()
        args = (conn, gpus, DEFAULT_GROUPS, 1000.0, process_module._Collect(), os.getppid())
        self._thread = threading.Thread(target=process_module.serve, args=args, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    kill = join  # no killing a thread: it ends by itself, or a test fails


def served_in_a_thread(gpus: list[tuple[str, str]]) -> ProcessSampler:
    mine, theirs = multiprocessing.Pipe(duplex=True)
    return ProcessSampler(ServingThread(theirs, gpus), mine, 1000.0)


def test_the_process_gives_the_threads_figures_on_the_same_sequence(use_fake) -> None:
    clock = SharedClock()
    thread_fake = scenario(clock)
    thread_fake.nvmlInit()
    thread = GpuSampler(readers_of(thread_fake), interval_s=1000.0)
    thread.start()
    expected = drive(thread, clock)
    thread.stop()
    thread_fake.nvmlShutdown()

    clock.value.value = 0.0
    fake = use_fake(scenario(clock))
    child = ProcessSampler.fork(gpus_of(fake), DEFAULT_GROUPS, 1000.0)
    fake.nvmlInit()
    child.attach(readers_of(fake))
    child.start()
    got = drive(child, clock)
    pid = child.pid
    child.stop()
    fake.nvmlShutdown()

    assert without_timings(got) == without_timings(expected)
    train, _, val, _, train2, energy, short, _ = got
    assert train["cuda0"]["util_mean"] == train2["cuda0"]["util_mean"] == 50  # t=3, no new one
    assert short["cuda0"]["util_mean"] == 90 and short["cuda1"]["mem_used_gib_max"] == 6  # t=6.5
    assert train["cuda0"]["proc_mem_gib_max"] == 3  # the trainer's memory, not the child's
    assert {"sm_active_mean", "dram_active_max"} <= set(short["cuda0"])  # GPM pairs
    assert "util_mean" not in train["cuda1"]  # a MIG slice
    assert energy["cuda0"] > train2["cuda0"]["energy_j"] > 0
    assert val["cuda0"]["samples"] == 1 and short["cuda0"]["samples"] == 1
    assert not process_alive(pid)


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_child_skips_a_gpu_it_cannot_find_and_frees_what_it_opened(use_fake) -> None:
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=40, gpm=GPM), FakeGpu(util_gpu=60, gpm=GPM)]))
    gpus = [("cuda0", fake.gpus[0].uuid), ("cuda1", fake.gpus[1].uuid)]
    child = served_in_a_thread([("cuda7", "GPU-not-here"), *gpus])  # unknown here: skipped
    child.start()
    serving, opened = child._process, fake.gpm_samples_live
    fake.nvmlInit()
    mine = readers_of(fake, gpus)
    child.attach(mine)
    child.set_phase(TRAIN)
    figures, _energy = child.report(TRAIN)
    child.stop()
    for reader in mine:
        reader.close()
    fake.nvmlShutdown()
    assert {label: gpu["util_mean"] for label, gpu in figures.items()} == {"cuda0": 40, "cuda1": 60}
    assert opened > 0 and fake.gpm_samples_live == 0  # the child's readers closed theirs
    assert fake.balanced and not serving.is_alive()


def test_a_child_that_cannot_open_nvml_says_why(use_fake) -> None:
    fake = use_fake(FakeNvml([FakeGpu()], init_error="driver_not_loaded"))
    child = served_in_a_thread([("cuda0", fake.gpus[0].uuid)])
    with pytest.raises(process_module.SamplerUnavailable) as failed:
        child.start()
    assert str(failed.value) == (
        "the sampler process did not start: NvmlUnavailable: NVML is not available "
        "(Driver Not Loaded)"
    )
    assert not child._process.is_alive()


def test_a_reading_counts_for_the_phase_it_began_in_and_closes_it(use_fake) -> None:
    # A validation shorter than one reading: its reading, begun in it, ends after the phase
    # went back to training. It counts for the validation, and closing the validation waits
    # for it instead of taking a second one.
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=40)]))
    fake.nvmlInit()
    sampler = GpuSampler(readers_of(fake, [("cuda0", fake.gpus[0].uuid)]), interval_s=1000.0)
    started, release, reads = threading.Event(), threading.Event(), []
    read = sampler._read

    def slow_read(reader):
        reads.append(reader.label)
        started.set()
        assert release.wait(10)
        return read(reader)

    sampler._read = slow_read
    closed = {}
    try:
        sampler.set_phase(VAL)
        reading = threading.Thread(target=sampler.sample_now)
        reading.start()
        assert started.wait(10)
        closing = threading.Thread(target=lambda: closed.update(sampler.summaries(VAL)))
        closing.start()
        sampler.set_phase(TRAIN)  # the validation ends meanwhile
        release.set()
        reading.join(10)
        closing.join(10)
        assert reads == ["cuda0"] and closed["cuda0"]["samples"] == 1  # one reading
    finally:
        release.set()
        sampler.stop()
        fake.nvmlShutdown()


def without_timings(seen: list) -> list:
    """The figures less ``sample_ms``: the sampler's own time per reading, a measurement."""
    for figures in seen:
        for values in figures.values():
            if isinstance(values, dict):
                assert values.pop("sample_ms") >= 0
    return seen


def process_alive(pid: int | None) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its parent counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


# --------------------------------------------------------------------------- a real fit
def fit(tmp_path: Path, monitor: GpuStatsMonitor, *callbacks, epochs: int = 3) -> pl.Trainer:
    model = TinyModel(step_s=0.005)
    return shared_fit(
        tmp_path, monitor, *callbacks, epochs=epochs, model=model, num_sanity_val_steps=0
    )


def util_means(tmp_path: Path) -> list[str]:
    import csv

    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as handle:
        rows = [r for r in csv.DictReader(handle) if "loop/samples_per_s" in r and r.get("epoch")]
    return [r.get("gpu/node0/cuda0/util_mean", "") for r in rows if r.get("loop/samples_per_s")]


class Harm(pl.Callback):
    """Does ``harm`` to the sampler process at one step of the first epoch; times each epoch."""

    def __init__(self, monitor: GpuStatsMonitor, harm: str) -> None:
        self.monitor, self.harm = monitor, harm
        self.pid: int | None = None
        self.epoch_s: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch == 0 and batch_idx == 3:
            self.pid = self.monitor._sampler.pid
            os.kill(self.pid, signal.SIGKILL if self.harm == "kill" else signal.SIGSTOP)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.epoch_s.append(time.perf_counter() - self.started)


def test_the_figures_of_a_fit_come_from_the_child(tmp_path, use_fake) -> None:
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=40)]))
    monitor = GpuStatsMonitor(interval_s=0.01, device_uuids=[fake.gpus[0].uuid])
    seen = {}

    class Calls(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            seen["pid"] = monitor._sampler.pid
            seen.setdefault("calls", []).append(fake.total_calls())

    fit(tmp_path, monitor, Calls(), epochs=3)
    assert util_means(tmp_path) == ["40.0", "40.0", "40.0"]
    assert isinstance(seen["pid"], int) and seen["pid"] != os.getpid()
    assert len(set(seen["calls"])) == 1  # this process read nothing in epochs 2 and 3
    assert not process_alive(seen["pid"]) and fake.balanced


@pytest.mark.parametrize("harm", ["kill", "hang"])
def test_a_dead_or_hung_sampler_is_one_warning_and_the_run_goes_on(
    tmp_path, use_fake, caplog, monkeypatch, harm
) -> None:
    monkeypatch.setattr(ProcessSampler, "reply_timeout_s", 0.5)
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=40)]))
    monitor = GpuStatsMonitor(interval_s=0.01, device_uuids=[fake.gpus[0].uuid])
    harmed = Harm(monitor, harm)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer = fit(tmp_path, monitor, harmed)
    assert trainer.current_epoch == 3
    lines = [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]
    assert len(lines) == 1, lines
    assert f"sampler process (pid {harmed.pid})" in lines[0] and "in a thread" in lines[0]
    means = util_means(tmp_path)
    assert len(means) == 3 and means[1:] == ["40.0", "40.0"]  # later epochs: the thread's
    assert max(harmed.epoch_s) < 0.5 + 12 * 0.005 + 3.0  # the wait was bounded
    assert not process_alive(harmed.pid) and fake.balanced


def test_where_no_process_can_be_forked_a_thread_samples_after_one_line(
    tmp_path, use_fake, caplog, monkeypatch
) -> None:
    def no_fork(method):
        raise ValueError(f"cannot find context for {method!r}")

    monkeypatch.setattr(process_module.multiprocessing, "get_context", no_fork)
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=40)]))
    monitor = GpuStatsMonitor(interval_s=0.01, device_uuids=[fake.gpus[0].uuid])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        fit(tmp_path, monitor, epochs=1)
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]
    assert "cannot fork" in line and "sampling in a thread" in line
    assert util_means(tmp_path) == ["40.0"]


def test_a_sampler_that_does_not_start_means_a_thread_after_one_line(
    tmp_path, use_fake, caplog, monkeypatch
) -> None:
    def broken_child(conn, *args):
        conn.send(("NVMLError_Unknown: the child's NVML failed", []))

    monkeypatch.setattr(process_module, "_child", broken_child)
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=40)]))
    monitor = GpuStatsMonitor(interval_s=0.01, device_uuids=[fake.gpus[0].uuid])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        fit(tmp_path, monitor, epochs=1)
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]
    assert "did not start: NVMLError_Unknown" in line
    assert util_means(tmp_path) == ["40.0"]


def test_teardown_and_an_exception_end_the_child(tmp_path, use_fake) -> None:
    fake = use_fake(FakeNvml([FakeGpu(util_gpu=40)]))
    monitor = GpuStatsMonitor(interval_s=0.01, device_uuids=[fake.gpus[0].uuid])
    pids = []

    class Boom(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            pids.append(monitor._sampler.pid)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, monitor, Boom())
    assert pids and not process_alive(pids[0]) and fake.balanced


# --------------------------------------------------------------------------- the trainer dies
# A trainer of 50 ms steps that prints its sampler's PID: one process ("deathsig", or
# "no-deathsig": only the child's watch can end it) or two DDP ranks under a launcher.
TRAINER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import lightning.pytorch as pl
    from runkit.gpu_stats import process
    from runkit.gpu_stats.callback import GpuStatsMonitor

    variant = sys.argv[1]
    if variant == "no-deathsig":
        process.die_with_parent = lambda signum: None

    class Report(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:  # one write: the ranks share the pipe, a small write is whole
                pid = trainer.callbacks[0]._sampler.pid
                os.write(1, f"SAMPLER {trainer.global_rank} {os.getpid()} {pid}\\n".encode())

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)
        def training_step(self, batch, i):
            time.sleep(0.05)
            return self.layer(batch[0]).sum()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if __name__ == "__main__":  # ddp_spawn imports this file in each rank
        ddp = variant in ("ddp", "ddp_spawn", "torchrun")
        uuids = [f"GPU-0000000{i}-fa6e-4000-8000-00000000000{i}" for i in range(2)]
        monitor = GpuStatsMonitor(interval_s=0.05, device_uuids=uuids, summary_table=False)
        trainer = pl.Trainer(accelerator="cpu", devices=2 if ddp else 1, max_epochs=1,
                             strategy="ddp_spawn" if variant == "ddp_spawn" else "auto" if not ddp else "ddp",
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[monitor, Report()])
        data = torch.utils.data.TensorDataset(torch.randn(4000, 4))
        trainer.fit(M(), torch.utils.data.DataLoader(data, batch_size=1, num_workers=0 if ddp else 1))
    """
)


def start_trainer(tmp_path: Path, variant: str, gpus: int) -> subprocess.Popen:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROJECT_", "LOCAL_RANK"))}
    env.update(OMP_NUM_THREADS="1", RUNKIT_NVML_BACKEND="runkit.testing.fake_nvml:create",
               RUNKIT_FAKE_NVML=f'{{"gpus": {gpus}}}')  # fmt: skip
    command = [sys.executable, str(script), variant]
    if variant == "torchrun":
        command[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port())]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=tmp_path, start_new_session=True)  # fmt: skip


def samplers_of(job: subprocess.Popen, ranks: int) -> dict[int, tuple[int, int]]:
    """``{rank: (trainer PID, sampler PID)}`` as the trainer prints them."""
    seen: dict[int, tuple[int, int]] = {}
    output = []
    for line in job.stdout:
        output.append(line)
        for rank, trainer, sampler in re.findall(r"SAMPLER (\d+) (\d+) (\d+)", line):
            seen[int(rank)] = (int(trainer), int(sampler))
        if len(seen) == ranks:
            break
    assert len(seen) == ranks and all(process_alive(s) for _, s in seen.values()), output
    return seen


def alive_after_5s(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + 5.0
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if process_alive(p)]


@pytest.mark.slow  # a trainer process of its own, killed
@pytest.mark.parametrize(
    ("signum", "variant"),
    [(signal.SIGKILL, "deathsig"), (signal.SIGKILL, "no-deathsig"), (signal.SIGTERM, "deathsig")],
)
def test_no_sampler_outlives_its_trainer(tmp_path, signum, variant) -> None:
    trainer = start_trainer(tmp_path, variant, gpus=1)
    try:
        ((_, sampler),) = samplers_of(trainer, 1).values()
        trainer.send_signal(signum)
        trainer.wait(timeout=30)
        assert not alive_after_5s([sampler]), f"sampler {sampler} outlived its trainer by 5 s"
    finally:
        trainer.kill()
        trainer.wait()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["ddp", "ddp_spawn", "torchrun"])
def test_no_sampler_outlives_a_ddp_rank_killed_with_sigkill(tmp_path, launcher) -> None:
    job = start_trainer(tmp_path, launcher, gpus=2)
    try:
        seen = samplers_of(job, 2)
        for trainer, _ in seen.values():  # every rank dies at once, as an OOM killer would
            os.kill(trainer, signal.SIGKILL)
        left = alive_after_5s([s for _, s in seen.values()])
        assert not left, f"samplers {left} outlived their ranks by 5 s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
