"""Does DDP on the CPU scale? Samples per second of ``trainer.devices=2`` against one device.

Each arm is a real ``python -m project.train`` run on the CPU (the template's default callbacks
and logger, ``test=false``), on a compute-bound model: the ConvNet widened to (64,128,256)
channels (a step is tens of milliseconds; the gradients all-reduced per step are 1.5 MB).

* ``1 device``: one process; torch uses its default thread count (one per core), so the one
  process may use every core of the machine. This is the run a user gets without DDP.
* ``2 devices``: DDP over gloo, two processes. Lightning's launcher sets ``OMP_NUM_THREADS`` and
  ``torch.set_num_threads`` to ``cores // processes`` in each (unless ``OMP_NUM_THREADS`` is set
  already), so the processes do not oversubscribe the cores. Each takes ``data.batch_size``
  samples per step: a step sees twice the samples, and an epoch has half the steps.
* ``1 device, 1 thread``: one process with one thread, the per-core rate. The script also prints
  the CPU efficiency of a DDP rank (CPU seconds per sample of the 1-thread process over those of
  rank 0): a busy machine disturbs it much less than wall time, and twice it is the speed-up two
  free cores would give.

Throughput is training samples per second over the epochs after the first (a benchmark-only
callback on rank 0 stamps each epoch start); the printed figure is the median over interleaved
repeats of the per-repeat ratio to ``1 device``. Target: 2 devices >= 1.6x. On a shared machine
other processes take cores away from the 2-process arm first, and a process running one thread
per core stalls whenever one of its threads is descheduled: read the spread, the 1-thread arm
and the CPU efficiency.

    python benchmarks/ddp_scaling.py                  # about two minutes
    python benchmarks/ddp_scaling.py --repeats 5 --epochs 6
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

TRAIN_SAMPLES = 1257  # the digits training split (70 % of 1,797)
MODEL = ["model.net.channels=[64,128,256]"]


def run(tmp: Path, devices: int, epochs: int, threads: int | None) -> tuple[float, float]:
    """(training samples per second, rank 0's CPU seconds per sample it trained) of one run,
    over the epochs after the first."""
    stamps = tmp / f"epochs-{devices}-{threads}.txt"
    stamps.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROJECT_", "PL_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(_common.BENCH_DIR), env.get("PYTHONPATH", "")])
    env[_common.EPOCH_FILE_ENV] = str(stamps)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    command = [
        sys.executable,
        "-m",
        "project.train",
        f"paths.log_dir={tmp / 'logs'}",
        "trainer.accelerator=cpu",
        f"trainer.devices={devices}",
        f"trainer.max_epochs={epochs}",
        "test=false",
        "export_weights=false",
        "+callbacks.epoch_clock._target_=_common.epoch_clock_file",
        *MODEL,
    ]
    done = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run with devices={devices} failed:\n{done.stderr[-3000:]}")
    rows = [[float(v) for v in line.split()] for line in stamps.read_text().splitlines()]
    epochs = len(rows) - 2
    wall = rows[-1][0] - rows[1][0]
    cpu = rows[-1][1] - rows[1][1]  # rank 0's CPU seconds, all its threads
    return epochs * TRAIN_SAMPLES / wall, cpu / (epochs * TRAIN_SAMPLES / devices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4, help="per run; the first is warm-up")
    args = parser.parse_args()
    if args.repeats < 1 or args.epochs < 2:
        parser.error(f"--repeats={args.repeats} --epochs={args.epochs}: need >= 1 and >= 2")

    arms = {"1 device": (1, None), "1 device, 1 thread": (1, 1), "2 devices": (2, None)}
    rates = _common.Arms(list(arms))
    cpu = _common.Arms(list(arms))
    with tempfile.TemporaryDirectory(prefix="ddp_scaling_") as name:
        for order in _common.interleaved(args.repeats, list(arms)):
            for arm in order:
                devices, threads = arms[arm]
                rate, cpu_per_sample = run(Path(name), devices, args.epochs, threads)
                rates.add(arm, rate)
                cpu.add(arm, cpu_per_sample)

    import lightning  # noqa: F401  (only for the versions in the machine line)
    import torch  # noqa: F401

    print("\nDDP scaling on the CPU: training samples per second / the 1-device run")
    print(f"machine: {_common.machine_summary()}")
    print(
        f"model ConvNet (64,128,256), batch 64 per process, {args.epochs} epochs per run "
        f"(first excluded), {args.repeats} repeats, interleaved"
    )
    print(f"{'arm: samples/s over 1 device':<34} {'median':>7}   [min .. max]")
    for arm in arms:
        target = 1.6 if arm == "2 devices" else None
        print(_common.ratio_line(arm, rates.ratios(arm, "1 device"), target))
    per_core = rates.ratios("2 devices", "1 device, 1 thread")
    print(_common.ratio_line("2 devices / 1 device, 1 thread", per_core, 1.6))
    # CPU seconds per sample: 1-thread process / a DDP rank. 1.0 means DDP costs no extra CPU
    # per sample, so on two free cores two ranks would train twice as fast as one thread.
    efficiency = cpu.ratios("1 device, 1 thread", "2 devices")
    print(_common.ratio_line("CPU efficiency of a DDP rank", efficiency))
    print(_common.ratio_line("2 x efficiency (2 free cores)", [2 * e for e in efficiency], 1.6))


if __name__ == "__main__":
    main()
