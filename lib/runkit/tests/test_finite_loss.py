"""A NaN loss stops training (or the batch is skipped); a NaN is never saved as a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from runkit.errors import RunError
from runkit.safety import finite_loss
from runkit.safety.checkpoints import AtomicCheckpointIO
from runkit.safety.finite_loss import FiniteLoss, NonFiniteLossError


class Poisoned(LightningModule):
    """A linear model whose loss is NaN at the listed global steps."""

    def __init__(self, bad_steps: set[int]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.bad_steps = bad_steps

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0]).pow(2).mean()
        if self.global_step in self.bad_steps:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(model: Poisoned, callback: FiniteLoss, tmp_path: Path, every: int = 1) -> Trainer:
    loader = DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=4)  # 10 steps per epoch
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_last=True)
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=2,
        callbacks=[callback, checkpoint],
        plugins=[AtomicCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, loader)
    return trainer


def test_stop_names_the_step_and_never_saves_nan(tmp_path: Path) -> None:
    model = Poisoned({13})
    with pytest.raises(NonFiniteLossError, match=r"at step 13 \(epoch 1, batch 3\)") as info:
        fit(model, FiniteLoss(check_every_n_steps=1000), tmp_path)
    assert "\n" not in str(info.value) and info.value.exit_code == 3
    last = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert last["global_step"] == 13  # the state before the NaN step
    for file in tmp_path.glob("*.ckpt"):
        state = torch.load(file, weights_only=True)["state_dict"]
        assert all(torch.isfinite(v).all() for v in state.values()), file


def test_stop_between_checkpoints_within_check_every_n_steps(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteLossError, match="at step 2 "):
        fit(Poisoned({2}), FiniteLoss(check_every_n_steps=4), tmp_path, every=1000)
    assert not list(tmp_path.glob("*.ckpt"))  # nothing was due, nothing NaN was written


def test_a_full_loss_buffer_is_read_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(finite_loss, "_MAX_KEPT", 2)  # two losses kept between host reads
    model = Poisoned({13})
    with pytest.raises(NonFiniteLossError, match=r"at step 13 \(epoch 1, batch 3\)"):
        fit(model, FiniteLoss(check_every_n_steps=1000), tmp_path, every=1000)
    assert model.trainer.global_step == 14  # read at the next backward, not at the epoch's end


def test_skip_leaves_weights_as_if_the_batch_never_came(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Poisoned({3, 4})
    callback = FiniteLoss(action="skip")
    trainer = fit(model, callback, tmp_path)
    assert callback.skipped == 2
    assert trainer.global_step == 20
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bad_options_are_one_line() -> None:
    with pytest.raises(RunError, match="action='ignore' is invalid"):
        FiniteLoss(action="ignore")  # type: ignore[arg-type]
    with pytest.raises(RunError, match="check_every_n_steps=0"):
        FiniteLoss(check_every_n_steps=0)
