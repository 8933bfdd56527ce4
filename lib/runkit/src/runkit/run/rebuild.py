"""What eval and predict rebuild from a trained run: its config, its model, its weights.
The model comes from the run's own config (trusted ``_target_``s); ``data.*`` overrides apply."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runkit.errors import RunError
from runkit.safety import checkpoints

log = logging.getLogger(__name__)


def load_trained(cfg: DictConfig) -> tuple[Path, Any, Path | None, Any]:
    """``(source, model, ckpt_path, datamodule)`` rebuilt from the run at ``cfg.ckpt_path``."""
    import lightning.pytorch as pl
    from hydra.utils import instantiate

    source = checkpoints.resolve_ckpt_path(
        cfg.ckpt_path, cfg.paths.log_dir, "train", tested_weights=True
    )
    assert source is not None  # ckpt_path is required (???) in eval.yaml and predict.yaml
    data = checkpoints.load_file(source, mmap=True)
    trained = trained_config(cfg, source, data)
    pl.seed_everything(cfg.seed, workers=True)
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
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

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
