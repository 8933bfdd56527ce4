"""Is the template's training loop as fast as a hand-written PyTorch loop? Ratios, side by side.

Arm "template": the run ``python -m project.train`` makes, built from the real configs (Hydra
compose of ``train.yaml``) and started through :func:`project.train.train` itself, so everything
the default loop carries is on: the LightningModule with its torchmetrics, the CSV logger, the
Rich progress bar, ModelCheckpoint (best + last, crash-safe writes), the model summary, the GPU
statistics callback, the resume and interrupt callbacks, the sanity validation.

Arm "hand": what a careful PyTorch user writes for the same job, on the same data in the same
order (the template's split, batch size and per-epoch shuffle), with the same network, optimiser
(AdamW) and scheduler (cosine, stepped per epoch), each built from the same config nodes:
per batch ``zero_grad``, forward, cross-entropy, backward, ``step``, and a running loss and
accuracy kept on the device; per epoch a validation pass under ``torch.inference_mode`` (loss
and accuracy), one read of the figures, the scheduler step, and ``torch.save`` of the network,
optimiser and scheduler state (``--hand-save none`` leaves the save out; ``--hand-save full``
adds what the template's epoch end also does: a CSV row of the figures, and the best and last
states written crash-safely, to a temporary file, fsync, rename).

Each run trains ``--epochs`` epochs; the first is warm-up (allocator, oneDNN kernels, the sanity
check) and excluded; the rest are timed from one epoch start to the next (the last one to the
end of training), so the timed window holds every step, the validation passes and the epoch-end
work of both arms. Arms alternate (template, hand, hand, template, ...) over ``--repeats``;
printed is the median of the per-repeat ratios of throughput (template / hand: 1.0 is parity,
0.95 is a loop 5 % slower) with the min and max, by wall clock and by the process's CPU time
(steadier on a shared machine). A third line compares the median training step alone (from
one batch start to the next, the last batch of each epoch left out): the per-step overhead,
without the once-per-epoch work (validation set-up, logging, checkpoints).

    python benchmarks/loop_parity.py                        # three sizes, about two minutes
    python benchmarks/loop_parity.py --sizes mid --repeats 9 --epochs 5
    python benchmarks/loop_parity.py --template-overrides callbacks.progress_bar.refresh_rate=0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

# name -> (overrides, what it is). "mid" is the template's default network.
SIZES: dict[str, tuple[list[str], str]] = {
    "tiny": (["model.net.channels=[8,16]"], "ConvNet (8,16), 1.4 k params"),
    "mid": ([], "ConvNet (32,64,128), the default, 94 k params"),
    "large": (["model.net.channels=[64,128,256]"], "ConvNet (64,128,256), 372 k params"),
}


def compose(size: str, epochs: int, out: Path, extra: list[str]) -> Any:
    """The template's config for one run, as ``python -m project.train <overrides>`` composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from project.machinery.run.cli import config_dir

    overrides = [
        *SIZES[size][0],
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        f"trainer.max_epochs={epochs}",
        f"paths.output_dir={out}",
        "test=false",  # after fit: not part of the loop
        "export_weights=false",
        "+callbacks.epoch_clock._target_=_common.epoch_clock",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def run_template(cfg: Any) -> list[tuple[float, float]]:
    """Epoch-start stamps (and the end) of one real template run."""
    from project.train import train

    _common.EPOCH_STAMPS.clear()
    _common.STEP_TIMES.clear()
    train(cfg)
    return list(_common.EPOCH_STAMPS)


def _durable_save(state: dict[str, Any], path: Path) -> None:
    """torch.save to a temporary file, fsync, rename: what a crash-safe hand-written loop does."""
    import torch

    partial = path.with_suffix(".partial")
    with open(partial, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def run_hand(cfg: Any, save: str) -> list[tuple[float, float]]:
    """Epoch-start stamps (and the end) of the hand-written loop on the same config."""
    import torch
    import torch.nn.functional as F
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader

    from project.data.arrays import EpochShuffle, collate_rows

    torch.manual_seed(cfg.seed)
    data = instantiate(cfg.data)
    data.setup("fit")
    net = instantiate(cfg.model.net)
    optimizer = instantiate(cfg.model.optimizer)(params=net.parameters())
    scheduler = instantiate(cfg.model.scheduler)(optimizer=optimizer)
    sampler = EpochShuffle(data.train_set, seed=cfg.seed)
    train_loader = DataLoader(
        data.train_set, batch_size=data.batch_size, sampler=sampler, collate_fn=collate_rows
    )
    val_loader = DataLoader(data.val_set, batch_size=data.batch_size, collate_fn=collate_rows)
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    history = []
    stamps = []
    _common.STEP_TIMES.clear()
    for epoch in range(cfg.trainer.max_epochs):
        stamps.append(_common.stamp())
        sampler.set_epoch(epoch)
        net.train()
        loss_sum, correct, seen = torch.zeros(()), torch.zeros((), dtype=torch.long), 0
        batch_start = None
        for inputs, targets in train_loader:
            now = time.perf_counter()  # as the template's clock: after the batch is fetched
            if batch_start is not None:
                _common.STEP_TIMES.append(now - batch_start)
            batch_start = now
            optimizer.zero_grad()
            logits = net(inputs)
            loss = F.cross_entropy(logits, targets)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * targets.numel()
            correct += (logits.detach().argmax(-1) == targets).sum()
            seen += targets.numel()
        net.eval()
        val_loss, val_correct, val_seen = torch.zeros(()), torch.zeros((), dtype=torch.long), 0
        with torch.inference_mode():
            for inputs, targets in val_loader:
                logits = net(inputs)
                val_loss += F.cross_entropy(logits, targets, reduction="sum")
                val_correct += (logits.argmax(-1) == targets).sum()
                val_seen += targets.numel()
        scheduler.step()
        history.append(
            (
                (loss_sum / seen).item(),
                (correct / seen).item(),
                (val_loss / val_seen).item(),
                (val_correct / val_seen).item(),
            )
        )
        state = {
            "net": net.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
        }
        if save == "last":
            torch.save(state, out / "last.pt")
        elif save == "full":  # the template's features: a CSV row, best and last, crash-safe
            with open(out / "metrics.csv", "a") as handle:
                handle.write(",".join(f"{v:.6f}" for v in history[-1]) + "\n")
            if history[-1][3] >= max(h[3] for h in history):
                _durable_save(state, out / "best.pt")
            _durable_save(state, out / "last.pt")
    stamps.append(_common.stamp())
    return stamps


def steady_rate(stamps: list[tuple[float, float]], samples_per_epoch: int, clock: int) -> float:
    """Training samples per second over the epochs after the first (clock 0: wall, 1: CPU)."""
    epochs = len(stamps) - 2
    return epochs * samples_per_epoch / (stamps[-1][clock] - stamps[1][clock])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", default="tiny,mid,large", help="comma separated: " + ",".join(SIZES)
    )
    parser.add_argument("--repeats", type=int, default=0, help="per size (default: 6, 6, 4)")
    parser.add_argument("--epochs", type=int, default=3, help="per run; the first is warm-up")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: less noise)")
    parser.add_argument(
        "--hand-save",
        choices=("last", "full", "none"),
        default="last",
        help="per epoch: torch.save of the last state; full: also a CSV row and the best state, "
        "both written crash-safely (fsync) as the template does; none: nothing",
    )
    parser.add_argument(
        "--template-overrides", nargs="*", default=[], help="extra overrides, template arm only"
    )
    args = parser.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or args.epochs < 2 or args.repeats < 0:
        parser.error(
            f"--sizes={args.sizes} --epochs={args.epochs} --repeats={args.repeats}: sizes are "
            f"{', '.join(SIZES)}; epochs >= 2 (the first is warm-up); repeats >= 1"
        )

    import torch

    _common.quiet()
    torch.set_num_threads(args.threads)
    default_repeats = {"tiny": 6, "mid": 6, "large": 4}
    table: list[tuple[str, list[float], list[float], list[float], float]] = []
    with tempfile.TemporaryDirectory(prefix="loop_parity_") as tmp:
        for size in sizes:
            repeats = args.repeats or default_repeats[size]
            arms = _common.Arms(["template", "hand"])
            for r, order in enumerate(_common.interleaved(repeats, ["template", "hand"])):
                for arm in order:
                    out = Path(tmp) / f"{size}-{arm}-{r}"
                    extra = args.template_overrides if arm == "template" else []
                    cfg = compose(size, args.epochs, out, extra)
                    if arm == "template":
                        stamps = run_template(cfg)
                    else:
                        stamps = run_hand(cfg, save=args.hand_save)
                    samples = _common.train_samples(cfg)
                    arms.add(f"{arm}/wall", steady_rate(stamps, samples, 0))
                    arms.add(f"{arm}/cpu", steady_rate(stamps, samples, 1))
                    # Steps per second from the median step: robust to a busy machine's spikes.
                    arms.add(f"{arm}/step", 1.0 / statistics.median(_common.STEP_TIMES))
            step_ms = 1000 * 64 / arms.median("hand/wall")
            table.append(
                (
                    size,
                    arms.ratios("template/wall", "hand/wall"),
                    arms.ratios("template/cpu", "hand/cpu"),
                    arms.ratios("template/step", "hand/step"),
                    step_ms,
                )
            )

    print("\nloop parity: template / hand-written, training samples per second (1.0 = parity)")
    print(f"machine: {_common.machine_summary()}; torch threads {args.threads}")
    print(
        f"{args.epochs} epochs per run, the first excluded; hand-written loop saves: "
        f"{args.hand_save}"
        + (
            f"; template overrides: {' '.join(args.template_overrides)}"
            if args.template_overrides
            else ""
        )
    )
    print(f"{'size (hand step time)':<34} {'median':>7}   [min .. max]")
    verdict = None
    for size, wall, cpu, step, step_ms in table:
        target = 0.95 if size == "mid" else None
        print(f"{size}: {SIZES[size][1]}, ~{step_ms:.1f} ms per batch of 64, {len(wall)} repeats")
        print(_common.ratio_line("  wall clock", wall, target))
        print(_common.ratio_line("  process CPU time", cpu, target))
        print(_common.ratio_line("  median training step only", step))
        if size == "mid":
            verdict = statistics.median(wall) >= 0.95 or statistics.median(cpu) >= 0.95
    if verdict is not None:
        print(
            "target (mid, wall or CPU time): >= 0.95 -> "
            + ("met" if verdict else "NOT met (see the spread; rerun on a quiet machine)")
        )


if __name__ == "__main__":
    main()
