"""Checkpoints and model.pth: saved crash-safe, loaded safely and verified, refused in one line."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import OmegaConf

from conftest import TEMPLATE_TARGETS, CliRunner, last_line
from tinyapp.models import MLP
from runkit.errors import RunError
from runkit.safety import checkpoints as checkpointing
from runkit.safety import writes
from runkit.safety.checkpoints import (
    AtomicCheckpointIO,
    CheckpointSaveError,
    exported_part,
    full_disk_in_one_line,
    last_good_checkpoint,
    load_file,
    load_network,
    network_state,
    resolve_ckpt_path,
    run_config,
    save_weights,
    state_mismatch,
    verify_archive,
)
from runkit.safety.writes import FileWriteError, atomic_link, atomic_write, remove_stale_temporaries

SRC = Path(checkpointing.__file__).resolve().parent
NET = {"_target_": "tinyapp.models.MLP", "in_features": 64, "hidden": [8], "num_classes": 10}
SMALL_NET = {"_target_": "tinyapp.models.MLP", "in_features": 4, "hidden": [3], "num_classes": 2}
DEAD = f".model.pth.{2**22 + 1}-{writes._HOST}-0badc0de.tmp"  # pid above pid_max


def raised(kind: type[BaseException], call: Any) -> Any:
    with pytest.raises(kind) as info:
        call()
    return info


def err(call: Any, kind: type[BaseException] = RunError) -> str:
    return str(raised(kind, call).value)


def refusal(path: Path, **kwargs: Any) -> str:
    return err(lambda: load_network(path, allowed=TEMPLATE_TARGETS, **kwargs))


def small_net() -> MLP:
    return MLP(in_features=4, hidden=[3], num_classes=2)


def equal(net: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(net.state_dict()[k], v) for k, v in state.items())


def aged(path: Path, seconds: float) -> Path:
    os.utime(path, (time.time() + seconds, time.time() + seconds))
    return path


def lightning_checkpoint(path: Path, net: torch.nn.Module, config: Any = None) -> Path:
    data: dict[str, Any] = {
        "pytorch-lightning_version": "2.6.0",
        "epoch": 3,
        "state_dict": {f"net.{k}": v for k, v in net.state_dict().items()},
    }
    data["state_dict"]["criterion.weight"] = torch.ones(2)  # another submodule: not the net's
    if config is not None:
        data["hyper_parameters"] = {"config": config}
    AtomicCheckpointIO().save_checkpoint(data, path)
    return path


def touch_marker(path: str) -> str:
    Path(path).touch()
    return path


class Hostile:
    """Unpickles as a call to :func:`touch_marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (touch_marker, (self.marker,))


def change_one_tensor_byte(path: Path) -> str:
    """Flip one bit inside the first tensor record, as a bad disk sector or copy would."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 16)
    with path.open("r+b") as handle:
        handle.seek(info.header_offset)
        name_length, extra_length = struct.unpack("<HH", handle.read(30)[26:30])
        position = info.header_offset + 30 + name_length + extra_length + 5
        handle.seek(position)
        byte = handle.read(1)
        handle.seek(position)
        handle.write(bytes([byte[0] ^ 0x10]))
    return info.filename


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "Ordner mit Ümläut"
    path.mkdir()
    return path


def case(base: Path, name: str) -> Path:
    (base / name).mkdir()
    return base / name


@pytest.mark.parametrize("kind", ["ours", "plain", "without-crc", "legacy-format"])
def test_model_pth_is_a_plain_state_dict_that_loads_back_equal(tmp_path: Path, kind: str) -> None:
    net = MLP(in_features=64, hidden=[8], num_classes=10)
    OmegaConf.save({"model": {"net": NET}}, tmp_path / "config.yaml")
    path = tmp_path / "model.pth"
    if kind == "ours":
        save_weights(net, path)
    else:
        torch.serialization.set_crc32_options(kind != "without-crc")
        try:
            torch.save(
                net.state_dict(), path, _use_new_zipfile_serialization=kind != "legacy-format"
            )
        finally:
            torch.serialization.set_crc32_options(True)
    assert set(torch.load(path, weights_only=True)) == set(net.state_dict())
    loaded = load_network(path, device=torch.device("cpu"), allowed=TEMPLATE_TARGETS)
    assert not loaded.training and {p.device.type for p in loaded.parameters()} == {"cpu"}
    assert equal(loaded, net.state_dict())
    if torch.cuda.is_available():
        on_gpu = load_network(path, device="cuda", allowed=TEMPLATE_TARGETS)
        assert {p.device.type for p in on_gpu.parameters()} == {"cuda"}


UNREADABLE = "is not a readable checkpoint or state_dict (truncated or corrupt?): "


@pytest.mark.parametrize(
    ("damage", "expected"),
    [("another-architecture", "unexpected keys"), ("truncated", UNREADABLE), ("garbage", UNREADABLE),
     ("empty", "is an empty file"), ("one-changed-bit", "is damaged: record ")],
)  # fmt: skip
def test_a_wrong_or_damaged_model_pth_is_one_line_naming_the_file(
    tmp_path: Path, damage: str, expected: str
) -> None:
    hidden = [8, 4] if damage == "another-architecture" else [8]
    OmegaConf.save({"model": {"net": NET}}, tmp_path / "config.yaml")
    path = save_weights(MLP(in_features=64, hidden=hidden, num_classes=10), tmp_path / "model.pth")
    data = path.read_bytes()
    if damage == "one-changed-bit":
        change_one_tensor_byte(path)
        torch.load(path, weights_only=True)  # torch itself loads it without complaint
    elif damage != "another-architecture":
        path.write_bytes(
            {"truncated": data[: len(data) // 2], "garbage": b"\x00" * 99, "empty": b""}[damage]
        )
    message = refusal(path)
    assert "\n" not in message and str(path) in message and expected in message


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


@pytest.mark.slow
def test_cli_refuses_a_checkpoint_with_one_changed_bit(tmp_path: Path, cli: CliRunner) -> None:
    path = tmp_path / "from a colleague" / "epoch_004.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.randn(64, 64)}}, path)
    change_one_tensor_byte(path)
    before = path.read_bytes()
    done = cli("train", f'ckpt_path="{path}"')  # logs under tmp_path/logs
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    line = last_line(done.stderr)
    assert line.startswith(f"error: {str(path)!r} is damaged: record ") and "CRC-32" in line
    assert path.read_bytes() == before and not (tmp_path / "logs").exists()


def test_checkpoint_io_never_unpickles_code_by_default_even_if_torch_is_told_to(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = folder / "marker"
    path = folder / "given.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {}, "payload": Hostile(marker)}, path)
    legacy = folder / "legacy.pth"
    torch.save(
        {"w": torch.ones(1), "x": Hostile(marker)}, legacy, _use_new_zipfile_serialization=False
    )
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(Exception, match="Weights only load failed"):
        AtomicCheckpointIO().load_checkpoint(path)
    with pytest.raises(RunError):
        load_file(path)
    with pytest.raises(RunError, match="is not a readable checkpoint or state_dict"):
        load_file(legacy, mmap=True)  # a legacy file read for its shapes
    assert not marker.exists()
    loaded = AtomicCheckpointIO().load_checkpoint(path, weights_only=False)
    assert loaded["payload"] == str(marker) and marker.exists()


PASS = "pass a .ckpt file, a model.pth, a run directory or 'last'"


@pytest.mark.parametrize(
    ("make", "typed", "expected"),
    [
        pytest.param(None, "nowhere.ckpt", "{path} does not exist; " + PASS, id="missing"),
        pytest.param(b"", "given.ckpt", "{path} is an empty file; expected a checkpoint", id="empty"),
        pytest.param(b"P", "given.ckpt", "{path} is not a complete torch checkpoint (truncated, or another kind of file)", id="one-byte"),
        pytest.param("dir", "", "{path} is a directory without checkpoints/last.ckpt or any other .ckpt file; " + PASS, id="no-checkpoint-in-dir"),
    ],
)  # fmt: skip
def test_resolve_ckpt_path_refuses_in_one_line(
    folder: Path, make: Any, typed: str, expected: str
) -> None:
    path = folder / typed if typed else folder
    if isinstance(make, bytes):
        path.write_bytes(make)
    elif make == "dir":
        (folder / "checkpoints").mkdir()
        (folder / "checkpoints" / "notes.txt").write_text("not a checkpoint")
    message = err(lambda: resolve_ckpt_path(str(path), folder))
    assert message == expected.format(path=f"ckpt_path={str(path)!r}")


def test_resolve_ckpt_path_a_file_is_returned_absolute(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = lightning_checkpoint(folder / "weights.ckpt", small_net())
    monkeypatch.chdir(folder)
    assert resolve_ckpt_path("weights.ckpt", "logs") == path.resolve()
    assert resolve_ckpt_path(str(path), "logs") == path.resolve()
    message = err(lambda: resolve_ckpt_path("nowhere.ckpt", "logs"))
    assert message.startswith(f"ckpt_path={str(folder / 'nowhere.ckpt')!r} (typed 'nowhere.ckpt') ")
    assert resolve_ckpt_path(None, folder) is None and resolve_ckpt_path("", folder) is None
    lightning_checkpoint(folder / "train" / "runs" / "1" / "checkpoints" / "last.ckpt", small_net())
    assert err(lambda: resolve_ckpt_path("last", folder, "eval")) == (
        f"ckpt_path=last found no checkpoints/last.ckpt under {folder / 'eval'}; "
        "pass a .ckpt file or a run directory"
    )
    assert str(FileWriteError("p", "q")) == "p; q" and str(FileWriteError("p")) == "p"


def test_resolve_ckpt_path_of_a_run_or_last(folder: Path) -> None:
    nested = lightning_checkpoint(folder / "run a" / "checkpoints" / "last.ckpt", small_net())
    assert resolve_ckpt_path(str(folder / "run a"), folder) == nested.resolve()
    flat = lightning_checkpoint(folder / "run b" / "last.ckpt", small_net())
    aged(lightning_checkpoint(folder / "run b" / "epoch_009.ckpt", small_net()), 60)
    assert resolve_ckpt_path(str(folder / "run b"), folder) == flat.resolve()
    lightning_checkpoint(folder / "run a" / "last.ckpt", small_net())
    assert resolve_ckpt_path(str(folder / "run a"), folder) == nested.resolve()
    runs = folder / "train" / "runs"
    older = lightning_checkpoint(runs / "1" / "checkpoints" / "last.ckpt", small_net())
    newer = lightning_checkpoint(runs / "2" / "checkpoints" / "last.ckpt", small_net())
    aged(older, 60)  # the newest by time, not by name
    assert resolve_ckpt_path("last", folder) == older.resolve()
    aged(newer, 120)
    assert resolve_ckpt_path("last", folder) == newer.resolve()
    sweep = folder / "train" / "multiruns" / "s" / "0" / "checkpoints"
    in_sweep = aged(lightning_checkpoint(sweep / "last.ckpt", small_net()), 180)
    assert resolve_ckpt_path("last", folder) == in_sweep.resolve()


def test_resolve_ckpt_path_of_a_run_without_last_ckpt_or_for_eval(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = folder / "stopped run"
    interrupted = lightning_checkpoint(run / "checkpoints" / "interrupted.ckpt", small_net())
    aged(lightning_checkpoint(run / "checkpoints" / "z_epoch_000.ckpt", small_net()), -60)
    with caplog.at_level(logging.INFO):
        assert resolve_ckpt_path(str(run), folder) == interrupted.resolve()
    assert caplog.messages == [
        f"ckpt_path={run} has no last.ckpt: using its newest checkpoint, interrupted.ckpt"
    ]
    caplog.clear()
    run = folder / "run"
    last = lightning_checkpoint(run / "checkpoints" / "last.ckpt", small_net())
    with caplog.at_level(logging.INFO):
        assert resolve_ckpt_path(str(run), folder, tested_weights=True) == last.resolve()
        assert caplog.messages == []
        weights = save_weights(small_net(), run / "model.pth")
        assert resolve_ckpt_path(str(run), folder, tested_weights=True) == weights.resolve()
    assert caplog.messages == [f"ckpt_path={run}: using its model.pth (the weights it tested)"]
    assert resolve_ckpt_path(str(run), folder) == last.resolve()  # resuming: the training state


def fails(error: BaseException) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise error

    return call


def test_load_file_reads_state_dicts_and_refuses_anything_else_in_one_line(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for given, what in ((folder / "nowhere.pth", "does not exist"), (folder, "is a directory")):
        assert err(lambda g=given: load_file(g)).startswith(f"ckpt_path={str(given)!r} {what}")
    path = folder / "given.pth"
    torch.save([torch.ones(2)], path)
    assert err(lambda: load_file(path)) == f"{str(path)!r} holds a list, not a state_dict"
    path = save_weights(small_net(), folder / "model.pth")
    mapped, read = load_file(path, mmap=True), load_file(path)
    assert mapped.keys() == read.keys() and all(torch.equal(mapped[k], read[k]) for k in read)
    legacy = folder / "legacy.pth"
    torch.save(small_net().state_dict(), legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(RuntimeError):
        torch.load(legacy, weights_only=True, mmap=True)
    assert load_file(legacy, mmap=True).keys() == small_net().state_dict().keys()
    assert err(lambda: verify_archive(folder / "nowhere.pth")) == (
        f"cannot read {str(folder / 'nowhere.pth')!r}: No such file or directory"
    )
    data = bytearray(path.read_bytes())
    directory = data.find(b"PK\x01\x02")  # the central directory's first record
    data[directory : directory + 4] = b"XXXX"
    path.write_bytes(bytes(data))
    assert err(lambda: verify_archive(path)) == (
        f"{str(path)!r} is damaged: its archive structure cannot be read "
        "(Bad magic number for central directory)"
    )
    path = save_weights(small_net(), folder / "model.pth")
    monkeypatch.setattr(torch, "load", fails(EOFError()))
    assert err(lambda: load_file(path)) == f"{str(path)!r} {UNREADABLE}EOFError"
    monkeypatch.setattr(torch, "load", fails(ValueError("  first line\nsecond line")))
    message = err(lambda: load_file(path, mmap=True))  # not a RuntimeError: no retry
    assert message.endswith("(truncated or corrupt?): first line")


def test_network_state_is_the_nets_tensors_or_one_line(folder: Path) -> None:
    net = small_net()
    state = network_state(load_file(lightning_checkpoint(folder / "given.ckpt", net)))
    assert state.keys() == net.state_dict().keys()  # criterion.weight and net. are gone
    assert equal(net, state)
    plain = {"net.layer": torch.ones(1), "state_dict": torch.zeros(1)}  # names, not a checkpoint
    assert network_state(plain) is plain
    half = {"state_dict": {"net.w": torch.ones(1)}}  # no Lightning version: not a checkpoint
    with pytest.raises(RunError, match="'state_dict' is not a tensor"):
        network_state(half)
    bad = {"pytorch-lightning_version": "2.6.0", "state_dict": [1, 2]}
    assert err(lambda: network_state(bad, folder / "given.ckpt")) == (
        f"{str(folder / 'given.ckpt')!r} has a state_dict that is not a dict"
    )
    assert err(lambda: network_state({"k" * 100: 3}, "given.pth")) == (
        f"'given.pth' is not a network's state_dict: {'k' * 60!r} is not a tensor"
    )
    assert err(lambda: network_state({"w": 1})) == (
        "'' is not a network's state_dict: 'w' is not a tensor"
    )
    path = folder / "other.ckpt"
    data = {
        "pytorch-lightning_version": "2.6.0",
        "state_dict": {"net.layer": 3},
        "hyper_parameters": {"config": {"model": {"net": SMALL_NET}}},
    }
    AtomicCheckpointIO().save_checkpoint(data, path)
    assert refusal(path) == f"{str(path)!r} is not a network's state_dict: 'layer' is not a tensor"


def test_load_network_rebuilds_from_the_saved_or_given_config(folder: Path) -> None:
    net = small_net()
    path = lightning_checkpoint(folder / "given.ckpt", net, config={"model": {"net": SMALL_NET}})
    ignored = {"model": {"net": {**SMALL_NET, "hidden": [5]}}}
    OmegaConf.save(ignored, folder / "config.yaml")
    loaded = load_network(path, allowed=TEMPLATE_TARGETS)
    assert isinstance(loaded, MLP) and not loaded.training and equal(loaded, net.state_dict())
    OmegaConf.save({"model": {"net": SMALL_NET}}, folder / "config.yaml")
    up = lightning_checkpoint(folder / "checkpoints" / "last.ckpt", net)
    assert isinstance(load_network(up, allowed=TEMPLATE_TARGETS), MLP)
    beside = save_weights(net, folder / "model.pth")
    assert isinstance(load_network(beside, allowed=TEMPLATE_TARGETS), MLP)
    alone = save_weights(net, case(folder, "alone") / "model.pth")
    assert equal(load_network(alone, net_config=SMALL_NET), net.state_dict())


class Regressor(torch.nn.Module):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, width)
        self.head = torch.nn.Linear(width, 1)


class Built(pl.LightningModule):  # its layer made in configure_model, from a list argument
    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.sizes, self.layer = sizes, None

    def configure_model(self) -> None:
        if self.layer is None:
            self.layer = torch.nn.Linear(*self.sizes)


def test_load_network_rebuilds_a_model_without_net_and_loads_the_part_it_exported(
    folder: Path,
) -> None:
    trained = Regressor(width=5)
    config = {"model": {"_target_": f"{__name__}.Regressor", "width": 5}}
    data = {
        "pytorch-lightning_version": "2.6.0",
        "state_dict": dict(trained.state_dict()),
        "hyper_parameters": {"config": config},
    }
    path = folder / "given.ckpt"
    AtomicCheckpointIO().save_checkpoint(data, path)
    loaded = load_network(path, allowed=[__name__ + "."])
    assert isinstance(loaded, Regressor) and not loaded.training
    assert equal(loaded, trained.state_dict())
    OmegaConf.save(config, folder / "config.yaml")
    weights = save_weights(exported_part(trained), folder / "model.pth")
    parts = {"body.weight", "body.bias", "head.weight", "head.bias"}
    assert set(torch.load(weights, weights_only=True)) == parts
    assert equal(load_network(weights, allowed=[__name__ + "."]), trained.state_dict())
    trained, whole = small_net(), torch.nn.Module()
    whole.net = small_net()
    path = lightning_checkpoint(folder / "net.ckpt", trained)
    part = checkpointing.load_exported_weights(whole, load_file(path), path)
    assert part is whole.net and equal(part, trained.state_dict())
    for data, start in (({"w": 1}, "is not a network's"), ({"w": torch.ones(1)}, "does not fit")):
        message = err(lambda d=data: checkpointing.load_exported_weights(small_net(), d, "x.pth"))
        assert message.startswith(f"'x.pth' {start}")
    assert exported_part(whole) is whole.net
    whole.head = torch.nn.Linear(2, 1)
    assert exported_part(whole) is whole
    assert exported_part(small_net()).__class__ is MLP
    config = {"_target_": f"{__name__}.Built", "sizes": [2, 3], "compile": 1, "channels_last": 1}
    model = checkpointing.rebuild_model(config)
    assert type(model.sizes) is list and model.layer.out_features == 3


def parse_error(text: str) -> str:
    try:
        OmegaConf.create(text)
    except Exception as error:
        return " ".join(str(error).split())
    raise AssertionError(text)


@pytest.mark.parametrize(
    ("inside", "text", "expected"),
    [
        pytest.param({"data": {}}, None, "{path} has no model config to rebuild it from", id="no-model"),
        pytest.param({"model": "mlp"}, None, "{path} has no model config to rebuild it from", id="model-not-a-node"),
        pytest.param({"model": {"net": "MLP"}}, None, "{path}: its run config has neither a model.net nor a model._target_ to rebuild the model from", id="net-not-a-node"),
        pytest.param(None, "model: {net: {_target_: x}}\ny: &a 1\nz: *a\n", "{config} uses a YAML alias; configs saved by a run do not", id="alias"),
        pytest.param(None, "- a\n", "{config} is not a run config (a YAML mapping)", id="list"),
        pytest.param(None, "model: [\n", "cannot read {config} as a run config: " + parse_error("model: [\n"), id="broken"),
        pytest.param(None, "model:\n  net:\n    _target_: tinyapp.models.MLP\n    in_features: ${oc.env:HOME}\n", "{config} holds an interpolation at model.net.in_features ('${{oc.env:HOME}}'); configs saved by a run are resolved, so this file was edited or crafted", id="interpolation"),
        pytest.param(None, None, "cannot rebuild the network for {path}: no config inside it and no config.yaml beside it; pass the network config with model=...", id="no-config"),
    ],
)  # fmt: skip
def test_a_run_config_that_cannot_rebuild_the_network_is_one_line(
    folder: Path, inside: Any, text: str | None, expected: str
) -> None:
    if inside is None:
        path = save_weights(small_net(), folder / "model.pth")
    else:
        path = lightning_checkpoint(folder / "given.ckpt", small_net(), config=inside)
    if text is not None:
        (folder / "config.yaml").write_text(text, encoding="utf-8")
    config = repr(str(folder / "config.yaml"))
    assert refusal(path) == expected.format(path=repr(str(path)), config=config)


def test_an_unreadable_config_yaml_gives_the_parsers_reason(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_weights(small_net(), folder / "model.pth")
    config = folder / "config.yaml"
    config.write_text("model: {}\n", encoding="utf-8")  # YAML fine; OmegaConf then fails
    monkeypatch.setattr(OmegaConf, "create", fails(ValueError("")))
    assert refusal(path) == f"cannot read {str(config)!r} as a run config: ValueError"
    monkeypatch.setattr(OmegaConf, "create", fails(ValueError("word " * 100)))
    expected = f"cannot read {str(config)!r} as a run config: " + ("word " * 40)[:200]
    assert refusal(path) == expected


def test_run_config_is_model_and_data_checked_against_the_allow_list(folder: Path) -> None:
    config = {"model": {"net": SMALL_NET}, "data": {"batch_size": 4}, "paths": {"log_dir": "x"}}
    path = lightning_checkpoint(folder / "given.ckpt", small_net(), config=config)
    wanted = {"model": {"net": SMALL_NET}, "data": {"batch_size": 4}}
    assert run_config(path, load_file(path), TEMPLATE_TARGETS) == wanted
    data = {"hyper_parameters": None, **load_file(path)}
    assert run_config(path, data, TEMPLATE_TARGETS) == wanted
    OmegaConf.save({"model": {"net": SMALL_NET}}, folder / "config.yaml")
    plain = {"hyper_parameters": {"config": "text"}}
    assert run_config(path, plain, TEMPLATE_TARGETS) == {"model": {"net": SMALL_NET}}
    path = case(folder, "1") / "given.ckpt"
    lightning_checkpoint(path, small_net(), config={"model": {"net": SMALL_NET}})
    with pytest.raises(RunError, match=r"not under the trusted targets \[torch\.nn\.\]"):
        run_config(path, load_file(path), allowed=["torch.nn."])
    assert run_config(path, load_file(path), allowed=["tinyapp.models.MLP"])
    for needs in (("model", "data"), ("data", "model")):
        assert err(lambda n=needs: run_config(path, load_file(path), needs=n)) == (
            f"{str(path)!r} has no data config to rebuild it from"
        )


def test_a_state_of_another_architecture_is_named_by_its_keys() -> None:
    expected = {f"k{i}": torch.zeros(1) for i in range(7)}
    assert state_mismatch(expected, dict(expected)) is None
    assert state_mismatch(expected, {}) == "missing keys: k0, k1, k2, k3, k4, k5 ..."
    six = {f"k{i}": torch.zeros(1) for i in range(6)}
    assert state_mismatch(six, {}) == "missing keys: k0, k1, k2, k3, k4, k5"
    other = {"k0": torch.zeros(2), "x": torch.zeros(1), **{f"k{i}": torch.zeros(1) for i in range(1, 7)}}  # fmt: skip
    assert state_mismatch(expected, other) == "unexpected keys: x; shape mismatch: k0"
    extra = {"k": torch.zeros(1), "x": torch.zeros(1)}
    assert state_mismatch({"k": torch.zeros(1)}, extra, built_later=True) is None
    net = small_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    wrong = {k: torch.zeros(v.shape[::-1]) for k, v in before.items()}
    message = err(lambda: checkpointing.load_state_into(net, wrong, "given.pth"))
    assert message.startswith("'given.pth' does not fit MLP: shape mismatch: ")
    assert equal(net, before)


def test_a_load_state_dict_error_is_one_line_naming_the_file_it_stands_for(folder: Path) -> None:
    net = small_net()
    wrong = {"layers.0.weight": torch.zeros(1)}
    path = checkpointing.as_lightning_checkpoint(wrong, folder / "model.pth")
    assert path.name.startswith("weights-") and path.suffix == ".ckpt"
    assert network_state(load_file(path), path, "").keys() == wrong.keys()
    explain = checkpointing.explain_load_failure
    trainer = SimpleNamespace(ckpt_path=str(path), lightning_module=net)
    error = RuntimeError("Error(s) in loading state_dict for MLP: ...")
    assert str(explain(trainer, error)).startswith(
        f"{str(folder / 'model.pth')!r} does not fit MLP as set up (after setup() and "
        "configure_model): missing keys: "
    )
    assert explain(trainer, ValueError("state_dict")) is None
    assert explain(trainer, RuntimeError("other")) is None
    same = checkpointing.as_lightning_checkpoint(net.state_dict(), folder / "model.pth")
    assert explain(SimpleNamespace(ckpt_path=str(same), lightning_module=net), error) is None
    assert explain(SimpleNamespace(ckpt_path=None), error) is None
    assert explain(object(), error) is None
    plain = folder / "plain.ckpt"
    torch.save({"state_dict": wrong}, plain)
    explained = explain(SimpleNamespace(ckpt_path=str(plain), lightning_module=net), error)
    assert str(explained).startswith(f"{str(plain)!r} does not fit MLP as set up")
    gone = SimpleNamespace(ckpt_path=str(folder / "nowhere.ckpt"), lightning_module=net)
    assert explain(gone, error) is None


def full_disk(handle: Any) -> None:
    handle.write(b"PK\x03\x04 partial")
    raise OSError(errno.ENOSPC, "No space left on device")


FULL = "the disk is full: could not write {t} (No space left on device); "


@pytest.mark.parametrize(
    ("write", "before", "expected"),
    [
        pytest.param(full_disk, None, FULL + "nothing was written", id="full-new"),
        pytest.param(full_disk, b"old", FULL + "its previous version is unchanged", id="full-old"),
        pytest.param(fails(PermissionError(errno.EACCES, "Permission denied")), None, "could not write {t}: Permission denied; nothing was written", id="permission"),
        pytest.param(fails(OSError("quota of the group reached")), None, "could not write {t}: quota of the group reached; nothing was written", id="bare"),
        pytest.param(fails(OSError()), None, "could not write {t}: OSError; nothing was written", id="silent"),
    ],
)  # fmt: skip
def test_atomic_write_leaves_the_old_file_or_nothing_and_says_why(
    folder: Path, write: Any, before: bytes | None, expected: str
) -> None:
    target = folder / "model.pth"
    if before:
        target.write_bytes(before)
    info = raised(FileWriteError, lambda: atomic_write(target, write))
    message = str(info.value)
    assert message == expected.format(t=repr(str(target)))
    assert info.value.problem == message.rsplit("; ", 1)[0]
    assert isinstance(info.value.__cause__, OSError)
    assert list(folder.iterdir()) == ([target] if before else [])
    assert not before or target.read_bytes() == before


def test_atomic_write_makes_its_folder_and_names_the_os_error_behind_a_failure(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = folder / "new dir" / "model.pth"
    atomic_write(target, lambda handle: handle.write(b"bytes"))
    assert target.read_bytes() == b"bytes"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.pth"]

    def bug(handle: Any) -> None:
        handle.write(b"some")
        raise KeyError("a bug in the writer")

    bare = case(folder, "bare")
    with pytest.raises(KeyError, match="a bug in the writer"):
        atomic_write(bare / "model.pth", bug)
    assert list(bare.iterdir()) == []
    (folder / "plain file").write_text("x")
    target = folder / "plain file" / "model.pth"
    message = err(lambda: atomic_write(target, lambda handle: handle.write(b"x")), FileWriteError)
    assert message.startswith(f"could not write {str(target)!r}: ")
    assert message.endswith("; nothing was written")
    elsewhere = case(tmp_path, "cwd")
    monkeypatch.chdir(elsewhere)
    (bare / DEAD).write_bytes(b"half")
    (elsewhere / DEAD).write_bytes(b"half")
    atomic_write(bare / "model.pth", lambda handle: handle.write(b"x"))
    assert sorted(p.name for p in bare.iterdir()) == ["model.pth"]
    assert (elsewhere / DEAD).exists()  # not the target's folder: not looked at

    def like_torch_save(handle: Any) -> None:  # an opaque RuntimeError for the write's OSError
        try:
            handle.write(b"x")
        except OSError:
            raise RuntimeError("unexpected pos") from None

    class OverQuota:
        def __init__(self, raw: Any) -> None:
            self.raw = raw

        def __getattr__(self, name: str) -> Any:
            return getattr(self.raw, name)

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            self.raw.close()

        def write(self, data: bytes) -> int:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

    fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: OverQuota(fdopen(fd, mode)))
    message = err(lambda: atomic_write(bare / "model.pth", like_torch_save), FileWriteError)
    assert message.startswith("the disk is full: could not write ")
    assert "(Disk quota exceeded)" in message
    monkeypatch.setattr(os, "fdopen", fails(KeyboardInterrupt()))
    empty = case(folder, "interrupted")
    with pytest.raises(KeyboardInterrupt):  # while opening the temporary file
        atomic_write(empty / "model.pth", lambda handle: handle.write(b"x"))
    assert list(empty.iterdir()) == []
    monkeypatch.setattr(os, "open", fails(PermissionError(errno.EACCES, "Permission denied")))
    message = err(lambda: atomic_write(bare / "model.pth", lambda handle: None), FileWriteError)
    assert message == (
        f"could not write {str(bare / 'model.pth')!r}: Permission denied; "
        "its previous version is unchanged"
    )


def test_only_dead_writers_leftovers_are_removed(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = ".model.pth.{pid}-{host}-0badc0de.tmp"
    host = writes._HOST
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    own = folder / name.format(pid=os.getpid(), host=host)
    parent = folder / name.format(pid=writer.pid, host=host)
    dead = folder / DEAD
    foreign_fresh = folder / name.format(pid=7, host="0000000f")
    foreign_old = folder / name.format(pid=8, host="0000000f")
    a_dir = folder / name.format(pid=2**22 + 2, host=host)  # a sharded save's staging directory
    for path in (own, parent, dead, foreign_fresh, foreign_old):
        path.write_bytes(b"half")
    a_dir.mkdir()
    (a_dir / "__0_0.distcp").write_bytes(b"half")
    live_dir = folder / name.format(pid=writer.pid, host=host).replace(".model", ".last")
    live_dir.mkdir()
    aged(foreign_old, -24 * 3600 - 60)
    aged(foreign_fresh, -24 * 3600 + 60)
    (folder / "epoch_000.ckpt").write_bytes(b"x")
    real_scandir = os.scandir

    def other_files_first(path: Any) -> Any:  # passed over: the scan goes on
        entries = real_scandir(path)
        return sorted(entries, key=lambda e: e.name.endswith(".tmp")) if path == folder else entries

    with monkeypatch.context() as patch:
        patch.setattr(os, "scandir", other_files_first)
        try:
            removed = remove_stale_temporaries(folder)
        finally:
            writer.kill()
            writer.wait()
    assert writer.returncode == -signal.SIGKILL  # looked at, not signalled
    assert sorted(removed) == sorted([dead, foreign_old, a_dir])
    assert own.exists() and parent.exists() and foreign_fresh.exists() and live_dir.is_dir()
    assert (folder / "epoch_000.ckpt").exists()
    assert remove_stale_temporaries(folder / "missing") == []
    links = case(folder, "links")
    (links / "keep.bin").write_bytes(b"x")
    (links / DEAD).symlink_to(links / "keep.bin")
    assert remove_stale_temporaries(links) == []
    assert (links / DEAD).is_symlink() and (links / "keep.bin").exists()
    racing = case(folder, "racing")
    leftovers = (racing / DEAD, racing / ".model.pth.7-0000000f-0badc0de.tmp")

    def scandir(path: Any) -> Any:
        entries = list(real_scandir(path))
        for leftover in leftovers:
            leftover.unlink(missing_ok=True)  # another writer removes them meanwhile
        return iter(entries)

    for leftover in leftovers:
        leftover.write_bytes(b"half")
    monkeypatch.setattr(os, "scandir", scandir)
    assert remove_stale_temporaries(racing) == []
    monkeypatch.setattr(os, "kill", fails(PermissionError(errno.EPERM, "Operation not permitted")))
    (racing / DEAD).write_bytes(b"half")
    assert remove_stale_temporaries(racing) == []  # another user's process: alive, file kept


def test_atomic_link_makes_a_second_name_of_the_same_bytes_or_a_copy(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = folder / "epoch_003.ckpt"
    source.write_bytes(b"weights")
    target = folder / "sub dir" / "last.ckpt"
    target.parent.mkdir()
    target.write_bytes(b"old")
    atomic_link(source, target)
    assert target.read_bytes() == b"weights" and os.path.samefile(source, target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]
    target = folder / "a" / "b" / "last.ckpt"
    target.parent.mkdir(parents=True)
    (target.parent / DEAD.replace(".model.pth", ".last.ckpt")).write_bytes(b"half")
    atomic_link(source, target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]
    deeper = folder / "c" / "d" / "last.ckpt"
    atomic_link(source, deeper)
    assert deeper.read_bytes() == b"weights"
    copies = case(folder, "copies")
    source = copies / "epoch_003.ckpt"
    source.write_bytes(b"weights" * 1000)
    monkeypatch.setattr(os, "link", fails(OSError(errno.EPERM, "Operation not permitted")))
    atomic_link(source, copies / "last.ckpt")
    assert (copies / "last.ckpt").read_bytes() == source.read_bytes()
    assert not os.path.samefile(source, copies / "last.ckpt")
    assert sorted(p.name for p in copies.iterdir()) == ["epoch_003.ckpt", "last.ckpt"]


@pytest.mark.parametrize("existing", [False, True])
def test_atomic_link_that_cannot_rename_is_one_line(
    folder: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    source = folder / "epoch_003.ckpt"
    source.write_bytes(b"weights")
    target = folder / "last.ckpt"
    if existing:
        target.write_bytes(b"old")
    monkeypatch.setattr(os, "replace", fails(OSError(errno.ENOSPC, "No space left on device")))
    outcome = "its previous version is unchanged" if existing else "nothing was written"
    assert err(lambda: atomic_link(source, target), FileWriteError) == (
        FULL.format(t=repr(str(target))) + outcome
    )
    assert sorted(p.name for p in folder.iterdir()) == ["epoch_003.ckpt"] + ["last.ckpt"] * existing
    assert not existing or target.read_bytes() == b"old"


def test_atomic_link_into_a_folder_deleted_meanwhile_is_one_line(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, run = folder / "epoch_003.ckpt", folder / "run"
    source.write_bytes(b"weights")
    run.mkdir()
    rename = os.replace

    def deleted_first(src: Any, dst: Any) -> None:  # the run folder goes between link and rename
        shutil.rmtree(run)
        rename(src, dst)

    monkeypatch.setattr(os, "replace", deleted_first)
    target = run / "last.ckpt"
    assert err(lambda: atomic_link(source, target), FileWriteError) == (
        f"could not write {str(target)!r}: No such file or directory; nothing was written"
    )


def test_a_full_disk_is_one_line_naming_the_last_good_checkpoint(folder: Path) -> None:
    assert last_good_checkpoint(folder) == "no checkpoint was kept before it"
    (folder / "notes.txt").write_text("x")
    (folder / "dir.ckpt").mkdir()
    assert last_good_checkpoint(folder) == "no checkpoint was kept before it"
    old, new = folder / "epoch_001.ckpt", folder / "epoch_000.ckpt"
    for age, path in ((100, old), (10, new)):
        path.write_bytes(b"x")
        aged(path, -age)
    assert last_good_checkpoint(folder) == f"the last good checkpoint is {str(new)!r}"
    assert last_good_checkpoint(folder, prefer=old) == f"the last good checkpoint is {str(old)!r}"
    missing = folder / "last.ckpt"
    assert (
        last_good_checkpoint(folder, prefer=missing) == f"the last good checkpoint is {str(new)!r}"
    )
    run = folder / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileWriteError) as info, full_disk_in_one_line(run):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert str(info.value) == (
        f"the disk is full: could not write the run's files in {str(run)!r} "
        "(No space left on device); no checkpoint of this run was kept"
    )
    older, newer = run / "checkpoints" / "a.ckpt", run / "checkpoints" / "b.ckpt"
    for age, path in ((10, older), (100, newer)):
        path.write_bytes(b"x")
        aged(path, -age)
    csv = run / "metrics.csv"
    with pytest.raises(FileWriteError) as info, full_disk_in_one_line(run):
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", str(csv))
        except OSError as error:
            raise RuntimeError("a logger failed") from error
    assert str(info.value) == (
        f"the disk is full: could not write the run's files in {str(csv)!r} "
        f"(Disk quota exceeded); the last good checkpoint is {str(older)!r}"
    )


def test_a_full_disk_keeps_the_first_error(folder: Path) -> None:
    with pytest.raises(ValueError, match="not about the disk"), full_disk_in_one_line(folder):
        raise ValueError("not about the disk")
    with pytest.raises(PermissionError), full_disk_in_one_line(folder):
        raise PermissionError(errno.EACCES, "Permission denied")
    ours = FileWriteError(f"could not write {str(folder / 'model.pth')!r}: Permission denied")
    with pytest.raises(FileWriteError) as info, full_disk_in_one_line(folder):
        raise RuntimeError("wrapped") from ours
    assert str(info.value) == (
        f"could not write {str(folder / 'model.pth')!r}: Permission denied; "
        "no checkpoint of this run was kept"
    )
    first = CheckpointSaveError("could not write checkpoint 'x'", "no checkpoint")
    with pytest.raises(CheckpointSaveError) as info, full_disk_in_one_line(folder):
        try:
            raise first
        except CheckpointSaveError:
            raise OSError(errno.ENOSPC, "No space left on device") from None
    assert info.value is first


@pytest.mark.parametrize("same", [False, True])
def test_a_failed_checkpoint_save_names_the_checkpoint_and_what_remains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, same: bool
) -> None:
    """The target itself if it exists, else the newest; "checkpoint" said once ("write" below)."""
    folder = tmp_path / "notes to write up"
    kept = folder / ("last.ckpt" if same else "epoch_000.ckpt")
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(1)}, kept)
    if same:
        AtomicCheckpointIO().save_checkpoint({"w": torch.ones(1)}, folder / "epoch_009.ckpt")
        aged(folder / "epoch_009.ckpt", 60)
    monkeypatch.setattr(torch, "save", fails(OSError(errno.ENOSPC, "No space left on device")))
    target = kept if same else folder / "epoch_001.ckpt"
    info = raised(
        CheckpointSaveError,
        lambda: AtomicCheckpointIO().save_checkpoint({"w": torch.ones(2)}, f"file://{target}"),
    )
    assert str(info.value) == (
        f"the disk is full: could not write checkpoint {str(target)!r} (No space left on device); "
        f"the last good checkpoint is {str(kept)!r}"
    )
    assert isinstance(info.value.__cause__, OSError)


def test_remote_checkpoints_and_storage_options_keep_lightnings_way(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    calls: list[tuple[Any, str, Any]] = []
    monkeypatch.setattr(
        TorchCheckpointIO,
        "save_checkpoint",
        lambda self, checkpoint, path, storage_options=None: calls.append(
            (checkpoint, str(path), storage_options)
        ),
    )
    AtomicCheckpointIO().save_checkpoint({"a": 1}, "memory://bucket/a.ckpt")
    AtomicCheckpointIO().save_checkpoint({"b": 2}, folder / "b.ckpt", storage_options={"x": 1})
    assert calls == [
        ({"a": 1}, "memory://bucket/a.ckpt", None),
        ({"b": 2}, str(folder / "b.ckpt"), {"x": 1}),
    ]
    assert not (folder / "b.ckpt").exists()
    monkeypatch.undo()
    # a remote checkpoint is never read as a local file (what its URL reads as a local path)
    remote = "memory://bucket/given.ckpt"
    with fsspec.open(remote, "wb") as handle:
        torch.save({"w": torch.arange(3)}, handle)
    monkeypatch.chdir(folder)
    local = Path("memory:") / "bucket" / "given.ckpt"
    local.parent.mkdir(parents=True)
    with zipfile.ZipFile(local, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("a", b"hello" * 100)
    data = bytearray(local.read_bytes())
    data[30 + 1 + 50] ^= 0x01  # header (30 bytes), the name "a", then inside the data
    local.write_bytes(bytes(data))
    with pytest.raises(RunError):
        verify_archive(local)
    assert torch.equal(AtomicCheckpointIO().load_checkpoint(remote)["w"], torch.arange(3))


def test_a_changed_bit_is_refused_on_every_load_path_and_loads_are_mapped(folder: Path) -> None:
    path = save_weights(torch.nn.Linear(64, 64), folder / "epoch_004.ckpt")
    name = change_one_tensor_byte(path)
    for load in (
        lambda: resolve_ckpt_path(str(path), folder),  # train's ckpt_path=, eval's
        lambda: load_file(path),  # eval, load_network, the resume shape check
        lambda: AtomicCheckpointIO().load_checkpoint(path),  # Lightning's resume and test
    ):
        assert err(load) == (
            f"{str(path)!r} is damaged: record {name!r} does not match its stored CRC-32 "
            "checksum (bytes changed on disk or in a copy); use an intact copy of the file"
        )
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        AtomicCheckpointIO().load_checkpoint(folder / "nowhere.ckpt")
    path = folder / "given.ckpt"
    AtomicCheckpointIO().save_checkpoint({"w": torch.arange(3)}, path)
    seen: list[str] = []
    loaded = AtomicCheckpointIO().load_checkpoint(path, map_location=lambda s, where: seen.append(where) or s)  # fmt: skip
    assert torch.equal(loaded["w"], torch.arange(3)) and seen == ["cpu"]
    assert torch.equal(AtomicCheckpointIO().load_checkpoint(path)["w"], torch.arange(3))


_GPU_TAG = {"on": False, "registered": False}


def gpu_tagged_checkpoint(path: Path, data: Any, **save: Any) -> Path:
    if not _GPU_TAG["registered"]:
        torch.serialization.register_package(
            -100, lambda obj: "cuda:0" if _GPU_TAG["on"] else None, lambda obj, location: None
        )
        _GPU_TAG["registered"] = True
    _GPU_TAG["on"] = True
    try:
        torch.save(data, path, **save)
    finally:
        _GPU_TAG["on"] = False
    return path


def test_files_from_a_gpu_machine_load_onto_the_cpu(folder: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA, where a cuda:0 storage cannot be restored")
    net = small_net()
    OmegaConf.save({"model": {"net": SMALL_NET}}, folder / "config.yaml")
    path = gpu_tagged_checkpoint(folder / "model.pth", net.state_dict())
    assert load_file(path).keys() == net.state_dict().keys()
    assert load_file(path, mmap=True).keys() == net.state_dict().keys()
    legacy = gpu_tagged_checkpoint(
        folder / "legacy.pth", net.state_dict(), _use_new_zipfile_serialization=False
    )
    assert load_file(legacy, mmap=True).keys() == net.state_dict().keys()  # read, not mapped
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(path, weights_only=True)  # torch alone restores onto cuda:0
    assert AtomicCheckpointIO().load_checkpoint(path).keys() == net.state_dict().keys()
    assert equal(load_network(path, device="cpu", allowed=TEMPLATE_TARGETS), net.state_dict())


def test_sharded_checkpoint_directories(folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    target = folder / "last.ckpt"
    weights = {f"net.{k}": v for k, v in small_net().state_dict().items()}
    weights["net.count"] = torch.arange(3)  # not float32: the dtype comes from the index
    with pytest.warns(UserWarning):
        dcp.save(
            {"state_dict": weights, "optim": {"m": torch.ones(5)}},
            checkpoint_id=str(target),
            no_dist=True,
        )
    assert "epoch" not in load_file(target)  # no meta.pt, no manifest: the shards alone
    torch.save({"epoch": 4, "global_step": 9, "t": torch.ones(1)}, target / "meta.pt")
    files = checkpointing.checkpoint_files(target)
    checkpointing.write_manifest(target, checkpointing.describe_files(target, files[:1]))
    assert checkpointing.manifest_names(target) == files
    seen: list[str] = []
    located = checkpointing.load_sharded(target, lambda s, where: seen.append(where) or s)
    for data in (located, load_file(target), AtomicCheckpointIO().load_checkpoint(target)):
        assert data["epoch"] == 4 and set(data["state_dict"]) == set(weights)
        for key, value in weights.items():
            assert torch.equal(data["state_dict"][key], value)
            assert data["state_dict"][key].dtype == value.dtype
    AtomicCheckpointIO().load_checkpoint(
        target, map_location=lambda s, where: seen.append(where) or s
    )
    assert seen == ["cpu", "cpu"]
    shapes = checkpointing.sharded_state(target, load=False)
    assert {k: (v.shape, v.device.type) for k, v in shapes.items()} == {
        k: (v.shape, "meta") for k, v in weights.items()
    }
    (target / checkpointing.MANIFEST_FILE).unlink()
    (target / ".metadata").write_bytes(b"x")
    for load in (True, False):
        message = err(lambda lo=load: checkpointing.sharded_state(target, lo))
        assert message.startswith(f"{str(target)!r} is not a readable sharded checkpoint: ")
        assert not message.endswith("None")
    (target / checkpointing.MANIFEST_FILE).write_text("{")
    assert "its manifest.json cannot be read" in err(lambda: load_file(target))


def test_sharded_checkpoint_directories_are_staged(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = folder / "a b" / "last.ckpt"
    staging = writes.new_staging_dir(target)
    assert staging.parent == target.parent and writes._TEMP.fullmatch(staging.name)
    dead = target.parent / DEAD.replace(".model.pth", ".last.ckpt")
    dead.mkdir()
    again = writes.new_staging_dir(target)
    assert not dead.exists() and again.is_dir() and again != staging
    (staging / "x").write_text("1")
    writes.swap_in(staging, target)  # a new name
    assert (target / "x").read_text() == "1" and not staging.exists()
    single = folder / "single.ckpt"
    single.write_text("a file before")
    writes.swap_in(again, single)
    assert single.is_dir() and not again.exists()
    shards = case(folder, "shards")
    (shards / "sub").mkdir()
    (shards / "shard").write_bytes(b"some bytes")
    assert checkpointing.checkpoint_files(shards) == ["shard"]
    (entry,) = checkpointing.describe_files(shards, ["shard"])
    assert entry == {"name": "shard", "size": 10, "crc32": zlib.crc32(b"some bytes")}
    stuck = writes.new_staging_dir(target)
    (stuck / "x").write_text("3")
    with monkeypatch.context() as patch:  # no renameat2, and the old directory cannot be removed
        patch.setattr(writes, "_exchange", lambda a, b: False)
        patch.setattr(os, "unlink", fails(OSError(errno.EBUSY, "Device or resource busy")))
        writes.swap_in(stuck, target)
    assert (target / "x").read_text() == "3" and not stuck.exists()
    (aside,) = [p for p in target.parent.iterdir() if p != target]
    assert writes._TEMP.fullmatch(aside.name) and (aside / "x").read_text() == "1"
    newer = writes.new_staging_dir(target)
    (newer / "x").write_text("2")
    monkeypatch.setattr(os, "replace", fails(OSError(errno.EXDEV, "only renameat2 may swap")))
    monkeypatch.chdir(target.parent)  # relative names: renameat2 resolves them in the cwd
    writes.swap_in(Path(newer.name), Path(target.name))  # exchanged in one step
    assert (target / "x").read_text() == "2" and not newer.exists()


def test_a_damaged_shard_is_named_exactly_and_only_in_the_share_asked_for(folder: Path) -> None:
    for name in ("a", "b"):
        (folder / name).write_bytes(b"12345")
    checkpointing.write_manifest(folder, [])
    (folder / "b").write_bytes(b"1234")
    damaged = f"{str(folder)!r} is damaged: shard file 'b' "
    assert checkpointing.damaged_files(folder, ["a"]) is None
    assert checkpointing.damaged_files(folder, ["b"]) == (
        damaged + "has 4 bytes, 5 were written; use an intact copy of the checkpoint"
    )
    (folder / "b").write_bytes(b"12346")
    assert checkpointing.damaged_files(folder) == (
        damaged + "does not match its recorded CRC-32 checksum (bytes changed on disk or in a "
        "copy); use an intact copy of the checkpoint"
    )
    (folder / checkpointing.MANIFEST_FILE).unlink()
    assert checkpointing.damaged_files(folder) == (
        f"{str(folder)!r} is not a complete sharded checkpoint: it has neither a manifest.json "
        "nor a .metadata (a save that did not finish?)"
    )
    (folder / ".metadata").write_bytes(b"index")
    assert checkpointing.damaged_files(folder) is None
