"""The speed switches (what each does, where it is a no-op, bad values in one line) and the no-sync
promise: a step of the default loop reads nothing back from the device."""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import platform
import resource
import types
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from host_reads import HostReadProbe, ReadRecorder
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from test_dp import split  # noqa: F401  (a fixture: the real DP strategy, its network split on the CPU)

from tinyapp import config_dir
from tinyapp.data import DigitsDataModule
from tinyapp.models import MLP, ClassifierModule, ConvNet
from runkit import speed
from runkit.errors import RunError
from runkit.run import builders


@functools.cache
def _compose(*overrides: str) -> Any:  # read only: callers copy what they change
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.fixture
def restore_matmul_precision() -> Any:
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)


def test_config_defaults_are_the_fast_safe_choices() -> None:
    cfg = _compose()
    assert (cfg.precision, cfg.matmul_precision, cfg.keep_freed_memory) == ("auto", "high", True)
    assert "precision" not in cfg.trainer  # one precision key, the top-level one
    assert (cfg.callbacks.speed.compile, cfg.callbacks.speed.channels_last) == (False, True)
    assert "compile" not in cfg.model and "channels_last" not in cfg.model
    assert cfg.model.optimizer.fused is _compose("model=mlp").model.optimizer.fused is True
    assert cfg.data.num_workers == "auto" and cfg.data.pin_memory == "auto"


def test_cuda_indices_follow_the_trainer_meaning_of_devices(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert speed.cuda_indices("auto", 1) == speed.cuda_indices("gpu", 2) == []
    _fake_cuda(monkeypatch, 4, (9, 0))
    assert speed.cuda_indices("cpu", 2) == []
    all_four = [(a, d, [0, 1, 2, 3]) for a, d in (("cuda", "auto"), ("gpu", -1), ("gpu", 9))]
    some = [
        ("gpu", d, e) for d, e in ((2, [0, 1]), ([1, 3], [1, 3]), ("0,2", [0, 2]), ("2", [0, 1]))
    ]
    for accelerator, devices, expected in all_four + some + [("gpu", "-1", [0, 1, 2, 3])]:
        assert speed.cuda_indices(accelerator, devices) == expected, devices


def test_tf32_and_bf16_only_where_every_gpu_has_them(monkeypatch, restore_matmul_precision) -> None:
    torch.set_float32_matmul_precision("highest")
    assert speed.apply_matmul_precision("high", []) == "highest"  # the CPU: left alone
    assert speed.resolve_precision("auto", []) == "32-true"
    for capability, matmul, precision in [
        ((7, 5), "highest", "32-true"),
        ((8, 0), "high", "bf16-mixed"),
    ]:
        _fake_cuda(monkeypatch, 2, capability)
        assert speed.apply_matmul_precision("high", [0, 1]) == matmul
        assert speed.resolve_precision("auto", [0, 1]) == precision
        assert torch.get_float32_matmul_precision() == matmul
    assert speed.resolve_precision("16-mixed", []) == "16-mixed"
    assert speed.resolve_precision(32, []) == "32"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: speed.apply_matmul_precision("tf32", []), "matmul_precision='tf32' is invalid; expected one of"),
        (lambda: speed.resolve_precision("fp8", []), "precision='fp8' is invalid; expected auto or one of"),
        (lambda: speed.keep_freed_memory("yes"), "keep_freed_memory='yes' is invalid; expected true or false$"),
        (lambda: DigitsDataModule(pin_memory="yes"), r"data\.pin_memory='yes' is invalid; expected"),
    ],
    ids=["matmul", "precision", "keep_freed_memory", "pin_memory"],
)  # fmt: skip
def test_a_bad_value_is_one_line(call: Any, message: str) -> None:
    with pytest.raises(RunError, match=f"^{message}"):
        call()


