"""The LightningModule: the loss, the four steps, metrics and optimisers for any classifier network."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric, Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., Any]


class ClassifierModule(LightningModule):
    """Train a classification network (a plain ``nn.Module`` handed in as ``net``) with cross-entropy.

    ``optimizer`` and ``scheduler`` are partials from the config (``_partial_: true``), completed
    here with the parameters and the optimiser. Metrics are torchmetrics objects, one set per
    stage, updated at every step and logged once per epoch, so no step waits for a value to come
    back from the GPU.

    The network lives in ``self.net``: ``trainer.strategy=dp`` splits each batch over the GPUs
    there, and ``callbacks.speed`` compiles it; neither needs anything from this class.

    Only plain data goes into the checkpoint's hyperparameters (the run's config, added by
    :func:`project.train.train`), never the network or the partials: a checkpoint therefore loads
    with ``torch.load(..., weights_only=True)``.
    """

    train_metrics: MetricCollection  # set per stage below
    val_metrics: MetricCollection
    test_metrics: MetricCollection

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        num_classes: int = 10,
        scheduler_interval: str = "epoch",
        monitor: str = "val/loss",
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"], logger=False)
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        # Per-sample losses: the epoch's loss is then their mean, however the last batch is cut.
        self.criterion = nn.CrossEntropyLoss(reduction="none")
        for stage in ("train", "val", "test"):
            # No per-step host sync: MeanMetric's NaN check branches on a device value at every
            # update (disabled: a NaN loss shows as NaN); argument checks are skipped per step too.
            metrics: dict[str, Metric | MetricCollection] = {
                "acc": MulticlassAccuracy(num_classes, average="micro", validate_args=False),
                "loss": MeanMetric(nan_strategy="disable"),
            }
            setattr(self, f"{stage}_metrics", MetricCollection(metrics, prefix=f"{stage}/"))
        # Saved in checkpoints: a run resumed mid-epoch logs that epoch's figures over all of it.
        self.train_metrics.persistent(True)
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)  # saved in checkpoints, so a resumed run keeps its best

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def model_step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        """The loss of one batch; the stage's metrics are updated on the way."""
        inputs, targets = batch
        logits = self(inputs)
        losses = self.criterion(logits, targets)
        metrics = self._metrics(stage)
        metrics["acc"].update(logits.detach(), targets)
        # The per-sample losses, not (mean, count): a count is a host number that would be
        # copied to the device (and waited for) at every step.
        metrics["loss"].update(losses.detach())
        return losses.mean()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model_step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model_step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model_step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs = batch[0] if isinstance(batch, list | tuple) else batch
        return self(inputs).argmax(dim=-1)

    def _metrics(self, stage: str) -> MetricCollection:
        return getattr(self, f"{stage}_metrics")

    def _log_stage(self, stage: str) -> dict[str, Tensor]:
        # compute() syncs across DDP processes itself, so the values logged are global.
        values = self._metrics(stage).compute()
        # Already global; sync_dist only keeps Lightning from warning under DDP (one tiny all-reduce).
        self.log_dict(values, prog_bar=stage != "test", sync_dist=True)
        self._metrics(stage).reset()
        return values

    def on_train_epoch_end(self) -> None:
        self._log_stage("train")

    def on_validation_epoch_end(self) -> None:
        values = self._log_stage("val")
        if self.trainer.sanity_checking:
            return  # the sanity check's untrained accuracy is not a result
        self.val_acc_best.update(values["val/acc"])
        self.log("val/acc_best", self.val_acc_best.compute(), prog_bar=True, sync_dist=True)

    def on_test_epoch_end(self) -> None:
        self._log_stage("test")

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": scheduler,
                "interval": self.hparams["scheduler_interval"],
                "monitor": self.hparams["monitor"],
            },
        }
