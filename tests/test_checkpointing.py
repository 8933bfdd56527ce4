"""model.pth export and loading, the Trainer's checkpoint plugin, and no unsafe unpickling."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from project.errors import ProjectError
from project.machinery.run import builders
from project.machinery.safety import checkpoints as checkpointing
from project.machinery.safety.checkpoints import (
    AtomicCheckpointIO,
    load_network,
    save_weights,
    with_atomic_io,
)
from project.models.nets import MLP

SRC = Path(checkpointing.__file__).resolve().parent
NET = {"_target_": "project.models.nets.MLP", "in_features": 64, "hidden": [8], "num_classes": 10}


def write_run(directory: Path, net_config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    OmegaConf.save({"model": {"net": net_config}}, directory / checkpointing.CONFIG_FILE)
    return directory


def test_model_pth_is_a_plain_state_dict_that_loads_back_equal(tmp_path: Path) -> None:
    net = MLP(in_features=64, hidden=[8], num_classes=10)
    path = save_weights(net, write_run(tmp_path, NET) / "model.pth")
    state = torch.load(path, weights_only=True)
    assert set(state) == set(net.state_dict())
    loaded = load_network(path, device="cpu")
    assert not loaded.training
    for key, value in net.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_model_pth_of_another_architecture_is_one_line_with_the_keys(tmp_path: Path) -> None:
    other = MLP(in_features=64, hidden=[8, 4], num_classes=10)
    path = save_weights(other, write_run(tmp_path, NET) / "model.pth")
    with pytest.raises(ProjectError) as info:
        load_network(path)
    message = str(info.value)
    assert "\n" not in message
    assert "model.pth" in message and "unexpected keys" in message


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_model_pth_is_one_line_naming_the_file(tmp_path: Path, damage: str) -> None:
    net = MLP(in_features=64, hidden=[8], num_classes=10)
    path = save_weights(net, write_run(tmp_path, NET) / "model.pth")
    data = path.read_bytes()
    path.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage": b"\x00" * 99, "empty": b""}[damage]
    )
    with pytest.raises(ProjectError) as info:
        load_network(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_load_network_maps_to_the_requested_device(tmp_path: Path) -> None:
    net = MLP(in_features=64, hidden=[8], num_classes=10)
    path = save_weights(net, write_run(tmp_path, NET) / "model.pth")
    loaded = load_network(path, device=torch.device("cpu"))
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device to map onto")
    assert {p.device.type for p in load_network(path, device="cuda").parameters()} == {"cuda"}


def test_trainer_gets_atomic_io_and_keeps_user_plugins() -> None:
    from lightning.pytorch.plugins.environments import LightningEnvironment

    env = LightningEnvironment()
    plugins = with_atomic_io([env])
    assert plugins[0] is env and isinstance(plugins[1], AtomicCheckpointIO)
    mine = AtomicCheckpointIO()
    assert with_atomic_io(mine) == [mine]  # a user's own CheckpointIO is not doubled
    assert isinstance(with_atomic_io(None)[0], AtomicCheckpointIO)


def test_build_trainer_uses_atomic_io() -> None:
    cfg = OmegaConf.create(
        {
            "seed": 1,
            "trainer": {
                "_target_": "lightning.pytorch.Trainer",
                "accelerator": "cpu",
                "devices": 1,
                "logger": False,
                "enable_progress_bar": False,
                "enable_model_summary": False,
            },
        }
    )
    trainer = builders.build_trainer(cfg)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)


def test_nothing_in_src_unpickles_with_weights_only_false() -> None:
    offenders = []
    for file in SRC.rglob("*.py"):
        text = file.read_text()
        if re.search(r"weights_only\s*=\s*False", text):
            offenders.append(str(file))
        for call in re.finditer(r"torch\.load\((?:[^()]|\([^()]*\))*\)", text):
            if "weights_only=True" not in call.group(0):
                offenders.append(f"{file}: {call.group(0)}")
    assert not offenders, offenders
