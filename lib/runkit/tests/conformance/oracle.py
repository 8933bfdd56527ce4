"""The oracle: one corpus member under a bare ``lightning.pytorch.Trainer``, nothing of the template.

    python -m conformance.oracle <member> <out_dir> <devices>

A member that draws from torch's generator while it trains (``Member.draws_random``) gets the
one callback of the template that changes what it learns: ``ResumeState``, which seeds every
epoch from ``(seed, epoch)`` so that a resumed run continues exactly. Everything else stays plain.

Builds the member's model and data from its configs as plain Python (``_convert_="all"``: lists and
dicts, no OmegaConf containers), seeds as ``tinyapp.train`` does (``seed_everything(SEED,
workers=True)`` before building the data, then the model), fits with ``conformance.TRAINER``
and writes what the harness compares: ``<out_dir>/csv/metrics.csv`` (Lightning's CSVLogger) and
``<out_dir>/weights.pt``, the final ``state_dict``. ``devices`` > 1: DDP over gloo, as the
template's ``trainer.devices=2`` on the CPU.
"""

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
    """The member's model or data module from ``configs/<group>/<name>.yaml``, plain values."""
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
        accelerator="cpu",
        callbacks=callbacks,
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=CSVLogger(out, name="csv", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        **TRAINER,
    )
    trainer.fit(model, datamodule=datamodule)
    if trainer.is_global_zero:
        torch.save(model.state_dict(), out / "weights.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
