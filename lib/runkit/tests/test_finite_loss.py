"""A NaN loss stops training (or the batch is skipped); a NaN is never saved as a checkpoint."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from conftest import FAST, CliRunner, last_line, run_dirs
from runkit.errors import RunError
from runkit.safety.checkpoints import AtomicCheckpointIO
from runkit.safety.finite_loss import (
    DivergedError,
    FiniteLoss,
    NonFiniteLossError,
    _agreed,
    _all_finite,
)


class Poisoned(LightningModule):
    """NaN loss at ``bad_steps``, buffer from ``nan_buffer_at``, val/loss from ``nan_val_from``."""

    def __init__(self, bad_steps: set[int], nan_buffer_at: int = -1, nan_val_from: int = 9) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.register_buffer("running", torch.zeros(1))
        self.bad_steps, self.nan_buffer_at, self.nan_val_from = (
            bad_steps,
            nan_buffer_at,
            nan_val_from,
        )

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == self.nan_buffer_at:
            self.running.fill_(float("nan"))
        loss = self.layer(batch[0]).pow(2).mean()
        return loss * float("nan") if self.global_step in self.bad_steps else loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", float("nan") if self.current_epoch >= self.nan_val_from else 1.0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(
    model: Poisoned, callback: FiniteLoss, tmp_path: Path, every: int | None = 1, epochs: int = 2
) -> Trainer:
    """Fit 10 steps an epoch; checkpoints every ``every`` steps (``None``: on val/loss)."""
    loader = DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=4)
    monitor = {"monitor": "val/loss"} if every is None else {"every_n_train_steps": every}
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, **monitor)
    trainer = Trainer(
        accelerator="cpu", max_epochs=epochs, callbacks=[callback, checkpoint], logger=False,
        plugins=[AtomicCheckpointIO()], enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, loader, loader if every is None else None)
    return trainer


def assert_all_finite(folder: Path) -> None:
    for file in folder.glob("**/*.ckpt"):
        state = torch.load(file, weights_only=True)["state_dict"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point()), file


def test_stop_names_the_step_and_never_saves_nan(tmp_path: Path) -> None:
    model = Poisoned({13})
    model.hparams["config"] = {"model": {"optimizer": {"lr": 0.01}}}  # the hint names the key
    with pytest.raises(NonFiniteLossError) as info:
        fit(model, FiniteLoss(check_every_n_steps=1000), tmp_path)
    assert str(info.value) == (
        "non-finite training loss (NaN or inf) at step 13 (epoch 1, batch 3); training stopped, "
        "checkpoints saved before it are kept. Lower model.optimizer.lr, or set "
        "callbacks.finite_loss.action=skip to skip such batches"
    )
    assert info.value.exit_code == 3
    last = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert last["global_step"] == 13  # the state before the NaN step
    assert_all_finite(tmp_path)


def test_stop_between_checkpoints_within_check_every_n_steps(tmp_path: Path) -> None:
    model = Poisoned({2})
    with pytest.raises(NonFiniteLossError, match=r"at step 2 \(epoch 0, batch 2\).*Lower the lea"):
        fit(model, FiniteLoss(check_every_n_steps=4), tmp_path, every=1000)
    assert model.trainer.global_step == 4  # read at the 4th step's end
    assert not list(tmp_path.glob("*.ckpt"))  # nothing was due, nothing NaN was written


def test_skip_leaves_weights_as_if_the_batch_never_came(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = Poisoned({3, 4})
    callback = FiniteLoss(action="skip")
    trainer = fit(model, callback, tmp_path)
    assert callback.skipped == 2
    assert trainer.global_step == 20
    assert all(torch.isfinite(p).all() for p in model.parameters())
    warning = "Non-finite training loss at step 4 (epoch 0, batch 4): batch skipped (2 so far)"
    assert warning in caplog.messages
    with pytest.raises(NonFiniteLossError) as info:  # more than max_skipped
        fit(Poisoned({3, 4}), FiniteLoss(action="skip", max_skipped=1), tmp_path / "again")
    assert str(info.value) == (
        "2 training batches had a non-finite loss (callbacks.finite_loss.max_skipped=1); stopping"
    )


def test_bad_options_are_one_line() -> None:
    with pytest.raises(RunError) as info:
        FiniteLoss(action="ignore")  # type: ignore[arg-type]
    assert str(info.value) == (
        "callbacks.finite_loss.action='ignore' is invalid; expected stop or skip"
    )
    for every in (0, 1.5):
        with pytest.raises(RunError) as info:
            FiniteLoss(check_every_n_steps=every)  # type: ignore[arg-type]
        assert str(info.value) == (
            f"callbacks.finite_loss.check_every_n_steps={every!r} is invalid; "
            "expected an integer >= 1"
        )
    assert FiniteLoss(check_every_n_steps=1).check_every_n_steps == 1


def test_a_tensor_counts_by_its_own_shard_and_a_verdict_by_every_rank() -> None:
    class Sharded(torch.Tensor):
        def to_local(self) -> torch.Tensor:
            return torch.tensor([float("nan")])

    nan, sharded = torch.tensor([float("nan")]), torch.zeros(1).as_subclass(Sharded)
    assert _all_finite([]) and _all_finite([torch.tensor([1, 2]), torch.empty(0), "x"])
    assert not _all_finite([torch.ones(2), nan]) and not _all_finite([sharded])
    other_rank_bad = SimpleNamespace(
        reduce_boolean_decision=lambda bad, all=True: (bad and True) if all else (bad or True)
    )
    assert _agreed(SimpleNamespace(strategy=other_rank_bad), False)  # type: ignore[arg-type]


def test_diverged_weights_are_never_saved_and_end_the_run_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(DivergedError) as info:
        fit(Poisoned({3}, nan_buffer_at=13), FiniteLoss(action="skip"), tmp_path)
    assert info.value.exit_code == 3 and str(info.value) == (
        "training diverged: the weights are not finite (NaN or inf) at step 14 (epoch 1, 1 "
        "batch(es) skipped); this "
        f"checkpoint is not written; the last finite checkpoint is {tmp_path / 'last.ckpt'} (epoch "
        "1, step 13). Lower the learning rate"
    )
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 13
    assert_all_finite(tmp_path)


def test_a_non_finite_monitored_metric_stops_training_at_that_validation(tmp_path: Path) -> None:
    model = Poisoned(set(), nan_val_from=1)
    with pytest.raises(DivergedError) as info:
        fit(model, FiniteLoss(), tmp_path, every=None, epochs=4)
    assert str(info.value) == (
        "training diverged: the monitored metric val/loss=nan is not finite (NaN or inf) at step "
        "20 (epoch 1); training stopped, no checkpoint holds it; the last finite checkpoint is "
        f"{tmp_path / 'last.ckpt'} (epoch 0, step 10). Lower the learning rate, or check how "
        "Poisoned computes val/loss"
    )
    assert model.trainer.current_epoch == 1 and model.trainer.global_step == 20  # no training on
    for file in tmp_path.glob("*.ckpt"):
        states = torch.load(file, weights_only=True)["callbacks"].values()
        assert all(torch.isfinite(s["current_score"]) for s in states if "current_score" in s)


def test_a_divergence_found_as_training_ends_names_the_epoch_that_ran(tmp_path: Path) -> None:
    with pytest.raises(DivergedError) as info:  # epochs 0 and 1, no save due
        fit(Poisoned(set(), nan_buffer_at=15), FiniteLoss(), tmp_path, every=1000)
    assert str(info.value) == (
        "training diverged: the weights are not finite (NaN or inf) at step 20 (epoch 1); nothing "
        "is tested or exported; the last finite checkpoint is none (none was saved). Lower the "
        "learning rate"
    )


def test_a_monitored_metric_bad_on_another_rank_ends_fit_alone_at_that_validation() -> None:
    other_rank_bad = SimpleNamespace(reduce_boolean_decision=lambda bad, all=True: not all or bad)
    trainer = SimpleNamespace(
        state=SimpleNamespace(fn="validate"), sanity_checking=False, strategy=other_rank_bad,
        checkpoint_callback=SimpleNamespace(monitor="val/acc", last_model_path="", best_model_path=""),
        callback_metrics={"val/acc": torch.tensor(0.5)}, lightning_module=Poisoned(set()), global_step=7,
        fit_loop=SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(started=1))),
    )  # fmt: skip
    callback = FiniteLoss()
    callback.on_validation_end(trainer, None)  # type: ignore[arg-type]  # validate: not training
    trainer.state.fn = "fit"
    with pytest.raises(DivergedError) as info:
        callback.on_validation_end(trainer, None)  # type: ignore[arg-type]
    assert str(info.value) == (
        "training diverged: the monitored metric val/acc (on another rank) is not finite (NaN or "
        "inf) at step 7 (epoch 0); training stopped, no checkpoint holds it; the last finite "
        "checkpoint is none (none was saved). Lower the learning rate, or check how Poisoned "
        "computes val/acc"
    )


def test_metrics_json_is_strict_json() -> None:
    import json

    from runkit.run.run_files import strict_json

    text = strict_json({"metrics": {"val/loss": float("nan"), "acc": 0.5}, "e": [float("inf")]})
    assert json.loads(text, parse_constant=lambda name: pytest.fail(name)) == {
        "metrics": {"val/loss": None, "acc": 0.5},
        "e": [None],
    }


@pytest.mark.slow
def test_a_diverging_run_with_skip_fails_in_one_line_and_exports_nothing(
    cli: CliRunner, log_dir: Path
) -> None:
    done = cli("train", "callbacks.finite_loss.action=skip", "model.optimizer.lr=1e12", *FAST)
    assert done.returncode == 3, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: training diverged: the "), errors
    assert errors[0].endswith(". Lower model.optimizer.lr"), errors  # the key this config has
    assert "Traceback" not in done.stderr
    (run,) = run_dirs(log_dir)
    assert not (run / "model.pth").exists() and not (run / "metrics.json").exists()
    for file in run.glob("checkpoints/*.ckpt"):
        state = torch.load(file, weights_only=True)["state_dict"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    for file in run.rglob("*.json"):  # strict: a NaN would be refused
        assert "NaN" not in file.read_text() and "Infinity" not in file.read_text(), file


NAN_ACC = """
from lightning.pytorch.demos.boring_classes import BoringModel

