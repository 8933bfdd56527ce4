"""Resuming a run exactly in a new run directory: generators seeded from ``(seed, epoch)``,
the batches a mid-epoch checkpoint had trained on skipped, the earlier run's logs carried on."""

from __future__ import annotations

import csv
import logging
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import IterableDataset

from runkit import compat
from runkit.errors import RunError

log = logging.getLogger(__name__)


def run_dir_of(checkpoint: str | Path) -> Path:
    """The run directory of a checkpoint: the nearest folder with a ``.hydra`` or a config."""
    path = Path(checkpoint)
    for folder in list(path.parents)[:3]:
        if (folder / ".hydra").is_dir() or (
            (folder / "config.yaml").is_file() and (folder / "checkpoints").is_dir()
        ):
            return folder
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def epoch_seed(seed: int, epoch: int) -> int:
    return ((seed + 1) * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9) % (2**63)


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["random"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class ResumeState(Callback):
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.resumed_from: Path | None = None
        self._pending: dict[str, Any] | None = None  # generators' state to put back mid-epoch
        self._seeded_epoch: int | None = None

    def state_dict(self) -> dict[str, Any]:  # tensors and plain data: loads with weights_only
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        version, internal, gauss_next = random.getstate()
        rng: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
            "random": [version, list(internal), gauss_next],
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {"seed": self.seed, "rng": rng}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seed = int(state_dict.get("seed", self.seed))  # the resumed run's seed, not a new one
        self._pending = state_dict.get("rng")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.ckpt_path is not None:
            self.resumed_from = Path(trainer.ckpt_path)
            earlier = run_dir_of(self.resumed_from)
            if trainer.is_global_zero:
                log.info(
                    "Resuming from %s at epoch %d, step %d (the run in %s is left unchanged; "
                    "this run writes to %s)",
                    self.resumed_from,
                    trainer.current_epoch,
                    trainer.global_step,
                    earlier,
                    trainer.default_root_dir,
                )
                continue_logs(trainer, earlier)
        # Lightning made the first epoch's iterator before any hook: make it again after seeding,
        # drop the batches a mid-epoch checkpoint had trained on, put its generators' state back.
        self._seed_epoch(trainer)
        loop = trainer.fit_loop
        done = loop.epoch_loop.batch_progress.current.processed
        mid_epoch = loop.restarted_mid_epoch and 0 < done < trainer.num_training_batches
        loaders = _train_loaders(trainer)
        skip = done if mid_epoch and not any(_stateful(dl) for dl in loaders) else 0
        if trainer.ckpt_path is not None and trainer.is_global_zero:
            _say_what_differs(loaders, trainer.current_epoch, done if mid_epoch else 0)
        if skip:
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)  # the batches are skipped
        for loader in loaders:  # what Lightning does before it creates an epoch's iterator
            for sampler in {id(s): s for s in _parts(loader)[1::2] if s is not None}.values():
                if callable(getattr(sampler, "set_epoch", None)):
                    sampler.set_epoch(trainer.current_epoch)
        compat.restart_train_data(trainer, skip)
        if mid_epoch and self._pending is not None:
            set_rng_state(self._pending)
        self._pending = None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._seeded_epoch != trainer.current_epoch:
            self._seed_epoch(trainer)

    def _seed_epoch(self, trainer: Trainer) -> None:
        epoch = trainer.current_epoch
        seed = epoch_seed(self.seed, epoch)
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        for loader in _train_loaders(trainer):
            found = [
                getattr(part, "generator", None) for part in _parts(loader) if part is not None
            ]
            for generator in {id(g): g for g in found if isinstance(g, torch.Generator)}.values():
                generator.manual_seed(epoch_seed(self.seed + 1, epoch))
        self._seeded_epoch = epoch


_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


def _stateful(loader: Any) -> bool:
    return all(callable(getattr(loader, f, None)) for f in ("state_dict", "load_state_dict"))


def _train_loaders(trainer: Trainer) -> list[Any]:
    loaders = trainer.train_dataloader
    return [] if loaders is None else list(CombinedLoader(loaders).flattened)


def _parts(loader: Any) -> list[Any]:
    batches = getattr(loader, "batch_sampler", None)
    return [loader, getattr(loader, "sampler", None), batches, getattr(batches, "sampler", None)]


def _say_what_differs(loaders: list[Any], epoch: int, done: int) -> None:
    iterable = [dl for dl in loaders if isinstance(getattr(dl, "dataset", None), IterableDataset)]
    names = ", ".join(type(dl.dataset).__name__ for dl in iterable if not _stateful(dl))
    if names:
        log.warning(
            "Resuming epoch %d: the training data (%s) is an IterableDataset without "
            "state_dict/load_state_dict, so the epoch's stream starts again from its beginning "
            "(%sthe batches after that are the uninterrupted run's only if the stream depends on "
            "nothing but torch's global generator, which is seeded per epoch)",
            epoch,
            names,
            f"its first {done} batches are read again and dropped; " if done else "",
        )


def continue_logs(trainer: Trainer, earlier: Path) -> None:
    root = Path(trainer.default_root_dir)
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            writer = logger.experiment  # created now, so it cannot delete what it is given
            source = earlier / Path(writer.metrics_file_path).relative_to(root)
            if source.is_file():
                with source.open(newline="") as handle:
                    rows = list(csv.DictReader(handle))
                epoch, step = trainer.current_epoch, trainer.global_step
                for row in rows:
                    if _number(row, "epoch", epoch) < epoch or _number(row, "step") < step:
                        values = {k: v for k, v in row.items() if v and k != "step"}
                        writer.log_metrics(values, int(_number(row, "step")))
                writer.save()
        elif isinstance(logger, TensorBoardLogger):
            relative = Path(logger.log_dir).relative_to(root)
            for event_file in sorted((earlier / relative).glob("events.out.tfevents.*")):
                Path(logger.log_dir).mkdir(parents=True, exist_ok=True)
                shutil.copy2(event_file, Path(logger.log_dir) / f"earlier.{event_file.name}")


def _number(row: dict[str, str], key: str, missing: float = 0.0) -> float:
    try:
        return float(row.get(key) or missing)
    except ValueError:
        return missing


def check_fits(model: LightningModule, checkpoint: Path) -> None:
    """Fail in one line when the checkpoint's weights do not fit ``model`` (reads shapes only)."""
    from runkit.safety.checkpoints import (
        is_sharded_checkpoint,
        load_file,
        sharded_state,
        state_mismatch,
    )

    expected = model.state_dict()
    if is_sharded_checkpoint(checkpoint):  # trainer=fsdp: the shapes from its index
        state = sharded_state(checkpoint, load=False)
    else:
        state = load_file(checkpoint, mmap=True).get("state_dict")
    if not isinstance(state, dict):
        raise RunError(
            f"ckpt_path={str(checkpoint)!r} is not a Lightning checkpoint (no state_dict); "
            "to start from a model.pth, load it into the network instead of resuming"
        )
    mismatch = state_mismatch(expected, state, built_later=True)
    if mismatch:
        raise RunError(
            f"ckpt_path={str(checkpoint)!r} was trained with another model ({mismatch}); "
            "resume with the same model.* overrides as that run (see its config.yaml)"
        )
