"""``python -m conformance.oracle <member> <out_dir> <devices>``: a member under a bare Trainer,
seeded as ``tinyapp.train`` is (and its ``ResumeState`` reseed where it draws from torch's
generator); writes ``<out_dir>/csv/metrics.csv`` and the final ``weights.pt``."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf

from conformance import CONFIGS, MEMBERS, SEED, TRAINER


def build(name: str, group: str) -> object:
    return instantiate(OmegaConf.load(CONFIGS / group / f"{name}.yaml"), _convert_="all")


def main(name: str, out: Path, devices: int) -> None:
    pl.seed_everything(SEED, workers=True)
    datamodule = build(name, "data")
    model = build(name, "model")
    callbacks = []
    if MEMBERS[name].draws_random:
        from runkit.safety.resume import ResumeState

        callbacks.append(ResumeState(SEED))
    trainer = pl.Trainer(
        accelerator="cpu", callbacks=callbacks, devices=devices, default_root_dir=out,
        strategy="ddp" if devices > 1 else "auto", logger=CSVLogger(out, name="csv", version=""),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **TRAINER,
    )  # fmt: skip
    trainer.fit(model, datamodule=datamodule)
    if trainer.is_global_zero:
        torch.save(model.state_dict(), out / "weights.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
