"""Does GpuStatsMonitor slow training? Loop and whole-epoch throughput with the callback on vs
off, and what its epoch-boundary hooks cost the training thread.

On CPU with the fake NVML: every call sleeps ``--call-cost-ms`` (a real one takes about 0.1-1
ms) and one process drives ``--gpus`` fake GPUs (the worst case for an epoch end). The arms
(no callback twice, an empty callback, each sampler) take turns on the machine every
``--slice-ms`` (:func:`_common.side_by_side`), so each meets the same machine; the sampler's
interval is stretched by the number of arms, so per second of its own training it samples as
often as at the nominal interval. Printed: the median of the per-repeat ratios over the two
runs without the callback, with min and max; the control row (the second run without it over
the first) shows what one run against another spreads. Target: whole-epoch
ratio >= 0.98 at the default 1 s interval, 8 GPUs at 0.3 ms a call.

    python benchmarks/callback_overhead.py --gpus 8 --call-cost-ms 0.3 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from runkit.gpu_stats import callback as gpu_callback
from runkit.gpu_stats.callback import GpuStatsMonitor
from runkit.gpus import nvml
from runkit.testing.fake_nvml import FakeGpu, FakeNvml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # benchmarks/ is not a package: found through sys.path

EMPTY = "empty callback"  # the arm with a callback that does nothing
TIMED = ", batch hooks timed"  # an arm whose callback's per-step hooks are timed: its own row
CONTROL = "off, again (control)"  # "off" twice: the baseline, and what one run spreads
GPM = {"SM_UTIL": 60, "SM_OCCUPANCY": 30, "ANY_TENSOR_UTIL": 20, "DRAM_BW_UTIL": 45}


class Mlp(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", torch.nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepHooksTimed:
    """Times a callback's own per-step hooks (batch start and end) on the training thread.

    Mixed into the monitor and into an empty callback alike, so the timer's own cost is in both
    and their difference is what the monitor's per-step bookkeeping adds to each step. Every
    time here is :func:`_common.clock`'s: the seconds the run held the machine."""

    step_hooks_s = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        start = _common.clock()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.step_hooks_s += _common.clock() - start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        start = _common.clock()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.step_hooks_s += _common.clock() - start


class TimedEmpty(StepHooksTimed, pl.Callback):
    """A callback that does nothing: what Lightning's hook calls cost by themselves."""


