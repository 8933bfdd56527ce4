"""The LightningModule: loss, the four steps, metrics and optimisers for any classifier network."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from project.machinery import speed
from project.machinery.strategies import steps_run_in_replicas
from project.models.nets import restart_epoch_statistics

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., Any]


class ClassifierModule(LightningModule):
    """Train a classification network (a plain ``nn.Module`` handed in) with cross-entropy.

    ``optimizer`` and ``scheduler`` are partials from the config (``_partial_: true``), completed
    here with the parameters and the optimiser. Metrics are torchmetrics objects, one set per
    stage, logged per epoch only, so no step waits on a device-to-host copy.

    Each step computes its outputs, then ``_step_end`` updates the metrics and returns the loss.
    Under ``trainer.strategy=dp`` the steps run in per-GPU copies; they return the outputs and
    the strategy calls ``*_step_end`` on this module after gathering them (project.machinery.strategies.dp).

    Only plain data goes into the checkpoint's hyperparameters (the run's config, added by
    :func:`project.train.train`), never the network or the partials: a checkpoint therefore loads
    with ``torch.load(..., weights_only=True)``.
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        num_classes: int = 10,
        scheduler_interval: str = "epoch",
        monitor: str = "val/loss",
        compile: bool = False,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"], logger=False)
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self._channels_last = False  # decided in configure_model, once the device is known
        # Per-sample losses, averaged in _step_end: under strategy=dp the GPUs' losses are gathered
        # first, so the mean equals the single-GPU loss even when a batch splits unevenly.
        self.criterion = nn.CrossEntropyLoss(reduction="none")
        for stage in ("train", "val", "test"):
            # No per-step host sync: MeanMetric's NaN check branches on a device value at every
            # update (disabled: a NaN loss shows as NaN); argument checks are skipped per step too.
            metrics = {
                "acc": MulticlassAccuracy(num_classes, average="micro", validate_args=False),
                "loss": MeanMetric(nan_strategy="disable"),
            }
            setattr(self, f"{stage}_metrics", MetricCollection(metrics, prefix=f"{stage}/"))
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)  # saved in checkpoints, so a resumed run keeps its best

    def forward(self, x: Tensor) -> Tensor:
        return self.net(speed.to_channels_last(x) if self._channels_last else x)

    def _shared_step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor | dict[str, Tensor]:
        inputs, targets = batch
        logits = self(inputs)
        outputs = {"losses": self.criterion(logits, targets), "logits": logits, "targets": targets}
        if steps_run_in_replicas(self):
            # strategy=dp: this is a throw-away per-GPU copy; the strategy gathers the outputs and
            # calls <stage>_step_end on the real module, where metric updates are kept.
            return outputs
        return self._step_end(outputs, stage)

    def _step_end(self, outputs: dict[str, Tensor], stage: str) -> Tensor:
        loss = outputs["losses"].mean()
        metrics = self._metrics(stage)
        metrics["acc"].update(outputs["logits"].detach(), outputs["targets"])
        # The per-sample losses, not (mean, count): a count is a host number that would be
        # copied to the device (and waited for) at every step.
        metrics["loss"].update(outputs["losses"].detach())
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:  # not on a mid-epoch resume, whose restored statistics stay
            restart_epoch_statistics(self.net)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        return self._shared_step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        return self._shared_step(batch, "test")

    # Called by strategy=dp only, with the outputs of all GPUs gathered (see project.machinery.strategies.dp).
    def training_step_end(self, outputs: dict[str, Tensor]) -> Tensor:
        return self._step_end(outputs, "train")

    def validation_step_end(self, outputs: dict[str, Tensor]) -> Tensor:
        return self._step_end(outputs, "val")

    def test_step_end(self, outputs: dict[str, Tensor]) -> Tensor:
        return self._step_end(outputs, "test")

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

    def configure_model(self) -> None:
        # Speed switches (project.machinery.speed): channels-last on CUDA, torch.compile of the network.
        self._channels_last = speed.prepare_net(
            self.net, self.trainer, self.hparams.compile, self.hparams.channels_last
        )

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": scheduler,
                "interval": self.hparams.scheduler_interval,
                "monitor": self.hparams.monitor,
            },
        }
