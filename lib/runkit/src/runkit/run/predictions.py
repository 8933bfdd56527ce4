"""What eval and predict rebuild from a trained run: its config, its model (from the run's own
config, trusted ``_target_``s; ``data.*`` overrides apply), its weights; and what ``predict`` runs on
which loader, and its files, in dataset order: ``predictions.pt`` (``"predictions"`` and each row's
dataset ``"index"``) and ``predictions.csv`` (``index,prediction`` or ``index,class``, the argmax of
``N x C`` scores)."""

from __future__ import annotations

import logging
import types
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities import apply_to_collection
from omegaconf import DictConfig, OmegaConf

from runkit.errors import RunError
from runkit.safety import checkpoints
from runkit.safety.writes import atomic_write

log = logging.getLogger(__name__)


def prepare_predict(model: LightningModule, datamodule: LightningDataModule) -> str:
    """Make ``trainer.predict`` run (``predict_step``, else forward on the inputs; the predict
    loader, else the test one) and return the line saying what runs."""
    name, data = type(model).__name__, type(datamodule).__name__
    if is_overridden("predict_step", model, LightningModule):
        step = f"{name}.predict_step"
    else:
        model.predict_step = types.MethodType(_forward_on_inputs, model)  # type: ignore[method-assign]
        step = f"{name}'s forward (it has no predict_step) on the inputs of each batch"
    if is_overridden("predict_dataloader", datamodule, LightningDataModule):
        loader = "predict_dataloader"
    elif is_overridden("test_dataloader", datamodule, LightningDataModule):
        datamodule.predict_dataloader = types.MethodType(_test_loader, datamodule)  # type: ignore[method-assign]
        loader = "test_dataloader (it has no predict_dataloader)"
    else:
        raise RunError(
            f"{data} has neither predict_dataloader nor test_dataloader: "
            "define one, or pass data=<a data config that has one>"
        )
    return f"Predicting with {step}, on {data}.{loader}"


