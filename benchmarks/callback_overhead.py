"""Does GpuStatsMonitor slow the training loop? Throughput with the callback on vs off.

The callback promises that the training thread makes no NVML call per step: sampling happens in
a background thread. This benchmark measures what that costs the loop anyway (the thread still
competes for the GIL), on CPU with the fake NVML where every call sleeps ``--call-cost-ms`` (a
real NVML call takes roughly 0.1-1 ms). Arms are interleaved (A/B/C, B/C/A, ...) over several
repeats; printed is the median of the per-repeat ratios (each "on" run over the "off" run of
the same repeat) with their min and max, because absolute times say more about the machine than
about the callback.

Throughput is measured from the first batch to the last batch of the epoch (the steady loop).
The boundary samples the callback takes on the training thread at epoch start/end are reported
separately, as a share of the epoch.

    python benchmarks/callback_overhead.py              # about a minute
    python benchmarks/callback_overhead.py --repeats 9 --steps 1500
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from project.machinery.gpu_stats.callback import GpuStatsMonitor
from project.machinery.gpus import nvml
from project.machinery.testing.fake_nvml import FakeGpu, FakeNvml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # benchmarks/ is not a package: found through sys.path


class Mlp(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LoopTimer(pl.Callback):
    """Times the steady loop (first batch start to last batch end) and the whole epoch."""

    def __init__(self) -> None:
        self.first = self.last = self.epoch_start = self.epoch_end = 0.0
        self.steps = 0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.epoch_start = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.first = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.last = time.perf_counter()
        self.steps = batch_idx + 1

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.epoch_end = time.perf_counter()


def one_run(steps: int, interval_s: float | None, fake: FakeNvml) -> tuple[float, float]:
    """(steps per second of the steady loop, seconds of the whole epoch) for one arm."""
    timer = LoopTimer()
    callbacks: list[pl.Callback] = [timer]
    if interval_s is not None:
        callbacks.insert(
            0,
            GpuStatsMonitor(
                interval_s=interval_s, device_uuids=[fake.gpus[0].uuid], summary_table=False
            ),
        )
    data = torch.utils.data.TensorDataset(
        torch.randn(steps * 32, 128), torch.randint(0, 10, (steps * 32,))
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(Mlp(), torch.utils.data.DataLoader(data, batch_size=32))
    # The window holds every step (first batch start to last batch end), the same for every arm.
    return timer.steps / (timer.last - timer.first), timer.epoch_end - timer.epoch_start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--steps", type=int, default=2500, help="training steps per run (the loop should span 1 s+)"
    )
    parser.add_argument("--call-cost-ms", type=float, default=0.3, help="fake NVML call cost")
    parser.add_argument(
        "--intervals", default="1.0,0.05", help="sampler intervals to test, comma separated"
    )
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 10:
        parser.error(
            f"--repeats={args.repeats} --steps={args.steps}: need repeats >= 1, steps >= 10"
        )
    intervals = [float(v) for v in args.intervals.split(",") if v.strip()]

    _common.quiet()
    torch.set_num_threads(1)  # fewer moving parts: the question is the callback, not BLAS

    fake = FakeNvml([FakeGpu(util_gpu=[(0, 40), (5, 90)])], call_cost_s=args.call_cost_ms / 1000)
    nvml.use_library(fake)
    arms: dict[str, float | None] = {"off": None}
    arms.update({f"on, every {v:g} s": v for v in intervals})
    throughput = _common.Arms(list(arms))
    epoch_s = _common.Arms(list(arms))
    one_run(20, intervals[0] if intervals else None, fake)  # warm-up: imports, allocator, threads
    for order in _common.interleaved(args.repeats, list(arms)):
        for name in order:
            rate, epoch = one_run(args.steps, arms[name], fake)
            throughput.add(name, rate)
            epoch_s.add(name, 1.0 / epoch)  # epochs per second: higher is better, like rate
    nvml.use_library(None)

    print("\ncallback overhead: GpuStatsMonitor on / off, same process, interleaved")
    print(f"machine: {_common.machine_summary()}; torch threads 1")
    print(
        f"fake NVML call cost {args.call_cost_ms} ms, {args.repeats} repeats, {args.steps} steps "
        "per run; ratios > 1 are noise"
    )
    print(f"{'arm: loop throughput / off':<34} {'median':>7}   [min .. max]")
    verdict = True
    for name, interval in arms.items():
        if interval is None:
            continue
        ratios = throughput.ratios(name, "off")
        # The target is for the default interval (1 s); faster ones are shown for scale.
        target = 0.99 if interval >= 1.0 else None
        print(_common.ratio_line(name, ratios, target))
        if target is not None and sorted(ratios)[len(ratios) // 2] < target:
            verdict = False
    print(f"{'arm: whole epoch (with boundary samples)':<34}")
    for name, interval in arms.items():
        if interval is not None:
            print(_common.ratio_line(name, epoch_s.ratios(name, "off")))
    print(
        "target (intervals >= 1 s): loop throughput ratio >= 0.99 -> "
        + ("met" if verdict else "NOT met (check the spread: a noisy machine needs more repeats)")
    )
    print(f"fake NVML calls made: {fake.total_calls()} (init/shutdown balanced: {fake.balanced})")


if __name__ == "__main__":
    main()
