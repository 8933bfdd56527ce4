"""The library's tests run tinyapp, not the template; its configs are a copy of the template's, so
every composition must stay the template's but for where the targets live."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf, open_dict

from tinyapp import config_dir

TEMPLATE_CONFIGS = Path(__file__).resolve().parents[3] / "configs"
CASES = [("eval", ""), ("predict", ""), ("train", "")] + [
    ("train", f"{group.name}={option.stem}")
    for group in sorted(TEMPLATE_CONFIGS.iterdir())
    if group.is_dir() and group.name not in {"hydra", "paths"}
    for option in sorted(group.glob("*.yaml"))
]


def composed(directory: Path, name: str, override: str) -> str:
    """The composed config as YAML, each ``_target_`` by its last name, trusted targets left out."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(directory), version_base="1.3"):
        cfg = compose(name, overrides=[override] if override else [])
    with open_dict(cfg):
        cfg.pop("trusted_targets", None)
    return re.sub(r"(_target_: )[\w.]+\.(\w+)", r"\1\2", OmegaConf.to_yaml(cfg))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "override"), CASES, ids=[f"{n} {o}".strip() for n, o in CASES])
def test_tinyapp_composes_every_config_as_the_template_does(name: str, override: str) -> None:
    assert composed(config_dir(), name, override) == composed(TEMPLATE_CONFIGS, name, override)
