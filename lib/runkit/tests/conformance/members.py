"""The corpus's own members, as Lightning's docs teach, several patterns per class (``FEATURES``)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.demos.transformer import LightningTransformer, WikiText2
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset


class Pair:  # a batch Lightning cannot move by itself: PatternData's transfer_batch_to_device
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y


def _pairs(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> Pair:
    return Pair(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))


class Noisy(TensorDataset):  # augmentation from torch's global generator (seeded per worker)
    def __init__(self, x: torch.Tensor, y: torch.Tensor, noise: float) -> None:
        super().__init__(x, y)
        self.noise = noise

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(index)
        return x + self.noise * torch.randn_like(x), y


class PatternData(LightningDataModule):
    def __init__(self, root: str = "conformance_files", samples: int = 96, features: int = 6,
                 num_classes: int = 3, batch_size: int = 8, num_workers: int = 2) -> None:  # fmt: skip
        super().__init__()
        self.root, self.samples, self.features = Path(root), samples, features
        self.num_classes, self.batch_size, self.num_workers = num_classes, batch_size, num_workers
        self.splits: dict[str, Dataset] = {}

    def prepare_data(self) -> None:
        if (self.root / "points.pt").is_file():
            return
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, self.features, generator=generator)
        self.root.mkdir(parents=True, exist_ok=True)
        torch.save((x, (x[:, : self.num_classes] * 2).argmax(dim=1)), self.root / "points.pt")

    def setup(self, stage: str) -> None:
        x, y = torch.load(self.root / "points.pt", weights_only=True)
        a, b = self.samples // 2, 3 * self.samples // 4
        if stage == "fit":
            self.splits["train"] = Noisy(x[:a], y[:a], noise=0.1)
        if stage in ("fit", "validate"):
            self.splits["val"] = Noisy(x[a:b], y[a:b], noise=0.0)
        if stage in ("test", "predict"):
            self.splits["test"] = Noisy(x[b:], y[b:], noise=0.0)

    def _loader(self, split: str, batch_size: int = 0, **kwargs: Any) -> DataLoader:
        size = batch_size or self.batch_size
        return DataLoader(self.splits[split], batch_size=size, collate_fn=_pairs, **kwargs)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> list[DataLoader]:
        return [self._loader("val"), self._loader("val", self.batch_size // 2)]

    def test_dataloader(self) -> list[DataLoader]:
        return [self._loader("test"), self._loader("test", self.batch_size // 2)]

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        if isinstance(batch, Pair):
            return Pair(batch.x.to(device), batch.y.to(device))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)


class PatternModule(LightningModule):
    def __init__(
        self, encoder: nn.Module, widths: list[int], options: dict[str, Any], lr: float = 0.1
    ) -> None:
        super().__init__()
        # Lightning's advice: a module argument is saved with the weights, not as a hyperparameter.
        self.save_hyperparameters(ignore=["encoder"])
        self.encoder = encoder
        sizes = [encoder.out_features, *widths]
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(sizes):
            layers += [nn.Linear(a, b), nn.ReLU() if options["activation"] == "relu" else nn.Tanh()]
        self.body = nn.Sequential(*layers)
        self.head: nn.Module | None = None
        self._correct: list[torch.Tensor] = []

    def setup(self, stage: str) -> None:
        if self.head is None:  # Lightning calls setup once per stage; build once
            self.head = nn.Linear(self.hparams.widths[-1], self.trainer.datamodule.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.head is not None
        return self.head(self.body(self.encoder(x)))

    def training_step(self, batch: Pair, batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self(batch.x)
        loss = F.cross_entropy(logits, batch.y)
        self.log("train/loss", loss, on_step=True, on_epoch=True, batch_size=len(batch.y))
        return {"loss": loss, "correct": (logits.argmax(1) == batch.y).float().mean().detach()}

    def validation_step(self, batch: Pair, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._correct.append(self._evaluate(batch, "val").float())

    def on_validation_epoch_end(self) -> None:
        score = torch.cat(self._correct).mean() if self._correct else torch.tensor(0.0)
        self.log("val_score", score, sync_dist=True)
        self._correct.clear()

    def test_step(self, batch: Pair, batch_idx: int, dataloader_idx: int = 0) -> None:
        correct = self._evaluate(batch, "test").float().mean()
        self.log("test/acc", correct, sync_dist=True, batch_size=len(batch.y))

    def _evaluate(self, batch: Pair, stage: str) -> torch.Tensor:
        logits, size = self(batch.x), len(batch.y)  # a Pair: Lightning cannot find its size
        self.log(f"{stage}/loss", F.cross_entropy(logits, batch.y), sync_dist=True, batch_size=size)
        return logits.argmax(1) == batch.y

    def predict_step(self, batch: Pair, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch.x).softmax(dim=1)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "interval": "epoch",
                "monitor": "val/loss/dataloader_idx_0", "frequency": 1}}  # fmt: skip


class ListModule(LightningModule):
    """For ``IterableBoringDataModule``: a list batch (a tensor per training loader)."""

    def __init__(self, features: int = 4, lr: float = 0.05) -> None:
        super().__init__()
        self.features, self.lr = features, lr
        self.layer: nn.Module | None = None

    def configure_model(self) -> None:
        if self.layer is None:
            self.layer = nn.Linear(self.features, 1)

    def _loss(self, x: torch.Tensor) -> torch.Tensor:
        assert self.layer is not None
        return self.layer(x).pow(2).mean()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = sum(self._loss(x) for x in batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        return {"optimizer": optimizer,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}  # fmt: skip


# Every word once, then seeded lines: WikiText2's dictionary is WORDS and <eos> (the config's 21).
WORDS = [f"w{i}" for i in range(20)]


class TokenData(LightningDataModule):
    """Generated text, written where the demo's ``WikiText2`` reads (no download)."""

    def __init__(self, lines: int = 40, block_size: int = 12, batch_size: int = 4) -> None:
        super().__init__()
        self.lines, self.block_size, self.batch_size = lines, block_size, batch_size
        self.dataset: Dataset | None = None

    def prepare_data(self) -> None:
        path = Path("data") / "wikitext-2.txt"
        if path.is_file():
            return
        generator = torch.Generator().manual_seed(0)
        picks = torch.randint(len(WORDS), (self.lines, 10), generator=generator).tolist()
        text = [" ".join(WORDS)] + [" ".join(WORDS[i] for i in row) for row in picks]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(text) + "\n")

    def setup(self, stage: str) -> None:
        self.dataset = WikiText2(Path("data"), block_size=self.block_size, download=False)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)


class GeneratedTokensTransformer(LightningTransformer):
    def prepare_data(self) -> None:
        pass
