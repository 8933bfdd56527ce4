"""The progress bar reads the logged values once per redraw, and always at the end of an epoch."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar as LightningRichProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader

from runkit.run import progress_bar
from runkit.run.progress_bar import RichProgressBar

BATCHES, EPOCHS = 6, 2  # training batches per epoch, epochs


class LogsEveryStep(BoringModel):
    def __init__(self, sleep_s: float = 0.0) -> None:
        super().__init__()
        self.sleep_s = sleep_s

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        time.sleep(self.sleep_s)  # the steps, not the loop, set the rate
        self.log("step_value", float(self.global_step), prog_bar=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_value", 1.0, prog_bar=True)


def fit(tmp_path, *callbacks: Callback, batches=BATCHES, epochs=EPOCHS, **module) -> list[dict]:
    """Every set of logged values the bar read (each a device sync on a GPU) in a short fit."""
    reads: list[dict[str, Any]] = []

    class Counting(Trainer):
        @property
        def progress_bar_metrics(self) -> dict[str, Any]:
            values = super().progress_bar_metrics
            reads.append({key: float(value) for key, value in values.items()})
            return values

    data = DataLoader(torch.randn(batches * 2, 32), batch_size=2)
    trainer = Counting(
        accelerator="cpu", max_epochs=epochs, callbacks=list(callbacks),
        logger=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=2, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(LogsEveryStep(**module), data, data)
    return reads


class Seen(Callback):
    """Per epoch, after the bar's own end: its count, the rate it shows, the batches/s run."""

    def __init__(self, bar: RichProgressBar) -> None:
        self.bar, self.counts, self.rates = bar, [], []

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = time.monotonic()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.batches, self.end = args[-1] + 1, time.monotonic()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        task = self.bar.progress.tasks[self.bar.train_progress_bar_id]
        (speed,) = [c for c in self.bar.progress.columns if type(c).__name__ == "ProcessingSpeedColumn"]  # fmt: skip
        self.counts.append(task.completed)
        self.rates.append((speed.render(task).plain, self.batches / (self.end - self.start)))


def test_reads_once_per_redraw_and_stages_end_without_the_refresh_thread(tmp_path, monkeypatch):
    joined: dict[str, list[str]] = {}
    reads: dict[str, list[dict]] = {}
    join = threading.Thread.join
    noting = lambda self, timeout=None: joined[stage].append(type(self).__name__) or join(self, timeout)  # noqa: E731  # fmt: skip
    monkeypatch.setattr(threading.Thread, "join", noting)
    for stage, bar in {"lightning": LightningRichProgressBar(), "runkit, leave": RichProgressBar(leave=True),
                       "lightning, leave": LightningRichProgressBar(leave=True)}.items():  # fmt: skip
        joined[stage] = []
        reads[stage] = fit(tmp_path / stage, bar)
    lightning = reads["lightning"]
    assert joined["lightning, leave"].count("_RefreshThread") > 1
    assert "_RefreshThread" in joined["lightning"]
    ticks = iter(range(0, 10_000, 2))  # two seconds a call: every batch is past the interval
    monkeypatch.setattr(progress_bar, "time", SimpleNamespace(monotonic=lambda: next(ticks)))
    stage, joined[stage] = "runkit", []
    assert fit(tmp_path / "due", RichProgressBar(refresh_rate=1)) == lightning
    # The clock stands still: one redraw interval never passes, so only the first batch reads;
    # every epoch end and validation end still does, and the values shown last are the final ones.
    monkeypatch.setattr(progress_bar, "time", SimpleNamespace(monotonic=lambda: 1000.0))
    updates: list[tuple] = []
    update = LightningRichProgressBar._update
    monkeypatch.setattr(LightningRichProgressBar, "_update", lambda s, *a, **k: updates.append(a) or update(s, *a, **k))  # fmt: skip
    bar = RichProgressBar(refresh_rate=1)
    seen = Seen(bar)
    still = fit(tmp_path / "still", bar, seen)
    assert "_RefreshThread" not in joined["runkit"] + joined["runkit, leave"]
    assert len(lightning) - len(still) == EPOCHS * BATCHES - 1
    assert still[-1] == lightning[-1] and still[-1]["step_value"] == EPOCHS * BATCHES - 1
    assert seen.counts == [BATCHES] * EPOCHS
    # per epoch: the first batch and the last (the rate's two ends), nothing in between
    assert [a[1] for a in updates if a and a[0] == bar.train_progress_bar_id] == [1, BATCHES] * 2


def test_the_rate_shown_is_the_rate_run(tmp_path) -> None:
    # a redraw interval (1 s) longer than an epoch: the case that showed 0.00it/s
    bar = RichProgressBar(refresh_rate=1)
    seen = Seen(bar)
    fit(tmp_path, bar, seen, batches=40, epochs=2, sleep_s=0.004)
    pairs = [(float(shown.removesuffix("it/s")), run) for shown, run in seen.rates]
    assert len(pairs) == 2 and all(abs(shown / run - 1) <= 0.2 for shown, run in pairs), pairs
