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

Arm "plain Lightning": the same module, data module and seed (built from the same config nodes)
through the ``lightning.pytorch.Trainer`` a Lightning user writes by hand, with its defaults: the
TQDM progress bar, a ``ModelCheckpoint`` saving each epoch, the model summary, a CSV logger,
validation each epoch with the sanity check first. Its ratio to the template is the user's
question: is my module slower through the template than through the Trainer I would write?

Each run trains ``--epochs`` epochs; the first is warm-up (allocator, oneDNN kernels, the sanity
check) and excluded; the rest are timed from one epoch start to the next (the last one to the
end of training), so the timed window holds every step, the validation passes and the epoch-end
work of every arm. Each run is a process of its own, forked from the benchmark's (which trains
nothing), as a user's run is: the template's process-wide switches (``keep_freed_memory``)
reach no other arm. The runs of a repeat take turns on the machine every ``--slice-ms``
(:func:`_common.side_by_side`), timed by the seconds each held it: this machine's speed swings
by +-10 % from one 10 ms to the next and by +-50 % over seconds, and arms run one after the
other (``--one-at-a-time``) spread tiny's ratio by +-25 %; in turns, over a second or more of
timed epochs, by +-5-10 %. Printed is the median of the per-repeat ratios of throughput
(template / plain Lightning and template / hand: 1.0 is parity, 0.95 is a loop 5 % slower)
with the min and max, by wall clock and by the process's CPU time. A third line compares the
median training step alone (from one batch start to the next, the last batch of each epoch left
out): the per-step overhead, without the once-per-epoch work (validation set-up, logging,
checkpoints).

Lightning's floor (printed first): the same two loops with a trivial step (one scalar parameter,
no network), Lightning with no callback, logger, checkpoint, progress bar or model summary, on
the same data loaders with validation each epoch; a third arm adds as many empty callbacks as
the template runs with. What a Lightning loop costs over a plain one before any work of the
template's, per training step and per epoch, and what each callback costs just by being there.
Each size's lines then say how much of the template's gap that floor explains.