def _forward_on_inputs(self: LightningModule, batch: Any, *args: Any, **kwargs: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return self(batch)
    if isinstance(batch, list | tuple) and batch:
        return self(batch[0])
    raise RunError(
        f"{type(self).__name__} has no predict_step and its batches are {type(batch).__name__}s, "
        "not a tensor or an (inputs, ...) tuple: define predict_step(self, batch, batch_idx)"
    )


def _test_loader(self: LightningDataModule) -> Any:
    self.setup("test")  # Lightning set it up for "predict", which a data module may ignore
    return self.test_dataloader()


class PredictionWriter(BasePredictionWriter):
    """Write every prediction to ``output_dir`` once, in dataset order (rank 0 gathers)."""

    def __init__(self, output_dir: str | Path) -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = Path(output_dir)
        self.written: list[Path] = []

    def write_on_epoch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        loaders = list(predictions) if len(batch_indices) > 1 else [predictions]
        share = [
            (list(batches), [list(b) for b in indices])
            for batches, indices in zip(loaders, batch_indices, strict=True)
        ]
        shares: list[Any] = [share]  # rank 0 gathers every rank's predictions and indices
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            gathered = [None] * trainer.world_size if trainer.is_global_zero else None
            torch.distributed.gather_object(share, gathered, dst=0)
            shares = gathered or []
        if not trainer.is_global_zero:
            return
        for i in range(len(share)):
            stem = "predictions" if len(share) == 1 else f"predictions_{i}"
            rows, index = _in_dataset_order([rank_share[i] for rank_share in shares])
            self.written += _write(rows, index, self.output_dir, stem)


def _in_dataset_order(shares: list[tuple[list[Any], list[list[int]]]]) -> tuple[Any, torch.Tensor]:
    """Every rank's batches as one set of rows sorted by dataset index, each index once."""
    batches = [batch for rank_batches, _ in shares for batch in rank_batches]
    if not batches:
        return torch.empty(0), torch.empty(0, dtype=torch.long)
    indices = [index for _, rank_indices in shares for index in rank_indices]
    rows, counts = _concat(batches), set[int]()
    apply_to_collection(rows, torch.Tensor, lambda t: counts.add(len(t)))
    if len(counts) != 1:
        raise RunError(
            f"predict_step returned parts with different numbers of rows ({sorted(counts)}): "
            "each must have the batch as its first dimension"
        )
    counted = counts.pop()
    if len(indices) == len(batches):  # Lightning recorded each batch's items
        flat = torch.tensor([i for batch in indices for i in batch], dtype=torch.long)
        if len(flat) != counted:
            raise RunError(
                f"predict_step returned {counted} rows for {len(flat)} items: predictions are "
                "written one row per item, so return a tensor (or dict/list/tuple of tensors) "
                "whose first dimension is the batch"
            )
    else:  # a loader Lightning cannot index (an IterableDataset): the order it gave
        log.info("The predict loader has no sampler to index: the rows are in the order it gave")
        flat = torch.arange(counted)
    index, first = np.unique(flat.numpy(), return_index=True)  # each index once (padding)
    first_rows = torch.from_numpy(first)
    return apply_to_collection(rows, torch.Tensor, lambda t: t[first_rows]), torch.from_numpy(index)


def _concat(batches: list[Any]) -> Any:
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([b.reshape(1) if b.ndim == 0 else b for b in batches])
    if isinstance(first, Mapping):
        return {key: _concat([b[key] for b in batches]) for key in first}
    if isinstance(first, list | tuple):
        return type(first)(_concat([b[i] for b in batches]) for i in range(len(first)))
    raise RunError(
        f"predict_step returned a {type(first).__name__}: return a tensor, or a dict/list/tuple "
        "of tensors, whose first dimension is the batch"
    )


def _write(rows: Any, index: torch.Tensor, out: Path, stem: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.pt"
    atomic_write(path, lambda handle: torch.save({"predictions": rows, "index": index}, handle))
    written = [path]
    column = None  # one column per item says it all: a CSV too
    if isinstance(rows, torch.Tensor) and (rows.ndim == 1 or rows.shape[1:] == (1,)):
        column, values = "prediction", rows.reshape(-1)
    elif isinstance(rows, torch.Tensor) and rows.ndim == 2 and rows.is_floating_point():
        column, values = "class", rows.argmax(dim=1)
    if column is not None:
        lines = [f"index,{column}"]
        lines += [f"{i},{v}" for i, v in zip(index.tolist(), values.tolist(), strict=True)]
        csv = out / f"{stem}.csv"
        atomic_write(csv, "\n".join(lines) + "\n")
        written.append(csv)
    log.info("Predictions of %d items: %s", len(index), ", ".join(str(p) for p in written))
    return written


def load_trained(cfg: DictConfig) -> tuple[Path, Any, Path | None, Any]:
    """``(source, model, ckpt_path, datamodule)`` rebuilt from the run at ``cfg.ckpt_path``."""
    source = checkpoints.resolve_ckpt_path(
        cfg.ckpt_path, cfg.paths.log_dir, "train", tested_weights=True
    )
    assert source is not None  # ckpt_path is required (???) in eval.yaml and predict.yaml
    data = checkpoints.load_file(source, mmap=True)
    trained = trained_config(cfg, source, data)
    seed_everything(cfg.seed, workers=True)
    model, ckpt = trained_model(trained["model"], source, data)
    return source, model, ckpt, instantiate(trained["data"], _convert_="all")


def trained_config(cfg: DictConfig, source: Path, data: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` and ``data`` config of the run behind ``source``, with ``data.*`` overrides."""
    try:
        parts = checkpoints.run_config(source, data, cfg.trusted_targets, ("model", "data"))
    except checkpoints.NoRunConfig:
        log.info(
            "%s has no run config inside or beside it: rebuilding it from this command's model "
            "and data config",
            source,
        )
        return {key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("model", "data")}
    node = OmegaConf.create(parts["data"])
    lines = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    for override in OverridesParser.create().parse_overrides(lines):
        key = override.key_or_group
        if key == "model" or key.startswith("model."):
            raise RunError(
                f"{override.input_line} is not used: eval rebuilds the model from the config of "
                f"the run that wrote {str(source)!r}; drop it (data.* overrides do apply)"
            )
        if key == "data":  # another data config altogether: the composed one, as given
            node = OmegaConf.create(OmegaConf.to_container(cfg.data, resolve=True))
        elif key.startswith("data.") and override.is_delete():
            parent, _, leaf = key[len("data.") :].rpartition(".")
            holder = OmegaConf.select(node, parent) if parent else node
            if holder is not None and leaf in holder:
                del holder[leaf]
        elif key.startswith("data."):
            value = OmegaConf.select(cfg.data, key[len("data.") :], throw_on_missing=False)
            OmegaConf.update(node, key[len("data.") :], value, merge=False, force_add=True)
    return {"model": parts["model"], "data": OmegaConf.to_container(node, resolve=False)}


def trained_model(model_config: dict[str, Any], source: Path, data: dict[str, Any]) -> Any:
    """``(model, ckpt_path)``: the rebuilt module and the checkpoint Lightning loads into it
    after ``setup()`` (``None`` when the weights are in already)."""
    model = checkpoints.rebuild_model(model_config)
    if is_lightning_checkpoint(data):
        mismatch = checkpoints.state_mismatch(model.state_dict(), data["state_dict"], True)
        if mismatch:
            raise RunError(
                f"{str(source)!r} does not fit {type(model).__name__} rebuilt from its run's "
                f"config: {mismatch}"
            )
        # Lightning restores callback states from a checkpoint in test and predict too, and warns
        # about every training callback (ModelCheckpoint, ResumeState...) this run has no use for.
        warnings.filterwarnings(
            "ignore", message=r"Be aware that when using `ckpt_path`, callbacks"
        )
        return model, source
    state = checkpoints.network_state(data, source, prefix="")
    expected = model.state_dict()
    if set(expected) <= set(state) and not checkpoints.state_mismatch(expected, state, True):
        if set(state) == set(expected):  # the whole module's weights, every layer built
            model.load_state_dict(state)
            return model, None
        # ... and weights of layers setup() builds: Lightning loads them after it, strictly
        return model, checkpoints.as_lightning_checkpoint(state, source)
    checkpoints.load_exported_weights(model, data, source)  # the network's, or one line
    return model, None


def is_lightning_checkpoint(data: dict[str, Any]) -> bool:
    """Whether a loaded file is a Lightning checkpoint (else weights)."""
    return "pytorch-lightning_version" in data and isinstance(data.get("state_dict"), dict)
