"""model.pth export and loading, the Trainer's checkpoint plugin, and no unsafe unpickling."""

from __future__ import annotations

import re
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TEMPLATE_TARGETS, CliRunner, last_line
from project.models.nets import MLP
from runkit.errors import RunError
from runkit.run import builders
from runkit.safety import checkpoints as checkpointing
from runkit.safety.checkpoints import (
    AtomicCheckpointIO,
    load_file,
    load_network,
    resolve_ckpt_path,
    save_weights,
)

SRC = Path(checkpointing.__file__).resolve().parent
CONFIGS = Path(__file__).resolve().parents[3] / "configs"
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
    loaded = load_network(path, device="cpu", allowed=TEMPLATE_TARGETS)
    assert not loaded.training
    for key, value in net.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_model_pth_of_another_architecture_is_one_line_with_the_keys(tmp_path: Path) -> None:
    other = MLP(in_features=64, hidden=[8, 4], num_classes=10)
    path = save_weights(other, write_run(tmp_path, NET) / "model.pth")
    with pytest.raises(RunError) as info:
        load_network(path, allowed=TEMPLATE_TARGETS)
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
    with pytest.raises(RunError) as info:
        load_network(path, allowed=TEMPLATE_TARGETS)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_load_network_maps_to_the_requested_device(tmp_path: Path) -> None:
    net = MLP(in_features=64, hidden=[8], num_classes=10)
    path = save_weights(net, write_run(tmp_path, NET) / "model.pth")
    loaded = load_network(path, device=torch.device("cpu"), allowed=TEMPLATE_TARGETS)
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device to map onto")
    assert {
        p.device.type
        for p in load_network(path, device="cuda", allowed=TEMPLATE_TARGETS).parameters()
    } == {"cuda"}


def test_build_trainer_uses_atomic_io() -> None:
    shipped = OmegaConf.load(CONFIGS / "trainer" / "default.yaml")  # where the plugin is set
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
                "plugins": shipped.plugins,
            },
        }
    )
    trainer = builders.build_trainer(cfg)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)


def test_nothing_in_src_unpickles_with_weights_only_false() -> None:
    offenders = []
    for file in SRC.rglob("*.py"):
        text = file.read_text()
        # weights_only=False on a load unpickles anything (save_checkpoint's means "all state")
        for line in text.splitlines():
            if re.search(r"weights_only\s*=\s*False", line) and "load" in line:
                offenders.append(f"{file}: {line.strip()}")
        for call in re.finditer(r"torch\.load\((?:[^()]|\([^()]*\))*\)", text):
            if "weights_only=True" not in call.group(0):
                offenders.append(f"{file}: {call.group(0)}")
    assert not offenders, offenders


# --------------------------------------------------------------------------- integrity on load


def change_one_tensor_byte(path: Path) -> None:
    """Flip one bit inside the first tensor record, as a bad disk sector or copy would."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 16)
    with path.open("r+b") as handle:
        handle.seek(info.header_offset)
        header = handle.read(30)
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        position = info.header_offset + 30 + name_length + extra_length + 5
        handle.seek(position)
        byte = handle.read(1)
        handle.seek(position)
        handle.write(bytes([byte[0] ^ 0x10]))


def test_model_pth_with_one_changed_bit_is_refused_in_one_line(tmp_path: Path) -> None:
    net = MLP(in_features=64, hidden=[8], num_classes=10)
    path = save_weights(net, write_run(tmp_path, NET) / "model.pth")
    change_one_tensor_byte(path)
    torch.load(path, weights_only=True)  # torch itself loads it without complaint
    with pytest.raises(RunError) as info:
        load_network(path, allowed=TEMPLATE_TARGETS)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert "damaged" in message and "CRC-32" in message


def test_checkpoint_with_one_changed_bit_is_refused_on_every_load_path(tmp_path: Path) -> None:
    path = tmp_path / "epoch_004.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.randn(64, 64)}}, path)
    change_one_tensor_byte(path)
    for load in (
        lambda: resolve_ckpt_path(str(path), tmp_path),  # train's ckpt_path=, eval's
        lambda: load_file(path),  # eval, load_network, the resume shape check
        lambda: AtomicCheckpointIO().load_checkpoint(path),  # Lightning's resume and test
    ):
        with pytest.raises(RunError, match=r"damaged.*CRC-32"):
            load()


def test_damaged_zip_structure_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "epoch_004.ckpt"
    AtomicCheckpointIO().save_checkpoint({"w": torch.randn(64)}, path)
    data = bytearray(path.read_bytes())
    directory = data.rfind(b"PK\x01\x02")  # a central directory record
    data[directory + 20 : directory + 24] = b"\xff\xff\xff\x7f"  # its compressed size
    path.write_bytes(bytes(data))
    with pytest.raises(RunError) as info:
        load_file(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("kind", ["plain", "without-crc", "legacy-format"])
def test_state_dicts_saved_by_plain_torch_elsewhere_still_load(tmp_path: Path, kind: str) -> None:
    net = MLP(in_features=64, hidden=[8], num_classes=10)
    path = write_run(tmp_path, NET) / "model.pth"
    if kind == "without-crc":
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(net.state_dict(), path)
        finally:
            torch.serialization.set_crc32_options(True)
    else:
        torch.save(net.state_dict(), path, _use_new_zipfile_serialization=kind == "plain")
    loaded = load_network(path, allowed=TEMPLATE_TARGETS)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in net.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("task", ["eval", "train"])
def test_cli_refuses_a_checkpoint_with_one_changed_bit(
    tmp_path: Path, cli: CliRunner, task: str
) -> None:
    path = tmp_path / "from a colleague" / "epoch_004.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.randn(64, 64)}}, path)
    change_one_tensor_byte(path)
    before = path.read_bytes()
    done = cli(task, f'ckpt_path="{path}"')  # logs under tmp_path/logs
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    line = last_line(done.stderr)
    assert line.startswith(f"error: {str(path)!r} is damaged: record ") and "CRC-32" in line
    assert path.read_bytes() == before and not (tmp_path / "logs").exists()
