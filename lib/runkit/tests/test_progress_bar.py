"""The progress bar reads the logged values once per redraw, and always at the end of an epoch."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar as LightningRichProgressBar
from torch.utils.data import DataLoader, TensorDataset

from runkit.run import progress_bar
from runkit.run.progress_bar import RichProgressBar

BATCHES = 6  # training batches per epoch
EPOCHS = 2


class LogsEveryStep(LightningModule):
    """Logs a value to the progress bar at every training step (Lightning reads it per batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.log("step_value", float(self.global_step), prog_bar=True)
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_value", 1.0, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def reads_during_fit(bar: LightningRichProgressBar, tmp_path: Path) -> list[dict[str, Any]]:
    """Every set of logged values the bar read (``trainer.progress_bar_metrics``: an ``.item()``
    each, a device sync on a GPU) during a short fit, in order."""
    reads: list[dict[str, Any]] = []

    class Counting(Trainer):
        @property
        def progress_bar_metrics(self) -> dict[str, Any]:
            values = super().progress_bar_metrics
            reads.append({key: float(value) for key, value in values.items()})
            return values

    data = DataLoader(TensorDataset(torch.randn(BATCHES * 4, 2)), batch_size=4)
    trainer = Counting(
        accelerator="cpu",
        max_epochs=EPOCHS,
        callbacks=[bar],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        default_root_dir=tmp_path,
    )
    trainer.fit(LogsEveryStep(), data, data)
    return reads


@pytest.fixture(scope="module")
def lightning_reads(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return reads_during_fit(LightningRichProgressBar(), tmp_path_factory.mktemp("lightning"))


def test_batches_read_at_most_once_per_redraw_epochs_always(
    lightning_reads: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress_bar, "time", SimpleNamespace(monotonic=lambda: 1000.0))
    reads = reads_during_fit(RichProgressBar(refresh_rate=1), tmp_path)
    # The clock stands still: one redraw interval never passes, so only the first batch reads;
    # every epoch end and validation end still does.
    assert len(lightning_reads) - len(reads) == EPOCHS * BATCHES - 1
    assert reads[-1] == lightning_reads[-1]  # the values shown at the end are the final ones
    assert reads[-1]["step_value"] == EPOCHS * BATCHES - 1


def test_every_batch_reads_when_a_redraw_is_due(
    lightning_reads: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticks = iter(range(0, 10_000, 2))  # two seconds a call: every batch is past the interval
    monkeypatch.setattr(progress_bar, "time", SimpleNamespace(monotonic=lambda: next(ticks)))
    reads = reads_during_fit(RichProgressBar(refresh_rate=1), tmp_path)
    assert reads == lightning_reads


class CountAtEpochEnd(RichProgressBar):
    """Notes the training bar's count once each epoch is over."""

    counts: list[float]

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self.counts.append(self.progress.tasks[self.train_progress_bar_id].completed)


def test_batches_between_redraws_leave_the_bar_alone_but_each_epoch_ends_on_its_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress_bar, "time", SimpleNamespace(monotonic=lambda: 1000.0))
    bar = CountAtEpochEnd(refresh_rate=1)
    bar.counts = []
    updates = []
    update = LightningRichProgressBar._update

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        updates.append(args)
        update(self, *args, **kwargs)

    monkeypatch.setattr(LightningRichProgressBar, "_update", counting)
    reads_during_fit(bar, tmp_path)
    assert bar.counts == [BATCHES] * EPOCHS
    # per epoch: the first batch and the last (the rate's two ends), nothing in between
    trained = [a for a in updates if a and a[0] == bar.train_progress_bar_id]
    assert [a[1] for a in trained] == [1, BATCHES] * EPOCHS


class SlowSteps(LogsEveryStep):
    """Steps of a few milliseconds: the rate is the steps', not the loop's overhead."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(0.004)
        return super().training_step(batch, batch_idx)


class ShownRate(Callback):
    """Per epoch: the rate the training bar shows (its speed column, rendered) and the batches
    per second the loop actually ran, by this process's clock, from the epoch's start to its
    last batch's end."""

    def __init__(self, bar: RichProgressBar) -> None:
        self.bar = bar
        self.pairs: list[tuple[float, float]] = []

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = time.monotonic()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.batches, self.end = args[-1] + 1, time.monotonic()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        progress = self.bar.progress
        task = progress.tasks[self.bar.train_progress_bar_id]
        (column,) = [c for c in progress.columns if type(c).__name__ == "ProcessingSpeedColumn"]
        shown = float(column.render(task).plain.removesuffix("it/s"))
        self.pairs.append((shown, self.batches / (self.end - self.start)))


def test_the_rate_shown_is_the_rate_run(tmp_path: Path) -> None:
    # A redraw interval (1 s) longer than an epoch (~40 steps of 4 ms): the case that showed
    # 0.00it/s, since between redraws the bar is left alone.
    bar = RichProgressBar(refresh_rate=1)
    rate = ShownRate(bar)
    data = DataLoader(TensorDataset(torch.randn(40 * 2, 2)), batch_size=2)
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=3,
        callbacks=[bar, rate],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        default_root_dir=tmp_path,
    )
    trainer.fit(SlowSteps(), data, data)
    assert len(rate.pairs) == 3
    for shown, run in rate.pairs:
        assert abs(shown / run - 1) <= 0.2, rate.pairs


def test_a_stage_ends_without_waiting_for_the_refresh_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning's refresh thread sleeps a whole redraw interval (1 s here) between checks of its
    # flag, and Lightning's stop joins it: each stage ended up to a second after its work.
    joined: dict[str, list[str]] = {}
    join = threading.Thread.join

    def noting(self: threading.Thread, timeout: float | None = None) -> None:
        joined[stage].append(type(self).__name__)
        join(self, timeout)

    monkeypatch.setattr(threading.Thread, "join", noting)
    bars = {"lightning": LightningRichProgressBar(), "runkit": RichProgressBar(),
            "lightning, leave": LightningRichProgressBar(leave=True),  # stops at each epoch too
            "runkit, leave": RichProgressBar(leave=True)}  # fmt: skip
    for stage, bar in bars.items():
        joined[stage] = []
        reads_during_fit(bar, tmp_path / stage)
    assert joined["lightning, leave"].count("_RefreshThread") > 1
    assert "_RefreshThread" in joined["lightning"]
    assert "_RefreshThread" not in joined["runkit"] + joined["runkit, leave"]
