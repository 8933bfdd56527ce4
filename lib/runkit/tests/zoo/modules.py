"""The zoo's LightningModules."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from zoo.data import Points


class RegressionModule(LightningModule):  # least squares on tuple batches
    def __init__(self, in_features: int = 8, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(-1)

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch
        prediction = self(x)
        loss = F.mse_loss(prediction, y)
        self.log(f"{stage}/loss", loss, on_step=True, on_epoch=True, sync_dist=True, prog_bar=True)
        self.log(f"{stage}_mae", (prediction - y).abs().mean(), on_epoch=True, sync_dist=True)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss"}}  # fmt: skip


class TwoOptimizerModule(LightningModule):
    """Manual optimisation, an optimiser each for an encoder and a head; dict batches."""

    def __init__(self, in_features: int = 8, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.encoder = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.encoder(x)
        return {"features": features, "prediction": self.head(features).squeeze(-1)}

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(self(batch["x"])["prediction"], batch["y"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        encoder_opt, head_opt = self.optimizers()
        for optimizer in (head_opt, encoder_opt):
            loss = self._loss(batch)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), on_epoch=True, sync_dist=True)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), on_epoch=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        lr = self.hparams.lr
        return [torch.optim.SGD(self.encoder.parameters(), lr=lr),
                torch.optim.Adam(self.head.parameters(), lr=lr / 5)]  # fmt: skip


class LazyModule(LightningModule):
    """Layers made in ``configure_model`` (as for sharded models); batches are :class:`Points`."""

    def __init__(self, in_features: int = 8, hidden: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers: nn.Module | None = None

    def configure_model(self) -> None:
        if self.layers is None:  # idempotent, as Lightning asks
            hidden = self.hparams.hidden
            self.layers = nn.Sequential(nn.Linear(self.hparams.in_features, hidden), nn.GELU(),
                                        nn.Linear(hidden, 1))  # fmt: skip

    def _loss(self, batch: Points) -> torch.Tensor:
        assert self.layers is not None
        return F.mse_loss(self.layers(batch.x).squeeze(-1), batch.y)

    def training_step(self, batch: Points, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, on_step=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Points, batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), on_epoch=True, sync_dist=True)

    def test_step(self, batch: Points, batch_idx: int) -> None:
        self.log("test/loss", self._loss(batch), on_epoch=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class HeadModule(LightningModule):
    """A ``net`` and a head built in ``setup()`` from the data; a list and a dict as arguments."""

    def __init__(self, hidden: list[int] | None = None, options: dict[str, Any] | None = None,
                 in_features: int = 8) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        sizes = [in_features, *(hidden or [16])]
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(sizes):
            layers += [nn.Linear(a, b), nn.Tanh()]
        self.net = nn.Sequential(*layers)
        self.width = sizes[-1]
        self.lr = float((options or {}).get("lr", 0.05))
        self.head: nn.Module | None = None

    def setup(self, stage: str) -> None:
        if self.head is None:  # reads the data, as Lightning documents; idempotent
            self.head = nn.Linear(self.width, self.trainer.datamodule.outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.head is not None
        return self.head(self.net(x)).squeeze(-1)

    def _loss(self, batch: Any) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class _OneLayer(LightningModule):
    def __init__(self, in_features: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(in_features, 1)
        self.errors: list[torch.Tensor] = []

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.layer(x).squeeze(-1), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class TwoLoadersModule(_OneLayer):
    """Two validation loaders, a score logged in ``on_validation_epoch_end``, no ``test_step``."""

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        loss = self._loss(batch)
        self.errors.append(loss.detach())
        self.log("val_loss", loss, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.log("val_score", -torch.stack(self.errors).mean(), sync_dist=True)
        self.errors.clear()


class NoValidationModule(_OneLayer):  # no validation_step
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)
