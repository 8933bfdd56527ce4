"""Every config file composes, every ``_target_`` resolves and accepts its keys, overrides land."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from project.errors import ProjectError
from project.machinery.run.cli import config_dir
from project.machinery.run.preflight import check_config, check_targets

CONFIGS = config_dir()
# Groups that need an optional extra or real hardware to instantiate; they are composed only.
EXTRA_ONLY = {("logger", "wandb"), ("logger", "mlflow")}


def compose_train(*overrides: str, name: str = "train") -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose(name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.paths.output_dir = "/tmp/never-used"  # normally set by Hydra at run time
    return cfg


def group_options() -> list[tuple[str, str]]:
    options = []
    for group_dir in sorted(p for p in CONFIGS.iterdir() if p.is_dir()):
        if group_dir.name in ("hydra",):
            continue
        for file in sorted(group_dir.glob("*.yaml")):
            options.append((group_dir.name, file.stem))
    return options


def test_configs_are_found_next_to_the_package() -> None:
    assert (CONFIGS / "train.yaml").is_file()
    assert (CONFIGS / "eval.yaml").is_file()


@pytest.mark.parametrize(
    ("group", "option"), group_options(), ids=[f"{g}={o}" for g, o in group_options()]
)
def test_every_option_composes_and_passes_preflight(group: str, option: str) -> None:
    if group == "hparams_search":
        pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="needs the optuna extra")
    cfg = compose_train(f"{group}={option}")
    assert cfg.get(group) is not None or group in ("experiment", "debug", "hparams_search")
    if (group, option) in EXTRA_ONLY:
        return
    if cfg.trainer.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        # A GPU preset on a CPU-only machine must be refused before anything starts.
        with pytest.raises(ProjectError, match="asks for a GPU"):
            check_config(cfg)
        return
    check_config(cfg)


def test_eval_config_composes_and_requires_a_checkpoint() -> None:
    cfg = compose_train(name="eval")
    assert OmegaConf.is_missing(cfg, "ckpt_path")


def test_overrides_reach_the_trainer_untouched() -> None:
    cfg = compose_train("trainer.max_epochs=3", "model.optimizer.lr=0.01", "trainer.devices=2")
    assert cfg.trainer.max_epochs == 3
    assert cfg.trainer.devices == 2
    assert cfg.model.optimizer.lr == 0.01
    assert cfg.model.scheduler.T_max == 3  # interpolated from trainer.max_epochs


def test_model_data_and_callbacks_instantiate() -> None:
    cfg = compose_train()
    model = instantiate(cfg.model)
    assert type(model.net).__name__ == "ConvNet"
    optimizer = model.optimizer_factory(params=model.parameters())
    assert optimizer.param_groups[0]["lr"] == cfg.model.optimizer.lr
    datamodule = instantiate(cfg.data)
    assert datamodule.batch_size == cfg.data.batch_size
    names = {type(instantiate(node)).__name__ for node in cfg.callbacks.values()}
    assert {"ModelCheckpoint", "RichProgressBar"} <= names


def test_every_target_node_maps_one_to_one_onto_its_class() -> None:
    """A key the class does not take is an error, not silently dropped."""
    cfg = compose_train()
    with open_dict(cfg):
        cfg.model.net.widht = 3
    with pytest.raises(ProjectError, match=r"model\.net\.widht is not an argument of .*ConvNet"):
        check_targets(cfg.model, "model")


def test_checkpoint_hyperparameters_are_plain_data(tmp_path: Path) -> None:
    from project.machinery.run.builders import plain

    cfg = compose_train()
    with open_dict(cfg):
        del cfg["hydra"]  # the task never sees Hydra's own node
    data = plain(cfg)
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        else:
            assert item is None or isinstance(item, str | int | float | bool), type(item)
