"""last.ckpt follows every save point, is written once per save point; resumes relocate."""

from __future__ import annotations

import errno
import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint

from conftest import CliRunner, run_dirs
from tinyapp.data import DigitsDataModule
from tinyapp.models import MLP, ClassifierModule
from runkit.safety.checkpoints import AtomicCheckpointIO
from runkit.safety.model_checkpoint import ModelCheckpoint


def fit(
    dirpath: Path,
    epochs: int = 2,
    batches: int = 3,
    callback_class: type = ModelCheckpoint,
    ckpt_path: Any = None,
    extra: tuple[pl.Callback, ...] = (),
    **args: Any,
) -> tuple[pl.Trainer, LightningModelCheckpoint]:
    pl.seed_everything(0)
    checkpoint = callback_class(dirpath=dirpath, save_last=True, **args)
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", logger=False, callbacks=[checkpoint, *extra],
        plugins=[AtomicCheckpointIO()], limit_train_batches=batches, limit_val_batches=batches - 1,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = ClassifierModule(MLP(hidden=(16,)), partial(torch.optim.SGD, lr=0.1))
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=32), ckpt_path=ckpt_path)
    return trainer, checkpoint


# "max" of a falling val/loss: the best is epoch 0, nothing improves after it.
NOT_IMPROVING = {"monitor": "val/loss", "mode": "max"}


def test_lightnings_own_last_ckpt_lags_behind(tmp_path: Path) -> None:
    fit(tmp_path, 2, callback_class=LightningModelCheckpoint, save_top_k=1, **NOT_IMPROVING)
    epoch = torch.load(tmp_path / "last.ckpt", weights_only=True)["epoch"]
    assert epoch == 0, "Lightning now keeps last.ckpt current: drop runkit.safety.model_checkpoint"


@pytest.mark.parametrize("save_top_k", [0, 1])
def test_last_ckpt_follows_each_save_point_during_the_run(tmp_path: Path, save_top_k: int) -> None:
    seen: list[int | None] = []

    class Spy(pl.Callback):
        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            last = tmp_path / "last.ckpt"
            seen.append(torch.load(last, weights_only=True)["epoch"] if last.exists() else None)

    fit(tmp_path, 3, 2, extra=(Spy(),), save_top_k=save_top_k, **NOT_IMPROVING)
    assert seen == [None, 0, 1]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["epoch"] == 2  # the final epoch


@pytest.mark.parametrize(
    "args",
    [
        {"monitor": None, "every_n_epochs": 2},
        {"monitor": "val/loss", "save_top_k": 2},
        {"monitor": None, "every_n_train_steps": 2, "save_top_k": -1},
        {"monitor": "val/acc", "mode": "max", "save_on_train_epoch_end": True},
    ],
)
def test_the_files_after_fit_are_lightnings_own(tmp_path: Path, args: dict[str, Any]) -> None:
    for callback_class in (ModelCheckpoint, LightningModelCheckpoint):
        fit(tmp_path / callback_class.__module__, 3, 2, callback_class=callback_class, **args)
    ours, theirs = (sorted(p.name for p in d.iterdir()) for d in sorted(tmp_path.iterdir()))
    assert ours == theirs and "last.ckpt" in ours


def counted_saves(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    saves: list[str] = []
    real_save = torch.save

    def counting_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        saves.append(str(getattr(f, "name", f)))
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counting_save)
    return saves


@pytest.mark.parametrize("links", [True, False])
def test_best_and_last_at_one_step_are_serialised_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: bool
) -> None:
    if not links:
        monkeypatch.setattr(
            os, "link", Mock(side_effect=PermissionError(errno.EPERM, "Operation not permitted"))
        )
    saves = counted_saves(monkeypatch)
    _, checkpoint = fit(tmp_path, 2, 2, monitor=None, save_top_k=-1 if links else 1)
    assert len(saves) == 2, saves  # one per save point
    best, last = Path(checkpoint.best_model_path), tmp_path / "last.ckpt"
    assert best.name == "epoch=1-step=4.ckpt"
    assert (last.stat().st_ino == best.stat().st_ino) == links  # a hard link: one copy on disk
    assert last.read_bytes() == best.read_bytes()
    assert torch.load(last, weights_only=True)["epoch"] == 1
    kept = {best.name, last.name} | ({"epoch=0-step=2.ckpt"} if links else set())
    assert {p.name for p in tmp_path.iterdir()} == kept
    if links:
        # A file that is also last.ckpt names last.ckpt as the last checkpoint, as Lightning's does.
        first = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)
        (state,) = [v for k, v in first["callbacks"].items() if k.startswith("ModelCheckpoint")]
        assert state["last_model_path"] == str(last)


BEST = {"monitor": "val/acc", "mode": "max", "save_top_k": 1}


@pytest.mark.slow
def test_a_moved_finished_run_resumes_with_its_best_checkpoint_its_own(tmp_path: Path) -> None:
    _, first = fit(tmp_path / "run a" / "checkpoints", **BEST)
    best_name, best_score = Path(first.best_model_path).name, first.best_model_score
    moved = tmp_path / "elsewhere" / "run é"
    moved.parent.mkdir()
    shutil.move(tmp_path / "run a", moved)

    own = tmp_path / "run b" / "checkpoints"
    trainer, resumed = fit(own, ckpt_path=moved / "checkpoints" / "last.ckpt", **BEST)
    best = Path(resumed.best_model_path)
    assert best == own / best_name and best.is_file()  # its own directory, not the old path
    assert best.read_bytes() == (moved / "checkpoints" / best_name).read_bytes()
    assert resumed.best_model_score == best_score
    trainer.test(ckpt_path=str(best), datamodule=DigitsDataModule(batch_size=32))
    assert resumed.best_model_path == str(best)  # test's restore does not point elsewhere

    # Lightning alone: the moved run's old absolute path, which no longer exists.
    last = moved / "checkpoints" / "last.ckpt"
    _, plain = fit(
        tmp_path / "run c", callback_class=LightningModelCheckpoint, ckpt_path=last, **BEST
    )
    assert not Path(plain.best_model_path).exists()


@pytest.mark.slow
def test_the_setting_a_module_that_logs_nothing_is_told_to_use_trains_it(
    cli: CliRunner, log_dir: Path
) -> None:
    # the refusal that names this setting: test_bad_inputs' monitor-of-a-module-that-logs-nothing
    boring = "lightning.pytorch.demos.boring_classes"
    done = cli(
        "train", "~model", f"+model._target_={boring}.BoringModel", "~data",
        f"+data._target_={boring}.BoringDataModule", "trainer.max_epochs=1",
        "callbacks.progress_bar.refresh_rate=0", "callbacks.model_checkpoint.monitor=null",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = run_dirs(log_dir)
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "model.pth").is_file()
