"""The template's classifier module and networks, without their commentary."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy


class ClassifierModule(LightningModule):
    def __init__(self, net: nn.Module, optimizer: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., Any] | None = None, num_classes: int = 10,
                 scheduler_interval: str = "epoch", monitor: str = "val/loss") -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"], logger=False)
        self.net, self.optimizer_factory, self.scheduler_factory = net, optimizer, scheduler
        self.criterion = nn.CrossEntropyLoss(reduction="none")
        for stage in ("train", "val", "test"):
            metrics = {"acc": MulticlassAccuracy(num_classes, average="micro", validate_args=False),
                       "loss": MeanMetric(nan_strategy="disable")}  # fmt: skip
            setattr(self, f"{stage}_metrics", MetricCollection(metrics, prefix=f"{stage}/"))
        self.train_metrics.persistent(True)
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def model_step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        logits, targets = self(batch[0]), batch[1]
        losses = self.criterion(logits, targets)
        metrics = getattr(self, f"{stage}_metrics")
        metrics["acc"].update(logits.detach(), targets)
        metrics["loss"].update(losses.detach())
        return losses.mean()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model_step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model_step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model_step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0] if isinstance(batch, list | tuple) else batch).argmax(dim=-1)

    def _log_stage(self, stage: str) -> dict[str, Tensor]:
        metrics = getattr(self, f"{stage}_metrics")
        values = metrics.compute()
        self.log_dict(values, prog_bar=stage != "test", sync_dist=True)
        metrics.reset()
        return values

    def on_train_epoch_end(self) -> None:
        self._log_stage("train")

    def on_validation_epoch_end(self) -> None:
        values = self._log_stage("val")
        if not self.trainer.sanity_checking:
            self.val_acc_best.update(values["val/acc"])
            self.log("val/acc_best", self.val_acc_best.compute(), prog_bar=True, sync_dist=True)

    def on_test_epoch_end(self) -> None:
        self._log_stage("test")

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler, hp = {"scheduler": self.scheduler_factory(optimizer=optimizer)}, self.hparams
        scheduler.update(interval=hp["scheduler_interval"], monitor=hp["monitor"])
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


class MLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: Sequence[int] = (256, 128),
                 num_classes: int = 10, dropout: float = 0.1) -> None:  # fmt: skip
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for width, size in zip([in_features, *hidden], hidden, strict=False):
            layers += [nn.Linear(width, size), nn.ReLU(), nn.Dropout(dropout)]
        layers.append(nn.Linear([in_features, *hidden][-1], num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class EpochBatchNorm2d(nn.BatchNorm2d):
    """Evaluation statistics: the plain average over the batches since the last evaluation."""

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__(num_features, eps=eps)
        self.register_buffer("evaluated", torch.tensor(False), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            self.evaluated.fill_(True)
            return super().forward(x)
        mean, var = torch.zeros_like(self.running_mean), torch.zeros_like(self.running_var)
        out = F.batch_norm(x, mean, var, self.weight, self.bias, True, 1.0, self.eps)
        with torch.no_grad():
            count = self.num_batches_tracked
            count.mul_(self.evaluated.logical_not()).add_(1)
            self.evaluated.fill_(False)
            self.running_mean.lerp_(mean, count.reciprocal())
            self.running_var.lerp_(var, count.reciprocal())
        return out


class ConvNet(nn.Module):
    def __init__(self, in_channels: int = 1, channels: Sequence[int] = (32, 64, 128),
                 num_classes: int = 10, dropout: float = 0.1) -> None:  # fmt: skip
        super().__init__()
        blocks: list[nn.Module] = []
        for width, size in zip([in_channels, *channels], channels, strict=False):
            blocks += [nn.Conv2d(width, size, 3, padding=1, bias=False), EpochBatchNorm2d(size)]
            blocks.append(nn.ReLU(inplace=True))
        self.features = nn.Sequential(*blocks)
        head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout)]
        self.head = nn.Sequential(*head, nn.Linear([in_channels, *channels][-1], num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))
