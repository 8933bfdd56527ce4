"""GPU throughput and model FLOP utilisation (MFU) of the template, against a plain PyTorch loop.

Needs a CUDA GPU; on a machine without one it prints one line and exits 0 (``--allow-cpu`` runs
the same code on the CPU with a small workload, to check the script itself).

Workloads (in-memory synthetic data, so the GPU, not the input pipeline, is what is measured):

* ``mlp``: MLP 1024 -> 4096 -> 4096 -> 4096 -> 10, batch 4096 (matmul-bound);
* ``convnet``: the template's ConvNet with (64,128,256) channels on 3x32x32 images, batch 512.

Arm "template": :func:`project.train.train` on the composed config (every default callback,
CSV logger, checkpoints, GPU statistics; the speed defaults: ``precision=auto`` -> bf16-mixed on
a bf16 GPU, ``matmul_precision=high``, channels-last for the ConvNet, ``callbacks.speed.compile`` as
given). Arm "plain": the same network, optimiser, data order, precision (``torch.autocast`` to
bf16 when the template chose bf16-mixed), matmul precision and memory layout in a hand-written
loop, with a validation pass per epoch like the template's. Arm "lightning": the same module
and data through the ``lightning.pytorch.Trainer`` a user writes by hand (its defaults: progress
bar, checkpoint each epoch, model summary, CSV logger; ``loop_parity.run_plain``), with the
template's precision and float32 matmul precision, without channels-last or compile. All are timed from one epoch start
to the next (the first epoch, with cuDNN autotuning and compilation, excluded), with a
``torch.cuda.synchronize()`` at each stamp.

MFU = (FLOPs of one training step, counted by ``torch.utils.flop_counter.FlopCounterMode`` on
one forward and backward pass) x (steps per second) / (peak dense FLOP/s of the GPU for the
dtype in use). Peaks come from a small table of data-centre GPUs (``--peak-tflops`` overrides);
an unknown GPU gets no MFU rather than a guessed one.

    python benchmarks/gpu_throughput.py                       # both workloads, ~2 minutes
    python benchmarks/gpu_throughput.py --workloads mlp --repeats 5 --epochs 6
    python benchmarks/gpu_throughput.py --compile             # callbacks.speed.compile=true in both arms
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import loop_parity

# Dense peak TFLOP/s (no sparsity) by (name fragment, dtype): vendor data sheets, SXM parts.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("GH200", {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("B200", {"bf16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
]

# workload -> (config overrides, input shape, batch size, samples in the synthetic data set)
WORKLOADS: dict[str, tuple[list[str], tuple[int, ...], int, int]] = {
    "mlp": (
        ["model=mlp", "model.net.in_features=1024", "model.net.hidden=[4096,4096,4096]"],
        (1024,),
        4096,
        4096 * 24,
    ),
    "convnet": (
        ["model.net.in_channels=3", "model.net.channels=[64,128,256]"],
        (3, 32, 32),
        512,
        512 * 48,
    ),
}
CPU_WORKLOADS: dict[str, tuple[list[str], tuple[int, ...], int, int]] = {
    "mlp": (["model=mlp", "model.net.in_features=64", "model.net.hidden=[64]"], (64,), 64, 640),
    "convnet": (
        ["model.net.in_channels=3", "model.net.channels=[8,16]"],
        (3, 8, 8),
        64,
        640,
    ),
}


def synthetic_data(shape: list[int], samples: int, **kwargs: Any) -> Any:
    """An ArrayDataModule over ``samples`` random inputs of ``shape``, with 10 classes."""
    import torch

    from runkit.data import ArrayDataModule

    class Synthetic(ArrayDataModule):
        def load_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
            generator = torch.Generator().manual_seed(0)
            inputs = torch.randn(samples, *shape, generator=generator)
            return inputs, torch.randint(0, 10, (samples,), generator=generator)

    return Synthetic(**kwargs)


def synced_clock() -> Any:
    """The epoch clock of _common, with a CUDA synchronize before each stamp."""
    import torch
    from lightning.pytorch import Callback

    class _Clock(Callback):
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            _common.EPOCH_STAMPS.append(_common.stamp())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            _common.EPOCH_STAMPS.append(_common.stamp())

    return _Clock()


def compose(workload: str, epochs: int, out: Path, cpu: bool, extra: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from project import config_dir

    table = CPU_WORKLOADS if cpu else WORKLOADS
    overrides, shape, batch, samples = table[workload]
    overrides = [
        *overrides,
        f"trainer.accelerator={'cpu' if cpu else 'gpu'}",
        "trainer.devices=1",
        f"trainer.max_epochs={epochs}",
        f"paths.output_dir={out}",
        "test=false",
        "export_weights=false",
        "data._target_=gpu_throughput.synthetic_data",
        f"data.batch_size={batch}",
        f"+data.shape=[{','.join(map(str, shape))}]",
        f"+data.samples={samples}",
        "+callbacks.epoch_clock._target_=gpu_throughput.synced_clock",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def run_template(cfg: Any) -> list[tuple[float, float]]:
    from project.train import train

    _common.EPOCH_STAMPS.clear()
    train(cfg)
    return list(_common.EPOCH_STAMPS)


def choices(cfg: Any, cpu: bool) -> tuple[Any, str, bool]:
    """(torch device, Lightning precision, channels-last) that the template picks for ``cfg``."""
    import torch

    from runkit import speed

    indices = [] if cpu else [torch.cuda.current_device()]
    precision = speed.resolve_precision(cfg.precision, indices)
    device = torch.device("cpu" if cpu else f"cuda:{indices[0]}")
    layout = bool(cfg.callbacks.speed.channels_last) and device.type == "cuda"
    return device, precision, layout and cfg.model.net._target_.endswith("ConvNet")


def run_plain(cfg: Any, cpu: bool) -> list[tuple[float, float]]:
    """The hand-written loop on the same config: same data order, precision, layout."""
    import torch
    import torch.nn.functional as F
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader

    from runkit import speed
    from runkit.data import EpochShuffle, collate_rows

    device, precision, layout = choices(cfg, cpu)
    speed.apply_matmul_precision(cfg.matmul_precision, [] if cpu else [device.index])
    torch.manual_seed(cfg.seed)
    data = instantiate(cfg.data)
    data.setup("fit")
    net = instantiate(cfg.model.net).to(device)
    if layout:
        net = net.to(memory_format=torch.channels_last)
    speed.maybe_compile(net, bool(cfg.callbacks.speed.compile))
    optimizer = instantiate(cfg.model.optimizer)(params=net.parameters())
    scheduler = instantiate(cfg.model.scheduler)(optimizer=optimizer)
    sampler = EpochShuffle(data.train_set, seed=cfg.seed)
    pin = device.type == "cuda"
    train_loader = DataLoader(
        data.train_set,
        batch_size=data.batch_size,
        sampler=sampler,
        pin_memory=pin,
        collate_fn=collate_rows,
    )
    val_loader = DataLoader(
        data.val_set, batch_size=data.batch_size, pin_memory=pin, collate_fn=collate_rows
    )
    autocast = precision.startswith("bf16")

    def to_device(inputs: Any, targets: Any) -> tuple[Any, Any]:
        inputs = inputs.to(device, non_blocking=True)
        if layout:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets.to(device, non_blocking=True)

    stamps = []
    for epoch in range(cfg.trainer.max_epochs):
        if device.type == "cuda":
            torch.cuda.synchronize()
        stamps.append(_common.stamp())
        sampler.set_epoch(epoch)
        net.train()
        correct = torch.zeros((), dtype=torch.long, device=device)
        for inputs, targets in train_loader:
            inputs, targets = to_device(inputs, targets)
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = net(inputs)
                loss = F.cross_entropy(logits, targets)
            loss.backward()
            optimizer.step()
            correct += (logits.detach().argmax(-1) == targets).sum()
        net.eval()
        with (
            torch.inference_mode(),
            torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast),
        ):
            for inputs, targets in val_loader:
                inputs, targets = to_device(inputs, targets)
                correct += (net(inputs).argmax(-1) == targets).sum()
        scheduler.step()
        correct.item()  # one read per epoch, like the template's epoch-end metrics
    if device.type == "cuda":
        torch.cuda.synchronize()
    stamps.append(_common.stamp())
    return stamps


def run_lightning(cfg: Any, cpu: bool) -> list[tuple[float, float]]:
    """The module through a hand-written Lightning Trainer (loop_parity's plain Lightning arm)."""
    from runkit import speed

    device, precision, _ = choices(cfg, cpu)
    speed.apply_matmul_precision(cfg.matmul_precision, [] if cpu else [device.index])
    return loop_parity.run_plain(cfg, precision=precision, clock=synced_clock())


ARMS = {"template": run_template, "lightning": run_lightning, "plain": run_plain}


def step_flops(cfg: Any, cpu: bool) -> int:
    """FLOPs of one training step (forward + backward) of the workload's network and batch."""
    import torch
    import torch.nn.functional as F
    from hydra.utils import instantiate
    from torch.utils.flop_counter import FlopCounterMode

    device, precision, _ = choices(cfg, cpu)
    net = instantiate(cfg.model.net).to(device)
    inputs = torch.randn(cfg.data.batch_size, *cfg.data.shape, device=device)
    targets = torch.randint(0, 10, (cfg.data.batch_size,), device=device)
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=precision.startswith("bf16")
        ):
            loss = F.cross_entropy(net(inputs), targets)
        loss.backward()
    return int(counter.get_total_flops())