``--parts`` adds two arms per size: the template and plain Lightning run again with a timing
profiler (Lightning's ``Profiler`` interface, so every hook, step and save is timed), and prints
where their steady epochs go, part by part, in CPU milliseconds per epoch and per training step,
with what the template spends beyond plain Lightning in each part, beside the hand loop's own
parts; the profiler's own cost is printed too.

    python benchmarks/loop_parity.py                        # three sizes, a few minutes
    python benchmarks/loop_parity.py --sizes mid --repeats 9 --epochs 5
    python benchmarks/loop_parity.py --sizes tiny --parts   # where the time goes
    python benchmarks/loop_parity.py --template-overrides callbacks.progress_bar.refresh_rate=0
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from collections import defaultdict
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
# Wall-clock and CPU-time targets (median of the repeats) of issue 33: template / plain Lightning,
# and template / hand loop (tiny against the hand loop is reported, not targeted).
PLAIN_TARGETS = {"tiny": 1.0, "mid": 1.0}
HAND_TARGETS = {"mid": 0.95}

# Steady-epoch (wall, CPU) seconds of the hand loop's validation passes and saves, per run.
HAND_PARTS: dict[str, list[float]] = {}
# One dict per profiled run: part -> (wall s, CPU s) over its steady epochs, plus "_epochs".
PARTS: list[dict[str, Any]] = []
# (wall, CPU) seconds of each training step of the last floor run, batch start to batch start.
FLOOR_STEPS: list[tuple[float, float]] = []


# --same-allocator: every arm's process keeps freed memory, as the template's does by default.
SAME_ALLOCATOR = False


def _recorded(run: Any, *args: Any) -> tuple[Any, tuple]:
    """In a run's own process: ``run(*args)`` and the step times and parts it recorded. With
    :data:`SAME_ALLOCATOR` it keeps freed memory first."""
    if SAME_ALLOCATOR:
        from runkit.speed import keep_freed_memory

        keep_freed_memory(True)
    PARTS.clear()  # the runs clear the other records themselves; the profiler appends here
    return run(*args), (_common.STEP_TIMES, PARTS, HAND_PARTS, FLOOR_STEPS)


def _adopt(result: tuple[Any, tuple]) -> Any:
    """What :func:`_recorded` returned: the run's result, its records copied into this process's
    lists."""
    value, (steps, parts, hand_parts, floor_steps) = result
    _common.STEP_TIMES[:] = steps
    PARTS[:] = parts
    HAND_PARTS.clear()
    HAND_PARTS.update(hand_parts)
    FLOOR_STEPS[:] = floor_steps
    return value


def in_own_process(run: Any, *args: Any) -> Any:
    """``run(*args)`` in a child forked for it (:func:`_common.in_own_process`), its records
    copied back."""
    return _adopt(_common.in_own_process(_recorded, run, *args))


def compose(size: str, epochs: int, out: Path, extra: list[str]) -> Any:
    """The template's config for one run, as ``python -m project.train <overrides>`` composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from project import config_dir

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


def run_plain(
    cfg: Any, profiler: Any = None, precision: str = "32-true", clock: Any = None
) -> list[tuple[float, float]]:
    """Epoch-start stamps (and the end) of the module through a hand-written Lightning Trainer.

    Args:
        cfg: the template's composed config: its ``model``, ``data``, ``seed``,
            ``trainer.max_epochs``, ``trainer.accelerator`` and ``paths.output_dir``.
        profiler: a Lightning profiler (``--parts``), or None for Lightning's default.
        precision: the Trainer's ``precision`` (a GPU run passes the template's choice).
        clock: the callback appending to ``_common.EPOCH_STAMPS`` (default
            ``_common.epoch_clock()``; on a GPU one that synchronises first).
    """
    import lightning.pytorch as pl
    from hydra.utils import instantiate
    from lightning.pytorch.loggers import CSVLogger

    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    out = Path(cfg.paths.output_dir)
    trainer = pl.Trainer(
        accelerator=cfg.trainer.accelerator,
        devices=1,
        max_epochs=cfg.trainer.max_epochs,
        precision=precision,
        default_root_dir=out,
        logger=CSVLogger(out),
        callbacks=[clock or _common.epoch_clock()],
        profiler=profiler,
    )
    _common.EPOCH_STAMPS.clear()
    _common.STEP_TIMES.clear()
    trainer.fit(model, datamodule=datamodule)
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


def _add_part(name: str, start: tuple[float, float]) -> None:
    now = _common.stamp()
    wall, cpu = HAND_PARTS.setdefault(name, [0.0, 0.0])
    HAND_PARTS[name] = [wall + now[0] - start[0], cpu + now[1] - start[1]]


def run_hand(cfg: Any, save: str) -> list[tuple[float, float]]:
    """Epoch-start stamps (and the end) of the hand-written loop on the same config."""
    import torch
    import torch.nn.functional as F
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader

    from runkit.data import EpochShuffle, collate_rows

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
    HAND_PARTS.clear()
    for epoch in range(cfg.trainer.max_epochs):
        stamps.append(_common.stamp())
        sampler.set_epoch(epoch)
        net.train()
        loss_sum, correct, seen = torch.zeros(()), torch.zeros((), dtype=torch.long), 0
        batch_start = None
        for inputs, targets in train_loader:
            now = _common.clock()  # as the template's clock: after the batch is fetched
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
        validation_start = _common.stamp()
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
        save_start = _common.stamp()
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
        if epoch > 0:  # steady epochs only, as the ratios
            _add_part("validation", validation_start)
            _add_part("save", save_start)
    stamps.append(_common.stamp())
    return stamps


def steady_rate(stamps: list[tuple[float, float]], samples_per_epoch: int, clock: int) -> float:
    """Training samples per second over the epochs after the first (clock 0: wall, 1: CPU)."""
    epochs = len(stamps) - 2
    return epochs * samples_per_epoch / (stamps[-1][clock] - stamps[1][clock])


def steady_epoch_ms(stamps: list[tuple[float, float]], clock: int) -> float:
    """Milliseconds per epoch over the epochs after the first (clock 0: wall, 1: CPU)."""
    return 1000 * (stamps[-1][clock] - stamps[1][clock]) / (len(stamps) - 2)


# ------------------------------------------------------------------------- Lightning's floor


def _loaders(cfg: Any) -> tuple[Any, Any]:
    """The hand loop's training and validation loaders for the composed config's data."""
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader

    from runkit.data import EpochShuffle, collate_rows

    data = instantiate(cfg.data)
    data.setup("fit")
    sampler = EpochShuffle(data.train_set, seed=cfg.seed)
    return (
        DataLoader(
            data.train_set, batch_size=data.batch_size, sampler=sampler, collate_fn=collate_rows
        ),
        DataLoader(data.val_set, batch_size=data.batch_size, collate_fn=collate_rows),
    )


def _step_stamp(previous: tuple[float, float] | None) -> tuple[float, float]:
    """Now; appends the (wall, CPU) seconds since ``previous`` (the last batch start) to
    :data:`FLOOR_STEPS` (the floor's steps, timed by both clocks)."""
    now = _common.stamp()
    if previous is not None:
        FLOOR_STEPS.append((now[0] - previous[0], now[1] - previous[1]))
    return now


def run_floor_lightning(cfg: Any, callbacks: int) -> list[tuple[float, float]]:
    """A trivial step under a bare Lightning Trainer (plus ``callbacks`` empty callbacks)."""
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer

    class Trivial(LightningModule):
        """One scalar parameter; the clock lives in the module's own hooks, which Lightning
        calls whether or not they are overridden, so timing adds no dispatch."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(()))
            self.stamps: list[tuple[float, float]] = []
            self.batch_start: tuple[float, float] | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.weight.square()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            return None

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def on_train_epoch_start(self) -> None:
            self.stamps.append(_common.stamp())
            self.batch_start = None

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.batch_start = _step_stamp(self.batch_start)

        def on_train_end(self) -> None:
            self.stamps.append(_common.stamp())

    FLOOR_STEPS.clear()
    module = Trivial()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=cfg.trainer.max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Callback() for _ in range(callbacks)],
    )
    train_loader, val_loader = _loaders(cfg)
    trainer.fit(module, train_loader, val_loader)
    return module.stamps


def run_floor_plain(cfg: Any) -> list[tuple[float, float]]:
    """The same trivial step in a plain loop over the same loaders, validation pass included."""
    import torch

    FLOOR_STEPS.clear()
    weight = torch.nn.Parameter(torch.ones(()))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    train_loader, val_loader = _loaders(cfg)
    stamps = []
    for epoch in range(cfg.trainer.max_epochs):
        stamps.append(_common.stamp())
        train_loader.sampler.set_epoch(epoch)
        batch_start = None
        for _batch in train_loader:
            batch_start = _step_stamp(batch_start)
            optimizer.zero_grad()
            weight.square().backward()
            optimizer.step()
        with torch.inference_mode():
            for _batch in val_loader:
                pass
    stamps.append(_common.stamp())
    return stamps


def template_callbacks(cfg: Any) -> int:
    """How many callbacks the template's Trainer runs with (the benchmark's clock left out)."""
    return sum(
        1 for name, node in cfg.callbacks.items() if name != "epoch_clock" and "_target_" in node
    )


# ---------------------------------------------------------------------------- --parts profiler

# Hooks Lightning calls once per batch; every other callback hook runs once per epoch or less.
BATCH_HOOKS = {
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
}
TRAINING_STEP = "training steps: forward, loss, metrics, backward, optimizer, Lightning's closure"
VALIDATION_STEP = "validation steps: forward, metric updates"
DATA = "data: next batch from the loaders"
CHECKPOINT = "checkpoint: state, torch.save, fsync, rename (Trainer.save_checkpoint)"
MODULE_EPOCH_END = "module epoch end: metrics compute(), self.log, reset"
LIGHTNING_HOOKS = "Lightning: batch transfer, gradient clipping, other module/strategy hooks"
LIGHTNING_LOOP = "Lightning: loop code between hooks (logging, CSV, validation set-up)"


def part_of(action: str) -> str:
    """The part of the loop a Lightning profiler action belongs to."""
    if action in ("run_training_epoch", "run_training_batch"):
        return LIGHTNING_LOOP
    if action == "save_checkpoint":
        return CHECKPOINT
    if action.endswith("_next"):  # [_TrainingEpochLoop].train_dataloader_next, ...val_next
        return DATA
    kind, _, rest = action.partition("]")
    owner, _, hook = rest.rpartition(".")
    if kind == "[Callback":
        name = owner.split("{")[0]  # ModelCheckpoint{'monitor': ...}: its settings left out
        return f"callback {name}: " + ("batch hooks" if hook in BATCH_HOOKS else "epoch hooks")
    if hook in ("training_step", "backward", "optimizer_step", "optimizer_zero_grad"):
        return TRAINING_STEP
    if hook == "validation_step":
        return VALIDATION_STEP
    if hook in ("on_train_epoch_end", "on_validation_epoch_end"):
        return MODULE_EPOCH_END
    return LIGHTNING_HOOKS


def parts_profiler() -> Any:
    """A Lightning profiler that times every action of the steady epochs, exclusive of the
    actions nested in it, by part (:func:`part_of`); appends one dict to :data:`PARTS` per run.

    Given to the template through its config (``+trainer.profiler._target_=...``), like the
    epoch clock: the template's code carries no benchmark hook.
    """
    from lightning.pytorch.profilers import Profiler

    class PartsProfiler(Profiler):
        def __init__(self) -> None:
            super().__init__()
            self.epochs_started = 0
            self.active = False
            self.window: tuple[float, float] = (0.0, 0.0)
            self.totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
            self.stack: list[list[Any]] = []  # [action, wall, cpu, nested wall, nested cpu]
            self.parts: dict[str, str] = {}  # action -> part_of(action), computed once
            self.actions = 0  # timed in the steady epochs

        def start(self, action_name: str) -> None:
            if action_name == "run_training_epoch":
                self.epochs_started += 1
                if self.epochs_started == 2:  # the first epoch is warm-up, as in the ratios
                    self.active, self.window = True, _common.stamp()
            elif self.active and action_name.endswith(".on_train_end"):
                self.finish()
            if self.active:
                wall, cpu = _common.stamp()
                self.stack.append([action_name, wall, cpu, 0.0, 0.0])

        def stop(self, action_name: str) -> None:
            if not self.active or not self.stack or self.stack[-1][0] != action_name:
                return
            wall, cpu = _common.stamp()
            name, wall0, cpu0, nested_wall, nested_cpu = self.stack.pop()
            part = self.parts.get(name)
            if part is None:
                part = self.parts[name] = part_of(name)
            total = self.totals[part]
            self.actions += 1
            total[0] += wall - wall0 - nested_wall
            total[1] += cpu - cpu0 - nested_cpu
            if self.stack:
                self.stack[-1][3] += wall - wall0
                self.stack[-1][4] += cpu - cpu0
            else:
                self.outside[0] -= wall - wall0
                self.outside[1] -= cpu - cpu0

        def finish(self) -> None:
            wall, cpu = _common.stamp()
            self.active = False
            self.outside[0] += wall - self.window[0]
            self.outside[1] += cpu - self.window[1]
            parts = {name: tuple(value) for name, value in self.totals.items()}
            loop = parts.get(LIGHTNING_LOOP, (0.0, 0.0))
            parts[LIGHTNING_LOOP] = (loop[0] + self.outside[0], loop[1] + self.outside[1])
            PARTS.append({**parts, "_epochs": self.epochs_started - 1, "_actions": self.actions})

        @property
        def outside(self) -> list[float]:
            """Window time outside every action (the loops' own code between hooks)."""
            return self.totals["_outside"]

    return PartsProfiler()


def print_parts(
    steps: int, samples: dict[str, list[dict[str, Any]]], hand: dict[str, list[Any]]
) -> None:
    """Median CPU ms per steady epoch of each part in the template and in plain Lightning, what
    the template spends beyond plain Lightning there (per epoch and per training step), and the
    template's wall ms; the hand loop's parts below."""

    def median_ms(arm: str, name: str, clock: int) -> float:
        return statistics.median(
            1000 * s.get(name, (0.0, 0.0))[clock] / s["_epochs"] for s in samples[arm]
        )

    names = sorted(
        {
            name
            for arm in samples.values()
            for sample in arm
            for name in sample
            if not name.startswith("_")
        },
        key=lambda name: -abs(median_ms("template", name, 1) - median_ms("plain", name, 1)),
    )
    runs = f"{len(samples['template'])} + {len(samples['plain'])}"
    print(f"  where the steady epoch goes (CPU ms; {runs} profiled runs, medians), by the gap:")
    header = ("template", "plain", "beyond", "/step", "template wall")
    print(f"    {'part':<72} {header[0]:>9} {header[1]:>9} {header[2]:>9} {header[3]:>7} "
          f"{header[4]:>13}")  # fmt: skip
    totals = [0.0, 0.0, 0.0]
    for name in names:
        template, plain = median_ms("template", name, 1), median_ms("plain", name, 1)
        wall = median_ms("template", name, 0)
        totals = [totals[0] + template, totals[1] + plain, totals[2] + wall]
        beyond = template - plain
        print(f"    {name:<72} {template:9.2f} {plain:9.2f} {beyond:+9.2f} {beyond / steps:+7.3f} "
              f"{wall:13.2f}")  # fmt: skip
    beyond = totals[0] - totals[1]
    label = "sum (the profiled epoch)"
    print(f"    {label:<72} {totals[0]:9.2f} {totals[1]:9.2f} {beyond:+9.2f} {beyond / steps:+7.3f} "
          f"{totals[2]:13.2f}")  # fmt: skip
    for name, label in (
        ("steps", "training steps, data included"),
        ("validation", "validation pass, figures read, scheduler step"),
        ("save", "save"),
    ):
        wall = statistics.median(value[0] for value in hand[name])
        cpu = statistics.median(value[1] for value in hand[name])
        print(f"    {'hand loop: ' + label:<72} {cpu:9.2f} {'':>9} {'':>9} {'':>7} {wall:13.2f}")


def measure_floor(tmp: Path, epochs: int, repeats: int) -> dict[str, Any]:
    """Lightning's floor: bare Lightning, and with the template's number of empty callbacks,
    against the plain loop, all with the trivial step, interleaved; wall-clock medians."""
    if repeats == 0:
        return {}
    cfg = compose("tiny", epochs, tmp / "floor", [])
    callbacks = template_callbacks(cfg)
    arms = _common.Arms(["lightning", "callbacks", "plain"])
    for order in _common.interleaved(repeats, list(arms.names)):
        for arm in order:
            if arm == "plain":
                stamps = in_own_process(run_floor_plain, cfg)
            else:
                count = callbacks if arm == "callbacks" else 0
                stamps = in_own_process(run_floor_lightning, cfg, count)
            for clock, name in enumerate(("wall", "cpu")):
                arms.add(f"{arm}/epoch/{name}", steady_epoch_ms(stamps, clock))
                step = statistics.median(times[clock] for times in FLOOR_STEPS)
                arms.add(f"{arm}/step/{name}", 1000 * step)
    floor: dict[str, Any] = {
        "repeats": repeats,
        "steps": math.ceil(_common.train_samples(cfg) / cfg.data.batch_size),
        "callbacks": callbacks,
    }
    for name in ("wall", "cpu"):
        step = _differences(arms, f"lightning/step/{name}", f"plain/step/{name}")
        epoch = _differences(arms, f"lightning/epoch/{name}", f"plain/epoch/{name}")
        each = _differences(arms, f"callbacks/step/{name}", f"lightning/step/{name}")
        floor[name] = {
            "step": step,
            "epoch": epoch,
            "callback": [value / callbacks for value in each],
        }
    return floor


def _differences(arms: _common.Arms, first: str, second: str) -> list[float]:
    """Per-repeat differences (repeat i of one arm minus repeat i of the other)."""
    return [a - b for a, b in zip(arms.values[first], arms.values[second], strict=True)]


def print_floor(floor: dict[str, Any]) -> None:
    steps = floor["steps"]
    print(
        f"Lightning's floor ({floor['repeats']} repeats; a trivial step, no callback, logger, "
        "checkpoint or progress bar; validation each epoch), ms over the plain loop:"
    )
    for name, label in (("wall", "wall clock"), ("cpu", "process CPU time")):
        values = floor[name]
        step, epoch = statistics.median(values["step"]), statistics.median(values["epoch"])
        print(
            f"  {label + ':':<18} per training step {_spread_ms(values['step'], 3)}, per epoch "
            f"{_spread_ms(values['epoch'], 2)} ({epoch - steps * step:+.2f} beyond its {steps} "
            f"steps), per empty callback per step {_spread_ms(values['callback'], 3)}"
        )
    print(f"  (the template runs {floor['callbacks']} callbacks)")


def _spread_ms(values: list[float], digits: int) -> str:
    low, high = _common.spread(values)
    return f"{statistics.median(values):+.{digits}f} [{low:+.{digits}f} .. {high:+.{digits}f}]"


ARMS = ("template", "plain", "hand")
PROFILED = {"parts": "template", "plain_parts": "plain"}  # profiled arm -> the arm it profiles


def run_plain_profiled(cfg: Any) -> list[tuple[float, float]]:
    """:func:`run_plain` under the parts profiler (``--parts``)."""
    return run_plain(cfg, parts_profiler())


def measure_size(
    size: str, repeats: int, epochs: int, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """The template, plain Lightning and hand runs of one size (and, with --parts, the profiled
    template's and plain Lightning's), side by side in each repeat."""
    names = list(ARMS) + (list(PROFILED) if args.parts else [])
    arms = _common.Arms(names)
    parts: dict[str, list[dict[str, Any]]] = {"template": [], "plain": []}
    hand_parts: dict[str, list[Any]] = defaultdict(list)
    for r, order in enumerate(_common.interleaved(repeats, names)):
        runs, configs = [], []
        for arm in order:
            out = tmp / f"{size}-{arm}-{r}"
            extra = list(args.template_overrides) if arm in ("template", "parts") else []
            if arm == "parts":
                extra.append(f"+trainer.profiler._target_={__name__}.parts_profiler")
            cfg = compose(size, epochs, out, extra)
            configs.append(cfg)
            if arm == "hand":
                runs.append((_recorded, (run_hand, cfg, args.hand_save)))
            elif arm == "plain_parts":
                runs.append((_recorded, (run_plain_profiled, cfg)))
            elif arm == "plain":
                runs.append((_recorded, (run_plain, cfg)))
            else:
                runs.append((_recorded, (run_template, cfg)))
        if args.one_at_a_time:
            results = [_common.in_own_process(fn, *fn_args) for fn, fn_args in runs]
        else:
            results = _common.side_by_side(runs, args.slice_ms / 1000)
        if r == 0:  # the same data in every arm and repeat
            samples = _common.train_samples(configs[0])
        for arm, result in zip(order, results, strict=True):
            stamps = _adopt(result)
            if arm == "hand":
                timed = len(stamps) - 2  # epochs after the warm-up
                for name, (wall, cpu) in HAND_PARTS.items():
                    hand_parts[name].append((1000 * wall / timed, 1000 * cpu / timed))
                hand_parts["steps"].append(
                    tuple(
                        steady_epoch_ms(stamps, clock)
                        - hand_parts["validation"][-1][clock]
                        - hand_parts["save"][-1][clock]
                        for clock in (0, 1)
                    )
                )
            if arm in PROFILED:
                parts[PROFILED[arm]] += PARTS
            arms.add(f"{arm}/wall", steady_rate(stamps, samples, 0))
            arms.add(f"{arm}/cpu", steady_rate(stamps, samples, 1))
            arms.add(f"{arm}/epoch_wall", steady_epoch_ms(stamps, 0))
            arms.add(f"{arm}/epoch_cpu", steady_epoch_ms(stamps, 1))
            # Steps per second from the median step: robust to a busy machine's spikes.
            arms.add(f"{arm}/step", 1.0 / statistics.median(_common.STEP_TIMES))
    cfg = configs[0]
    steps = math.ceil(samples / cfg.data.batch_size)
    return {
        "size": size,
        "steps": steps,
        "ratios": {
            (first, second, clock): arms.ratios(f"{first}/{clock}", f"{second}/{clock}")
            for first, second in (("template", "plain"), ("template", "hand"), ("plain", "hand"))
            for clock in ("wall", "cpu", "step")
        },
        "step_ms": 1000 * 64 / arms.median("hand/wall"),
        "epoch": {name: arms.values[name] for name in arms.values if "/epoch" in name},
        "parts": parts,
        "hand_parts": dict(hand_parts),
    }


ARM_LABELS = {"template": "template", "plain": "plain Lightning", "hand": "hand loop"}
CLOCK_LABELS = {"wall": "wall clock", "cpu": "CPU time", "step": "median training step only"}


def print_size(result: dict[str, Any], floor: dict[str, Any]) -> list[tuple[str, bool]]:
    """The size's ratio lines, the floor's share of its gap and (--parts) where its time goes;
    returns (verdict label, met) for each target."""
    size, epoch = result["size"], result["epoch"]
    repeats = len(result["ratios"]["template", "plain", "wall"])
    print(
        f"{size}: {SIZES[size][1]}, ~{result['step_ms']:.1f} ms per batch of 64, {repeats} repeats"
    )
    verdicts = []
    for (first, second, clock), ratios in result["ratios"].items():
        targets = (
            {"plain": PLAIN_TARGETS, "hand": HAND_TARGETS}[second] if first == "template" else {}
        )
        target = targets.get(size) if clock != "step" else None
        label = f"  {size} / {ARM_LABELS[second]}, {CLOCK_LABELS[clock]}"
        if first != "template":
            label = f"  {size} {ARM_LABELS[first]} / {ARM_LABELS[second]}, {CLOCK_LABELS[clock]}"
        print(_common.ratio_line(label, ratios, target))
        if target is not None:
            verdicts.append((label.strip(), target, statistics.median(ratios) >= target))
    for name, label in (("wall", "wall clock"), ("cpu", "CPU time")):
        hand = statistics.median(epoch[f"hand/epoch_{name}"])
        plain = statistics.median(epoch[f"plain/epoch_{name}"])
        template = statistics.median(epoch[f"template/epoch_{name}"])
        gap = template - hand
        line = (
            f"  epoch, {label}: hand {hand:.1f} ms, plain Lightning {plain:.1f} ms, template "
            f"{template:.1f} ms: {gap:+.1f} ms over the hand loop ({gap / result['steps']:+.3f} a "
            f"step), {template - plain:+.1f} ms over plain Lightning "
            f"({(template - plain) / result['steps']:+.3f} a step)"
        )
        if floor:
            lightning = statistics.median(floor[name]["epoch"]) * result["steps"] / floor["steps"]
            own = gap - lightning
            line += (
                f"; Lightning's floor {lightning:+.1f} (at best {hand / (hand + lightning):.3f}), "
                f"the template's own {own:+.1f} ({own / result['steps']:+.3f} a step)"
            )
        print(line)
    if result["parts"]["template"]:
        print_parts(result["steps"], result["parts"], result["hand_parts"])
        hand_cpu = statistics.median(epoch["hand/epoch_cpu"])
        for arm, profiled_arm in (("template", "parts"), ("plain", "plain_parts")):
            profiled = statistics.median(epoch[f"{profiled_arm}/epoch_cpu"])
            unprofiled = statistics.median(epoch[f"{arm}/epoch_cpu"])
            samples = result["parts"][arm]
            actions = statistics.median(p["_actions"] / p["_epochs"] for p in samples)
            print(
                f"    (the profiler itself in {ARM_LABELS[arm]}, {actions / result['steps']:.0f} "
                f"actions a step: {profiled - unprofiled:+.1f} ms CPU an epoch, profiled "
                f"{profiled:.1f} against {unprofiled:.1f}; hand loop {hand_cpu:.1f})"
            )
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", default="tiny,mid,large", help="comma separated: " + ",".join(SIZES)
    )
    parser.add_argument("--repeats", type=int, default=0, help="per size (default: 6, 6, 4)")
    parser.add_argument(
        "--epochs",
        type=int,
        default=0,
        help="per run, the first warm-up (default: tiny 21, mid 3, large 3: a second or more "
        "measured, which a repeat's turns need to average this machine's fast swings)",
    )
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
    parser.add_argument(
        "--parts", action="store_true", help="also profile the template: where its epochs go"
    )
    parser.add_argument(
        "--same-allocator",
        action="store_true",
        help="keep freed memory in every arm's process, not only the template's: the loops "
        "alone, without the template's keep_freed_memory",
    )
    parser.add_argument(
        "--floor-repeats", type=int, default=6, help="repeats of Lightning's floor (0: skip it)"
    )
    parser.add_argument(
        "--slice-ms",
        type=float,
        default=20.0,
        help="each arm's turn on the machine (ms): the arms of a repeat run side by side",
    )
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="run the arms of a repeat one after the other instead (the design before issue 33)",
    )
    args = parser.parse_args()
    global SAME_ALLOCATOR
    SAME_ALLOCATOR = args.same_allocator
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if (
        unknown
        or args.epochs == 1
        or args.epochs < 0
        or args.repeats < 0
        or args.floor_repeats < 0
        or not 1 <= args.slice_ms <= 1000
    ):
        parser.error(
            f"--sizes={args.sizes} --epochs={args.epochs} --repeats={args.repeats} "
            f"--floor-repeats={args.floor_repeats} --slice-ms={args.slice_ms:g}: sizes are "
            f"{', '.join(SIZES)}; epochs >= 2 (the first is warm-up); repeats >= 1; floor "
            "repeats >= 0; slice-ms 1 to 1000"
        )

    import torch

    _common.quiet()
    torch.set_num_threads(args.threads)
    default_repeats = {"tiny": 6, "mid": 6, "large": 4}
    default_epochs = {"tiny": 21, "mid": 3, "large": 3}
    with tempfile.TemporaryDirectory(prefix="loop_parity_") as tmp:
        floor = measure_floor(Path(tmp), args.epochs or 3, args.floor_repeats)
        table = []
        for size in sizes:
            repeats = args.repeats or default_repeats[size]
            epochs = args.epochs or default_epochs[size]
            table.append(measure_size(size, repeats, epochs, args, Path(tmp)))

    print(
        "\nloop parity: template / plain Lightning and / hand-written, training samples per "
        "second (1.0 = parity)"
    )
    print(f"machine: {_common.machine_summary()}; torch threads {args.threads}")
    print(
        f"{args.epochs or 'tiny 21, mid 3, large 3'} epochs per run, the first excluded; arms "
        + ("one at a time" if args.one_at_a_time else f"side by side in {args.slice_ms:g} ms turns")
        + "; hand-written loop saves: "
        f"{args.hand_save}"
        + ("; every arm keeps freed memory" if args.same_allocator else "")
        + (
            f"; template overrides: {' '.join(args.template_overrides)}"
            if args.template_overrides
            else ""
        )
    )
    if floor:
        print_floor(floor)
    print(f"{'size (hand step time)':<34} {'median':>7}   [min .. max]")
    verdicts = []
    for result in table:
        verdicts += print_size(result, floor)
    for label, target, met in verdicts:
        print(
            f"target ({label}): >= {target:g} -> "
            + ("met" if met else "NOT met (see the spread; rerun on a quiet machine)")
        )


if __name__ == "__main__":
    main()