def _churn_faults(on: bool) -> tuple[bool, int]:
    kept = speed.keep_freed_memory(on)
    for step in range(3):  # each step frees 16 blocks of 4 MB; the first is not counted
        if step == 1:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [bytearray(4 << 20) for _ in range(16)]
        del blocks
    return kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_kept_freed_memory_is_not_faulted_in_again_at_the_next_step() -> None:
    read, write = os.pipe()
    if (pid := os.fork()) == 0:  # the switch acts on a process's allocator: a child's own
        try:
            mallopt = ctypes.CDLL(None).mallopt  # glibc's defaults (M_MMAP_, M_TRIM_THRESHOLD)
            assert mallopt(-3, 128 << 10) and mallopt(-1, 128 << 10)  # as if the switch was off
            os.write(write, json.dumps([_churn_faults(False), _churn_faults(True)]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        (off, off_faults), (on, on_faults) = json.loads(pipe.read())
    os.waitpid(pid, 0)
    pages = 16 * (4 << 20) // resource.getpagesize()  # one step's blocks
    assert (off, on) == (False, True) and off_faults >= pages and on_faults < pages // 4


def test_keep_freed_memory_is_a_no_op_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    monkeypatch.setattr(ctypes, "CDLL", lambda *a: pytest.fail("the allocator was touched"))
    assert speed.keep_freed_memory(True) is speed.keep_freed_memory(False) is False


def _sees_channels_last(net: ConvNet) -> bool:
    seen: list[torch.Tensor] = []
    hook = net.features[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    net(torch.rand(2, 3, 8, 8))
    hook.remove()
    return seen[0].is_contiguous(memory_format=torch.channels_last)


def test_channels_last_applies_to_conv_nets_on_cuda_only_and_a_missing_network_is_left_alone(
    stand_in_trainer, caplog
) -> None:
    switches = speed.NetworkSpeedups(channels_last=True)
    module = ClassifierModule(ConvNet(in_channels=3, channels=(4, 8)), torch.optim.SGD)
    weight = module.net.features[3].weight
    switches.setup(stand_in_trainer("cpu"), module, "fit")
    assert not weight.is_contiguous(memory_format=torch.channels_last)
    assert not _sees_channels_last(module.net)
    # The layout change is device-independent, so a CPU test can check it for a CUDA run.
    switches.setup(stand_in_trainer("cuda"), module, "fit")
    assert module.net.features[3].weight.is_contiguous(memory_format=torch.channels_last)
    assert _sees_channels_last(module.net)  # the batches are converted on their way in
    switches.teardown(stand_in_trainer("cuda"), module, "fit")
    assert not _sees_channels_last(module.net)  # the input hook goes with the run

    mlp = ClassifierModule(MLP(), torch.optim.SGD)
    speed.NetworkSpeedups(channels_last=True).setup(stand_in_trainer("cuda"), mlp, "fit")
    assert not mlp.net.layers[1].weight.is_contiguous(memory_format=torch.channels_last)
    off = ClassifierModule(ConvNet(in_channels=3, channels=(4, 8)), torch.optim.SGD)
    speed.NetworkSpeedups(channels_last=False).setup(stand_in_trainer("cuda"), off, "fit")
    assert not _sees_channels_last(off.net)
    images, labels = torch.rand(4, 3, 8, 8), torch.arange(4)
    out_images, out_labels = speed.to_channels_last((images, labels))
    assert out_images.is_contiguous(memory_format=torch.channels_last) and out_labels is labels

    class NoNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = ConvNet(channels=(4,))

    said = "callbacks.speed: NoNet has no nn.Module attribute 'net', so channels_last is not"
    with caplog.at_level(logging.INFO, logger="runkit.speed"):
        for devices, rank in ((("cuda",), 0), (("cuda", "cuda"), 1), (("cpu",), 0)):
            trainer = stand_in_trainer(*devices, local_rank=rank)
            speed.NetworkSpeedups(channels_last=True).setup(trainer, NoNet(), "fit")
    # once (rank 0 of a CUDA run); on the CPU channels-last means nothing, so nothing is said
    assert [r.getMessage().startswith(said) for r in caplog.records] == [True]
    with pytest.raises(RunError, match=r"^callbacks\.speed\.compile=true compiles NoNet\.net"):
        speed.NetworkSpeedups(compile=True).setup(stand_in_trainer("cpu"), NoNet(), "fit")
    named = NoNet()
    speed.NetworkSpeedups(network="encoder").setup(stand_in_trainer("cuda"), named, "fit")
    assert named.encoder.features[0].weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.slow
def test_the_configured_network_is_compiled_in_place_once_and_trains(tmp_path: Path) -> None:
    # nn.Module.compile in place sets _compiled_call_impl (no public way to ask)
    assert getattr(speed.maybe_compile(MLP(), False), "_compiled_call_impl", None) is None
    cfg = _compose("model=mlp", "callbacks.speed.compile=true", "model.net.hidden=[16]")
    model, switches = instantiate(cfg.model), instantiate(cfg.callbacks.speed)
    assert isinstance(switches, speed.NetworkSpeedups)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_test_batches=1,
        limit_val_batches=0, logger=False, callbacks=[switches], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    before = [p.detach().clone() for p in model.net.parameters()]
    data = DigitsDataModule(batch_size=32)
    trainer.fit(model, datamodule=data)
    compiled = getattr(model.net, "_compiled_call_impl", None)
    assert compiled is not None
    assert any(not torch.equal(a, b) for a, b in zip(before, model.net.parameters(), strict=True))
    assert torch.isfinite(torch.as_tensor(trainer.callback_metrics["train/loss"]))
    assert all(not key.startswith("_orig_mod") for key in model.state_dict())
    trainer.test(model, datamodule=data, verbose=False)
    assert model.net._compiled_call_impl is compiled  # fit, then test: compiled once


@pytest.mark.parametrize("strategy", ["auto", "dp"])
def test_a_step_reads_no_device_tensor_and_logs_nothing(
    tmp_path, monkeypatch, request, strategy
) -> None:
    from runkit.strategies.dp import DataParallelStrategy

    calls = request.getfixturevalue("split") if strategy == "dp" else []  # DP on two CPU halves
    # The default network's operators, smaller; windows: train batches 1-2, val batch 1, twice.
    limits = ("+trainer.limit_train_batches=3", "+trainer.limit_val_batches=2")
    cfg = _compose(f"paths.output_dir={tmp_path}", "trainer.accelerator=cpu", "trainer.max_epochs=2",
                   "model.net.channels=[4,8]", "data.batch_size=64", *limits)  # fmt: skip
    probe, logs, original = HostReadProbe(), [], pl.LightningModule.log

    def log(self: pl.LightningModule, name: str, *args: Any, **kwargs: Any) -> Any:
        logs.extend([name] if probe.stage else [])  # a log call inside a step window
        return original(self, name, *args, **kwargs)

    monkeypatch.setattr(pl.LightningModule, "log", log)
    dp = {"strategy": DataParallelStrategy(), "devices": 2} if strategy == "dp" else {}
    trainer = builders.build_trainer(cfg, **dp)
    trainer.callbacks.insert(0, probe)
    trainer.fit(instantiate(cfg.model), datamodule=instantiate(cfg.data))
    assert probe.windows >= 6  # train and validation windows were really observed
    assert probe.reads == [] and logs == [], probe.summary()
    assert trainer.callback_metrics["train/acc"] > 0  # and the epoch-level figures still came
    assert strategy == "auto" or calls  # the network really ran split


def test_the_probe_names_the_operator_and_the_line_of_each_read() -> None:
    from torchmetrics import MeanMetric

    # Made before the window, as the batch, the module and its metrics are: accelerator data.
    values, images = torch.ones(4), torch.rand(2, 4, 3, 3)
    checked, unchecked = MeanMetric(nan_strategy="warn"), MeanMetric(nan_strategy="disable")
    momentum, epoch_average = torch.nn.BatchNorm2d(4), torch.nn.BatchNorm2d(4, momentum=None)
    probe = HostReadProbe()
    probe.stage = "train"
    with ReadRecorder(probe):
        checked.update(values)
    read = probe.reads[0]
    assert read.op == "aten._local_scalar_dense.default" and read.code.startswith("if ")
    assert str(read).startswith("train: aten._local_scalar_dense.default at torchmetrics/")
    assert "test_performance_switches.py:" in read.caller  # and the test's line that led there
    probe.reads.clear()
    with ReadRecorder(probe):
        unchecked.update(values)
        momentum(images)  # a batch norm with a momentum: no read
        flag = torch.tensor([3], dtype=torch.int32)  # made from a Python number: a host tensor,
        assert int((flag * 2).max().item()) == 6  # so reading it (or what it gives) is free
    assert probe.reads == [], probe.summary()
    with ReadRecorder(probe):
        epoch_average(images)
        bool((images.mean() + flag) > 0)  # host data meeting accelerator data: on the accelerator
    lines = [r.line.split(":")[0] for r in probe.reads]
    assert lines == ["torch/nn/modules/batchnorm.py", "test_performance_switches.py"]
    assert "num_batches_tracked" in probe.reads[0].code


def _settings(cfg: Any = None, **keys: Any) -> dict[str, Any]:
    cfg = (cfg or _compose()).copy()
    for key, value in keys.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    plan = types.SimpleNamespace(accelerator="cpu", devices=1, trainer_kwargs=lambda: {})
    return speed.trainer_settings(cfg, plan)


def test_trainer_settings_follow_the_precision_memory_and_profiler_keys(
    tmp_path, monkeypatch, restore_matmul_precision, caplog
) -> None:
    from lightning.pytorch.profilers import SimpleProfiler

    asked: list[Any] = []
    monkeypatch.setattr(speed, "keep_freed_memory", lambda value: asked.append(value) or value)
    torch.set_float32_matmul_precision("highest")
    with caplog.at_level(logging.INFO, logger="runkit.speed"):
        kwargs = _settings()
    assert kwargs["precision"] == "32-true" and isinstance(kwargs["profiler"], speed.NoProfiler)
    assert "float32 matmul precision=highest, freed memory kept (cpu)" in caplog.text
    assert _settings(precision="bf16-mixed", keep_freed_memory=False)["precision"] == "bf16-mixed"
    assert asked == [True, False]
    # fp16 AMP does not exist on the CPU: what Lightning would run instead is what is passed.
    assert _settings(precision="16-mixed")["precision"] == "bf16-mixed"
    # trainer.precision is not a second key: one line naming the key to use instead.
    with pytest.raises(
        RunError,
        match=r"^trainer\.precision=16-mixed is not read; .*top-level key: precision=16-mixed",
    ):
        _settings(trainer__precision="16-mixed")
    profiled = _compose("debug=profiler", f"paths.output_dir={tmp_path}")
    assert "profiler" not in _settings(profiled)  # a profiler asked for is kept
    assert isinstance(instantiate(profiled.trainer.profiler), SimpleProfiler)
    # NoProfiler runs the profiled code (an error inside passes through) and records nothing.
    with pytest.raises(ValueError, match="inside"), speed.NoProfiler().profile("[M]x") as value:
        assert value is None
        raise ValueError("raised inside")
    assert speed.NoProfiler().summary() == ""
    # A run on an Ampere GPU (faked: nothing runs on it).
    monkeypatch.setattr(speed, "cuda_indices", lambda accelerator, devices: [0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    assert _settings()["precision"] == "bf16-mixed"
    assert torch.get_float32_matmul_precision() == "high"