class TimedMonitor(GpuStatsMonitor):
    """The callback as shipped, with its epoch-boundary hooks timed (nothing per step: the
    whole-epoch arms measure the callback, not a timer)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.epoch_end_s: list[float] = []
        self.boundaries_s: list[float] = []  # per epoch: every epoch-boundary hook together

    def _timed(self, hook, *args) -> float:
        start = _common.clock()
        hook(*args)
        return _common.clock() - start

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.boundaries_s.append(self._timed(super().on_train_epoch_start, trainer, pl_module))

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        seconds = self._timed(super().on_validation_epoch_start, trainer, pl_module)
        if not trainer.sanity_checking and self.boundaries_s:
            self.boundaries_s[-1] += seconds

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        seconds = self._timed(super().on_validation_epoch_end, trainer, pl_module)
        if not trainer.sanity_checking and self.boundaries_s:
            self.boundaries_s[-1] += seconds

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        seconds = self._timed(super().on_train_epoch_end, trainer, pl_module)
        self.epoch_end_s.append(seconds)
        self.boundaries_s[-1] += seconds


class StepTimedMonitor(StepHooksTimed, TimedMonitor):
    """The callback with its per-step hooks timed too (the per-step rows)."""


class LoopTimer(pl.Callback):
    """Times the steady loop of each epoch and the whole run (first epoch start to train end)."""

    def __init__(self) -> None:
        self.loop_s = 0.0
        self.steps = 0
        self.first = self.run_start = self.run_end = 0.0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if not self.run_start:
            self.run_start = _common.clock()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.first = _common.clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx + 1 == trainer.num_training_batches:
            self.loop_s += _common.clock() - self.first
            self.steps += batch_idx + 1

    def on_train_end(self, trainer, pl_module) -> None:
        self.run_end = _common.clock()


@dataclass
class Run:
    """What one run measured, in :func:`_common.clock` seconds."""

    loop_s: float  # the steady loops (first batch start to last batch end), every epoch
    steps: int
    whole_s: float  # first epoch start to train end
    epoch_end_s: list[float]  # each on_train_epoch_end of the monitor
    boundaries_s: list[float]  # per epoch, the monitor's boundary hooks together
    step_hooks_s: float  # the arm's callback's batch hooks, all steps
    nvml_calls: int  # fake NVML calls the training process made
    balanced: bool  # every nvmlInit had its nvmlShutdown


def one_run(
    steps: int, epochs: int, arm: tuple[str | None, float, bool], fake: FakeNvml, log_dir: str
) -> Run:
    """Trains :class:`Mlp` for ``epochs`` of ``steps`` with the arm's callback, if any: ``arm``
    is (sampler or :data:`EMPTY` or ``None``, interval, per-step hooks timed)."""
    uuids = [g.uuid for g in fake.gpus]
    calls_before = fake.total_calls()
    sampler, interval_s, timed = arm
    timer = LoopTimer()
    callbacks: list[pl.Callback] = [timer]
    monitor = None
    if sampler == EMPTY:
        monitor = TimedEmpty() if timed else pl.Callback()
        callbacks.insert(0, monitor)
    elif sampler is not None:
        monitor = (StepTimedMonitor if timed else TimedMonitor)(
            interval_s=interval_s, device_uuids=uuids, summary_table=False
        )
        callbacks.insert(0, monitor)
    data = torch.utils.data.TensorDataset(
        torch.randn(steps * 32, 128), torch.randint(0, 10, (steps * 32,))
    )
    val = torch.utils.data.TensorDataset(torch.randn(64, 128), torch.randint(0, 10, (64,)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        num_sanity_val_steps=0,
        logger=CSVLogger(log_dir, name="csv"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(
        Mlp(),
        torch.utils.data.DataLoader(data, batch_size=32),
        torch.utils.data.DataLoader(val, batch_size=32),
    )
    return Run(
        loop_s=timer.loop_s,
        steps=timer.steps,
        whole_s=timer.run_end - timer.run_start,
        epoch_end_s=getattr(monitor, "epoch_end_s", []),
        boundaries_s=getattr(monitor, "boundaries_s", []),
        step_hooks_s=getattr(monitor, "step_hooks_s", 0.0),
        nvml_calls=fake.total_calls() - calls_before,
        balanced=fake.balanced,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--steps", type=int, default=1500, help="training steps per epoch (an epoch of 1 s+)"
    )
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run")
    parser.add_argument("--gpus", type=int, default=8, help="fake GPUs driven by the process")
    parser.add_argument("--call-cost-ms", type=float, default=0.3, help="fake NVML call cost")
    parser.add_argument(
        "--intervals", default="1.0", help="sampler intervals to test, comma separated"
    )
    parser.add_argument(
        "--slice-ms", type=float, default=20.0, help="each arm's turn on the machine (ms)"
    )
    args = parser.parse_args()
    if (
        args.repeats < 1
        or args.steps < 10
        or args.epochs < 1
        or args.gpus < 1
        or not 1 <= args.slice_ms <= 1000
    ):
        parser.error(
            f"--repeats={args.repeats} --steps={args.steps} --epochs={args.epochs} "
            f"--gpus={args.gpus} --slice-ms={args.slice_ms:g}: need repeats >= 1, steps >= 10, "
            "epochs >= 1, gpus >= 1, slice-ms 1 to 1000"
        )
    intervals = [float(v) for v in args.intervals.split(",") if v.strip()]

    _common.quiet()
    torch.set_num_threads(1)  # fewer moving parts: the question is the callback, not BLAS

    gpus = [FakeGpu(util_gpu=[(0, 40), (5, 90)], gpm=GPM) for _ in range(args.gpus)]
    fake = FakeNvml(gpus, call_cost_s=args.call_cost_ms / 1000)
    nvml.use_library(fake)
    # One process drives every fake GPU (as DataParallel would): parallel_devices[i] -> GPU i.
    gpu_callback.process_devices = lambda trainer: [
        (i, torch.device("cpu")) for i in range(args.gpus)
    ]
    arms: dict[str, tuple[str | None, float, bool]] = {
        "off": (None, 0.0, False),
        CONTROL: (None, 0.0, False),
        EMPTY: (EMPTY, 0.0, False),
        EMPTY + TIMED: (EMPTY, 0.0, True),
    }
    for v in intervals:
        arms[f"sampler, every {v:g} s"] = ("thread", v, False)
    per_step = f"sampler, every {intervals[0]:g} s"  # the per-step rows: its hooks timed
    arms[per_step + TIMED] = ("thread", intervals[0], True)
    # The arms take turns (side_by_side): each holds the machine one run's share of the time,
    # while a sampler's period runs in wall time. Stretched by the number of arms, each samples
    # as often per second of its own training as at the nominal interval.
    stretch = len(arms)
    loop = _common.Arms(list(arms))
    whole = _common.Arms(list(arms))
    epoch_end_ms: dict[str, list[float]] = {name: [] for name in arms}
    boundary_ms: dict[str, list[float]] = {name: [] for name in arms}
    epoch_s: dict[str, list[float]] = {name: [] for name in arms}
    step_us: dict[str, list[float]] = {name: [] for name in arms}  # loop time a step
    hooks_us: dict[str, list[float]] = {name: [] for name in arms}  # in the per-step hooks
    calls, balanced = 0, True
    with tempfile.TemporaryDirectory() as log_dir:
        # Warm-up here, one arm of each kind (no callback, the empty one, each sampler), so that
        # every run's process starts with the lazy imports of what it runs done.
        for arm in {arm[0]: arm for arm in arms.values()}.values():
            one_run(20, 1, arm, fake, log_dir)
        for order in _common.interleaved(args.repeats, list(arms)):
            runs = [
                (
                    one_run,
                    (
                        args.steps,
                        args.epochs,
                        (arms[name][0], arms[name][1] * stretch, arms[name][2]),
                        fake,
                        str(Path(log_dir, name.replace(" ", "_"))),
                    ),
                )
                for name in order
            ]
            results = _common.side_by_side(runs, args.slice_ms / 1000)
            for name, run in zip(order, results, strict=True):
                calls, balanced = calls + run.nvml_calls, balanced and run.balanced
                step_us[name].append(1e6 * run.loop_s / run.steps)
                hooks_us[name].append(1e6 * run.step_hooks_s / run.steps)
                loop.add(name, run.steps / run.loop_s)
                whole.add(name, args.epochs / run.whole_s)
                epoch_end_ms[name] += [1000 * s for s in run.epoch_end_s]
                boundary_ms[name] += [1000 * s for s in run.boundaries_s]
                epoch_s[name].append(run.whole_s / args.epochs)
    nvml.use_library(None)

    print(
        f"\ncallback overhead: GpuStatsMonitor on / off, the arms side by side in turns of "
        f"{args.slice_ms:g} ms, intervals stretched {stretch}x (see the docstring)"
    )
    print(f"machine: {_common.machine_summary()}; torch threads 1")
    print(
        f"{args.gpus} fake GPUs with GPM, NVML call cost {args.call_cost_ms} ms, {args.repeats} "
        f"repeats, {args.epochs} epochs of {args.steps} steps per run, CSV logger; ratios over "
        "the two runs without it (the control: over 'off' alone); ratios > 1 are noise"
    )
    print(
        f"{'arm':<44} {'loop ratio':>10} {'whole-epoch ratio':>18} {'epoch end ms':>22} "
        f"{'boundaries ms/epoch':>22}"
    )
    verdict = True
    for name, (sampler, interval, timed) in arms.items():
        if name == "off":
            continue
        baseline = ("off",) if name == CONTROL else ("off", CONTROL)
        loop_ratio = statistics.median(loop.ratios(name, *baseline))
        whole_ratios = whole.ratios(name, *baseline)
        whole_ratio = statistics.median(whole_ratios)
        low, high = _common.spread(whole_ratios)
        if sampler in (None, EMPTY):
            print(f"{name:<44} {loop_ratio:>10.3f} {whole_ratio:>8.3f} [{low:.3f}..{high:.3f}]")
            continue
        ends = epoch_end_ms[name]
        end_text = f"{statistics.median(ends):.2f} (max {max(ends):.2f})"
        bounds = boundary_ms[name]
        share = 100 * statistics.median(bounds) / (1000 * statistics.median(epoch_s[name]))
        bound_text = f"{statistics.median(bounds):.2f} ({share:.1f} %)"
        print(
            f"{name:<44} {loop_ratio:>10.3f} {whole_ratio:>8.3f} [{low:.3f}..{high:.3f}] "
            f"{end_text:>22} {bound_text:>22}"
        )
        if timed:  # a timer's work in every step: its row is not the callback's cost
            continue
        floor = 0.98 if interval >= 1.0 else None
        _common.ratio_line(f"{name} (whole epoch)", whole_ratios, floor)  # run_all's records
        _common.ratio_line(f"{name} (epoch end ms)", ends)  # not a ratio: milliseconds
        if floor is not None:
            verdict = verdict and whole_ratio >= floor
    print(
        f"\nper training step (us; a step takes {statistics.median(step_us['off']):.0f} us): each "
        "arm's loop time a step over the empty callback's arm (per repeat)"
    )
    for name, (sampler, _interval, timed) in arms.items():
        if sampler in (None, EMPTY) or timed:
            continue
        extra = [a - b for a, b in zip(step_us[name], step_us[EMPTY], strict=True)]
        low, high = _common.spread(extra)
        print(f"{name:<44} {statistics.median(extra):>10.2f} [{low:.1f}..{high:.1f}]")
    in_hooks = [
        a - b for a, b in zip(hooks_us[per_step + TIMED], hooks_us[EMPTY + TIMED], strict=True)
    ]
    low, high = _common.spread(in_hooks)
    hooks = statistics.median(in_hooks)
    print(
        f"in the callback's own batch hooks, '{per_step + TIMED}' over '{EMPTY + TIMED}': "
        f"{hooks:.2f} [{low:.2f}..{high:.2f}]"
    )
    _common.ratio_line(f"{per_step} (per-step us over an empty callback)", in_hooks)
    print(
        "target: whole-epoch ratio >= 0.98 at 1 s -> "
        + ("met" if verdict else "NOT met (check the spread: a noisy machine needs more repeats)")
    )
    print(
        f"fake NVML calls made in the training processes: {calls} (init/shutdown balanced: "
        f"{balanced})"
    )


if __name__ == "__main__":
    main()