class NanAcc(BoringModel):
    def validation_step(self, batch, batch_idx):
        last_rank = self.global_rank == self.trainer.world_size - 1
        self.log("val/acc", float("nan") if self.current_epoch >= 1 and last_rank else 0.5)
"""


@pytest.mark.slow
def test_a_monitored_metric_that_turns_nan_ends_the_run_at_that_validation(
    cli: CliRunner, log_dir: Path, tmp_path: Path
) -> None:
    # DDP, NaN on rank 1 alone (one process: test_a_non_finite_monitored_metric_stops_training_...)
    (tmp_path / "nan_acc.py").write_text(NAN_ACC)  # Lightning's BoringModel, val/acc NaN from 1
    done = cli(
        "train",
        "~model",
        "+model._target_=nan_acc.NanAcc",
        "~data",
        "+data._target_=lightning.pytorch.demos.boring_classes.BoringDataModule",
        "trainer.max_epochs=4",
        "callbacks.progress_bar.refresh_rate=0",
        "trainer=ddp_sim",
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Error executing job" not in done.stderr
    assert len([line for line in done.stderr.splitlines() if line.startswith("error:")]) == 1
    (run,) = run_dirs(log_dir)
    assert last_line(done.stderr) == (
        "error: training diverged: the monitored metric val/acc (on another rank) is not finite "
        "(NaN or inf) at step 64 (epoch 1); training stopped, no checkpoint holds it; the last "
        f"finite checkpoint is {run / 'checkpoints' / 'last.ckpt'} (epoch 0, step 32). Lower "
        "the learning rate, or check how NanAcc computes val/acc"  # a BoringModel has no lr key
    )
    assert not (run / "model.pth").exists() and not (run / "metrics.json").exists()
