"""A NaN loss stops training (or the batch is skipped); a NaN is never saved as a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from conftest import FAST, CliRunner, last_line, run_dirs
from runkit.errors import RunError
from runkit.run.run_files import strict_json
from runkit.safety import finite_loss
from runkit.safety.checkpoints import AtomicCheckpointIO
from runkit.safety.finite_loss import DivergedError, FiniteLoss, NonFiniteLossError


class Poisoned(LightningModule):
    """NaN loss at steps ``bad``, buffer from ``nan_buffer_at``, val/loss from ``nan_val_from``."""

    def __init__(self, bad=(), nan_buffer_at=-1, nan_val_from=9, lr_key=False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.register_buffer("running", torch.zeros(1))
        self.bad, self.nan_buffer_at, self.nan_val_from = bad, nan_buffer_at, nan_val_from
        if lr_key:  # the hint names the key
            self.hparams["config"] = {"model": {"optimizer": {"lr": 0.01}}}

    def training_step(self, batch, batch_idx):
        if self.global_step == self.nan_buffer_at:
            self.running.fill_(float("nan"))
        loss = self.layer(batch[0]).pow(2).mean()
        return loss * float("nan") if self.global_step in self.bad else loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", float("nan") if self.current_epoch >= self.nan_val_from else 1.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(model, callback, tmp_path, every=1, epochs=2) -> Trainer:
    """Fit 10 steps an epoch; checkpoints every ``every`` steps (``None``: on val/loss)."""
    loader = DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=4)
    monitor = {"monitor": "val/loss"} if every is None else {"every_n_train_steps": every}
    trainer = Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, plugins=[AtomicCheckpointIO()],
        callbacks=[callback, ModelCheckpoint(dirpath=tmp_path, save_last=True, **monitor)],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, loader, loader if every is None else None)
    return trainer


def assert_all_finite(folder: Path) -> None:
    for file in folder.glob("**/*.ckpt"):
        saved = torch.load(file, weights_only=True)
        assert all(
            v.isfinite().all() for v in saved["state_dict"].values() if v.is_floating_point()
        )
        scores = [
            s["current_score"] for s in saved.get("callbacks", {}).values() if "current_score" in s
        ]
        assert all(s is None or s.isfinite() for s in scores), file


LAST = "the last finite checkpoint is {{last}} (epoch {epoch}, step {step})"
FAILS = {
    # case: (Poisoned's arguments, FiniteLoss's, fit's every and epochs, the error and its line,
    # the step training ended at, last.ckpt's step: None, no checkpoint at all)
    "NaN loss, stop": ({"bad": {13}, "lr_key": True}, {"check_every_n_steps": 1000}, 1, 2, NonFiniteLossError,
        "non-finite training loss (NaN or inf) at step 13 (epoch 1, batch 3); training stopped, checkpoints "
        "saved before it are kept. Lower model.optimizer.lr, or set callbacks.finite_loss.action=skip to skip "
        "such batches", 14, 13),
    "NaN loss between checkpoints": ({"bad": {2}}, {"check_every_n_steps": 4}, 1000, 2, NonFiniteLossError,
        "non-finite training loss (NaN or inf) at step 2 (epoch 0, batch 2); training stopped, checkpoints "
        "saved before it are kept. Lower the learning rate, or set callbacks.finite_loss.action=skip to skip "
        "such batches", 4, None),  # read at the 4th step's end
    "skipped more than max_skipped": ({"bad": {3, 4}}, {"action": "skip", "max_skipped": 1}, 1, 2, NonFiniteLossError,
        "2 training batches had a non-finite loss (callbacks.finite_loss.max_skipped=1); stopping", 4, 4),
    "NaN weights": ({"bad": {3}, "nan_buffer_at": 13}, {"action": "skip"}, 1, 2, DivergedError,
        "training diverged: the weights are not finite (NaN or inf) at step 14 (epoch 1, 1 batch(es) "
        f"skipped); this checkpoint is not written; {LAST.format(epoch=1, step=13)}. Lower the learning rate",
        14, 13),
    "NaN monitored metric": ({"nan_val_from": 1}, {}, None, 4, DivergedError,
        "training diverged: the monitored metric val/loss=nan is not finite (NaN or inf) at step 20 (epoch 1); "
        f"training stopped, no checkpoint holds it; {LAST.format(epoch=0, step=10)}. Lower the learning rate, "
        "or check how Poisoned computes val/loss", 20, 10),  # no training after that validation
    "NaN weights as training ends": ({"nan_buffer_at": 15}, {}, 1000, 2, DivergedError,
        "training diverged: the weights are not finite (NaN or inf) at step 20 (epoch 1); nothing is tested "
        "or exported; the last finite checkpoint is none (none was saved). Lower the learning rate", 20, None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FAILS))
def test_a_non_finite_run_ends_in_one_line_and_never_saves_nan(tmp_path: Path, case: str) -> None:
    model_args, options, every, epochs, error, line, step, last = FAILS[case]
    model = Poisoned(**model_args)
    with pytest.raises(error) as info:
        fit(model, FiniteLoss(**options), tmp_path, every, epochs)
    assert str(info.value) == line.format(last=tmp_path / "last.ckpt") and info.value.exit_code == 3
    assert model.trainer.global_step == step
    if last is None:
        assert not list(tmp_path.glob("*.ckpt"))  # nothing was due, nothing NaN was written
    else:
        assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == last
    assert_all_finite(tmp_path)


def test_skip_leaves_weights_as_if_the_batch_never_came(tmp_path, caplog) -> None:
    torch.manual_seed(0)
    model, callback = Poisoned({3, 4}), FiniteLoss(action="skip")
    assert fit(model, callback, tmp_path).global_step == 20 and callback.skipped == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert (
        "Non-finite training loss at step 4 (epoch 0, batch 4): batch skipped (2 so far)"
        in caplog.messages
    )


@pytest.mark.parametrize(
    ("options", "line"),
    [
        ({"action": "ignore"}, "action='ignore' is invalid; expected stop or skip"),
        ({"check_every_n_steps": 0}, "check_every_n_steps=0 is invalid; expected an integer >= 1"),
        ({"check_every_n_steps": 1.5}, "check_every_n_steps=1.5 is invalid; expected an integer >= 1"),
    ],
)  # fmt: skip
def test_bad_options_are_one_line(options: dict, line: str) -> None:
    with pytest.raises(RunError) as info:
        FiniteLoss(**options)
    assert str(info.value) == f"callbacks.finite_loss.{line}"
    assert FiniteLoss(check_every_n_steps=1).check_every_n_steps == 1


def test_a_tensor_counts_by_its_own_shard() -> None:
    class Sharded(torch.Tensor):
        def to_local(self) -> torch.Tensor:
            return torch.tensor([float("nan")])

    nan, sharded = torch.tensor([float("nan")]), torch.zeros(1).as_subclass(Sharded)
    finite = finite_loss._all_finite
    assert finite([]) and finite([torch.tensor([1, 2]), torch.empty(0), "x"])
    assert not finite([torch.ones(2), nan]) and not finite([sharded])


def test_a_monitored_metric_bad_on_another_rank_ends_fit_alone_at_that_validation() -> None:
    other_rank_bad = SimpleNamespace(reduce_boolean_decision=lambda bad, all=True: not all or bad)
    trainer = SimpleNamespace(
        state=SimpleNamespace(fn="validate"), sanity_checking=False, strategy=other_rank_bad,
        checkpoint_callback=SimpleNamespace(monitor="val/acc", last_model_path="", best_model_path=""),
        callback_metrics={"val/acc": torch.tensor(0.5)}, lightning_module=Poisoned(), global_step=7,
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
    text = strict_json({"metrics": {"val/loss": float("nan"), "acc": 0.5}, "e": [float("inf")]})
    assert json.loads(text, parse_constant=lambda name: pytest.fail(name)) == {
        "metrics": {"val/loss": None, "acc": 0.5},
        "e": [None],
    }


def assert_one_error_and_nothing_exported(done, log_dir: Path) -> tuple[str, Path]:
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Error executing job" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    (run,) = run_dirs(log_dir)
    assert len(errors) == 1 and errors[0] == last_line(done.stderr), errors
    assert not (run / "model.pth").exists() and not (run / "metrics.json").exists()
    assert_all_finite(run)
    for file in run.rglob("*.json"):  # strict: a NaN would be refused
        assert "NaN" not in file.read_text() and "Infinity" not in file.read_text(), file
    return errors[0], run


@pytest.mark.slow
def test_a_diverging_run_with_skip_fails_in_one_line_and_exports_nothing(cli, log_dir) -> None:
    done = cli("train", "callbacks.finite_loss.action=skip", "model.optimizer.lr=1e12", *FAST)
    error, _ = assert_one_error_and_nothing_exported(done, log_dir)
    assert error.startswith("error: training diverged: the "), error
    assert error.endswith(". Lower model.optimizer.lr"), error  # the key this config has


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
    # DDP, NaN on rank 1 alone (Lightning's BoringModel, val/acc NaN from epoch 1)
    (tmp_path / "nan_acc.py").write_text(NAN_ACC)
    done = cli(
        "train", "~model", "+model._target_=nan_acc.NanAcc", "~data",
        "+data._target_=lightning.pytorch.demos.boring_classes.BoringDataModule",
        "trainer.max_epochs=4", "callbacks.progress_bar.refresh_rate=0", "trainer=ddp_sim",
    )  # fmt: skip
    error, run = assert_one_error_and_nothing_exported(done, log_dir)
    assert error == (
        "error: training diverged: the monitored metric val/acc (on another rank) is not finite "
        "(NaN or inf) at step 64 (epoch 1); training stopped, no checkpoint holds it; the last "
        f"finite checkpoint is {run / 'checkpoints' / 'last.ckpt'} (epoch 0, step 32). Lower "
        "the learning rate, or check how NanAcc computes val/acc"  # a BoringModel has no lr key
    )
