"""The LightningModule: steps, per-stage torchmetrics, logged names, plain-data checkpoints."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from project.data.digits import DigitsDataModule
from project.models.classifier import ClassifierModule
from project.models.nets import MLP, ConvNet, EpochBatchNorm2d


def make_module(**kwargs) -> ClassifierModule:
    return ClassifierModule(
        ConvNet(channels=(8, 16)), partial(torch.optim.AdamW, lr=0.01), **kwargs
    )


def test_networks_map_images_to_class_logits() -> None:
    images = torch.rand(5, 1, 8, 8)
    assert ConvNet()(images).shape == (5, 10)
    assert MLP()(images).shape == (5, 10)


def test_batch_norm_evaluates_with_the_average_since_the_last_evaluation() -> None:
    """The plain average of the batches trained on since the layer was last evaluated: sound
    right after a short run, no exponential lag, and no batch count read back to the host."""
    layer = EpochBatchNorm2d(3)
    old = [torch.randn(8, 3, 4, 4) * 5 - 7 for _ in range(4)]
    for batch in old:
        layer(batch)
    layer.training = False  # how Lightning switches modes: no train()/eval() call
    layer(old[0])  # an evaluation...
    layer.training = True  # ...so the next training batch starts a new average
    recent = [torch.randn(8, 3, 4, 4) * (i + 1) + i for i in range(3)]
    for batch in recent:
        out = layer(batch)
    assert torch.allclose(out.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5)  # batch statistics
    means = torch.stack([b.mean(dim=(0, 2, 3)) for b in recent]).mean(dim=0)
    variances = torch.stack([b.var(dim=(0, 2, 3)) for b in recent]).mean(dim=0)
    assert torch.allclose(layer.running_mean, means, atol=1e-5)
    assert torch.allclose(layer.running_var, variances, atol=1e-4)
    assert layer.num_batches_tracked.item() == 3
    layer.eval()
    expected = (recent[0] - means[None, :, None, None]) / torch.sqrt(
        variances[None, :, None, None] + layer.eps
    )
    assert torch.allclose(layer(recent[0]), expected, atol=1e-4)
    # The same state as torch's batch norm: old checkpoints and model.pth files load.
    plain = torch.nn.BatchNorm2d(3)
    plain.load_state_dict(layer.state_dict())
    assert list(plain.state_dict()) == list(layer.state_dict())


def test_steps_update_metrics_and_return_a_differentiable_loss() -> None:
    module = make_module()
    batch = (torch.rand(16, 1, 8, 8), torch.randint(0, 10, (16,)))
    loss = module.training_step(batch, 0)
    assert loss.requires_grad and loss.ndim == 0
    computed = module.train_metrics.compute()
    assert set(computed) == {"train/acc", "train/loss"}
    assert torch.isclose(computed["train/loss"], loss.detach())
    predictions = module.predict_step(batch, 0)
    assert predictions.shape == (16,) and predictions.dtype == torch.int64


def test_scheduler_partial_is_completed_with_the_optimizer() -> None:
    module = make_module(scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=1))
    config = module.configure_optimizers()
    assert isinstance(config["optimizer"], torch.optim.AdamW)
    assert config["lr_scheduler"]["scheduler"].optimizer is config["optimizer"]


def test_fit_logs_stage_metrics_and_checkpoint_loads_weights_only(tmp_path: Path) -> None:
    pl.seed_everything(0)
    module = make_module()
    module.save_hyperparameters({"config": {"model": {"net": {"channels": [8, 16]}}}})
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", logger=CSVLogger(tmp_path, name="csv", version=""),
        default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
        limit_train_batches=2, limit_val_batches=1, limit_test_batches=1, log_every_n_steps=1,
        num_sanity_val_steps=0,
    )  # fmt: skip
    datamodule = DigitsDataModule(batch_size=64)
    trainer.fit(module, datamodule=datamodule)
    trainer.test(module, datamodule=datamodule, verbose=False)

    header = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    for name in ("train/loss", "train/acc", "val/loss", "val/acc", "val/acc_best", "test/acc"):
        assert name in header
    assert "train/loss_step" not in header  # epoch-level only: no per-step host sync

    ckpt = next(tmp_path.glob("**/*.ckpt"))
    data = torch.load(ckpt, weights_only=True)
    assert data["hyper_parameters"]["config"]["model"]["net"]["channels"] == [8, 16]
    assert "val_acc_best.max_value" in data["state_dict"]  # the best so far survives a resume