def peak_flops(name: str, precision: str, matmul: str, override: float | None) -> float | None:
    """The GPU's dense peak FLOP/s for the arithmetic the run uses, or None when unknown."""
    if override:
        return override * 1e12
    dtype = "bf16" if precision.startswith("bf16") else ("tf32" if matmul != "highest" else "fp32")
    for fragment, peaks in PEAK_TFLOPS:
        if fragment in name:
            return peaks[dtype] * 1e12
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="mlp,convnet")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4, help="per run; the first is warm-up")
    parser.add_argument(
        "--compile", action="store_true", help="callbacks.speed.compile=true, both arms"
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense peak")
    parser.add_argument("--allow-cpu", action="store_true", help="check the script on the CPU")
    args = parser.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if any(w not in WORKLOADS for w in workloads) or args.repeats < 1 or args.epochs < 2:
        parser.error(
            f"--workloads={args.workloads} --repeats={args.repeats} --epochs={args.epochs}: "
            f"workloads are {', '.join(WORKLOADS)}; repeats >= 1; epochs >= 2"
        )

    import torch

    cpu = not torch.cuda.is_available()
    if cpu and not args.allow_cpu:
        print("gpu_throughput: needs a CUDA GPU (none is visible here); nothing measured")
        return
    _common.quiet()
    table = CPU_WORKLOADS if cpu else WORKLOADS
    extra = ["callbacks.speed.compile=true"] if args.compile else []
    gpu = "CPU (script check only)" if cpu else torch.cuda.get_device_name()
    print(f"device: {gpu}; machine: {_common.machine_summary()}")
    with tempfile.TemporaryDirectory(prefix="gpu_throughput_") as tmp:
        for workload in workloads:
            batch = table[workload][2]
            arms = _common.Arms(list(ARMS))
            cfg = None
            for r, order in enumerate(_common.interleaved(args.repeats, list(ARMS))):
                for arm in order:
                    out = Path(tmp) / f"{workload}-{arm}-{r}"
                    cfg = compose(workload, args.epochs, out, cpu, extra)
                    stamps = run_template(cfg) if arm == "template" else ARMS[arm](cfg, cpu)
                    train_samples = _common.train_samples(cfg)
                    epochs = len(stamps) - 2
                    arms.add(arm, epochs * train_samples / (stamps[-1][0] - stamps[1][0]))
            assert cfg is not None
            _, precision, layout = choices(cfg, cpu)
            flops = step_flops(cfg, cpu)
            matmul = torch.get_float32_matmul_precision()
            peak = peak_flops(gpu, precision, matmul, args.peak_tflops)
            print(
                f"\n{workload}: batch {batch}, precision {precision}, float32 matmul {matmul}, "
                f"channels_last {layout}, compile {args.compile}; {args.repeats} repeats of "
                f"{args.epochs} epochs (first excluded)"
            )
            for other, label in (("lightning", "plain Lightning"), ("plain", "hand loop")):
                ratios = arms.ratios("template", other)
                print(_common.ratio_line(f"  {workload} / {label}, samples/s", ratios))
            for arm in ARMS:
                rate = arms.median(arm)
                achieved = flops / batch * rate
                mfu = f"{100 * achieved / peak:.1f} %" if peak else "n/a (unknown peak)"
                print(
                    f"  {arm:<9} {rate:12.0f} samples/s   {achieved / 1e12:8.2f} TFLOP/s   MFU {mfu}"
                )


if __name__ == "__main__":
    main()
