"""The speed switches (project.machinery.speed and the keys that drive them) and the no-sync promise.

No test here measures time: benchmarks/ prints ratios. These check that each switch does what
its config key says, is a no-op where it should be, rejects bad values in one line, and that a
training step of the template's default loop reads nothing back from the device.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from project.data.digits import DigitsDataModule
from project.errors import ProjectError
from project.machinery import speed
from project.machinery.run import builders
from project.machinery.run.cli import config_dir
from project.models.nets import MLP, ConvNet


def _compose(*overrides: str) -> Any:
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.fixture
def restore_matmul_precision() -> Any:
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int, capability: tuple[int, int]) -> None:
    """Pretend this CPU machine has ``count`` CUDA GPUs of one compute capability."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)


# --------------------------------------------------------------------------- the config keys
def test_config_defaults_are_the_fast_safe_choices() -> None:
    cfg = _compose()
    assert cfg.precision == "auto"
    assert cfg.matmul_precision == "high"
    assert cfg.trainer.precision is None  # null: the top-level key decides
    assert cfg.model.compile is False
    assert cfg.model.channels_last is True  # ConvNet; applied on CUDA only
    assert cfg.data.num_workers == "auto" and cfg.data.pin_memory == "auto"
    assert _compose("model=mlp").model.channels_last is False


# --------------------------------------------------------------------------- devices
def test_cuda_indices_is_empty_for_cpu_runs_and_on_machines_without_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert speed.cuda_indices("auto", 1) == []
    assert speed.cuda_indices("gpu", 2) == []
    _fake_cuda(monkeypatch, 4, (9, 0))
    assert speed.cuda_indices("cpu", 2) == []


@pytest.mark.parametrize(
    ("accelerator", "devices", "expected"),
    [
        ("gpu", 2, [0, 1]),
        ("auto", [1, 3], [1, 3]),
        ("cuda", "auto", [0, 1, 2, 3]),
        ("gpu", -1, [0, 1, 2, 3]),
        ("gpu", "0,2", [0, 2]),
        ("gpu", "2", [0, 1]),
    ],
)
def test_cuda_indices_follow_the_trainer_meaning_of_devices(
    monkeypatch: pytest.MonkeyPatch, accelerator: str, devices: Any, expected: list[int]
) -> None:
    _fake_cuda(monkeypatch, 4, (9, 0))
    assert speed.cuda_indices(accelerator, devices) == expected


# --------------------------------------------------------------------------- TF32
def test_matmul_precision_is_left_alone_on_the_cpu(restore_matmul_precision: Any) -> None:
    torch.set_float32_matmul_precision("highest")
    assert speed.apply_matmul_precision("high", []) == "highest"
    assert torch.get_float32_matmul_precision() == "highest"


def test_matmul_precision_high_on_ampere_and_not_on_turing(
    monkeypatch: pytest.MonkeyPatch, restore_matmul_precision: Any
) -> None:
    torch.set_float32_matmul_precision("highest")
    _fake_cuda(monkeypatch, 1, (7, 5))
    assert speed.apply_matmul_precision("high", [0]) == "highest"
    _fake_cuda(monkeypatch, 1, (8, 0))
    assert speed.apply_matmul_precision("high", [0]) == "high"
    assert torch.get_float32_matmul_precision() == "high"


def test_bad_matmul_precision_is_one_line(restore_matmul_precision: Any) -> None:
    with pytest.raises(ProjectError, match=r"^matmul_precision='tf32' is invalid; expected one of"):
        speed.apply_matmul_precision("tf32", [])


# --------------------------------------------------------------------------- precision
def test_auto_precision_is_bf16_mixed_only_on_bf16_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    assert speed.resolve_precision("auto", []) == "32-true"
    _fake_cuda(monkeypatch, 2, (8, 6))
    assert speed.resolve_precision("auto", [0, 1]) == "bf16-mixed"
    _fake_cuda(monkeypatch, 2, (7, 0))
    assert speed.resolve_precision("auto", [0, 1]) == "32-true"


def test_explicit_precision_passes_through_and_bad_ones_fail_in_one_line() -> None:
    assert speed.resolve_precision("16-mixed", []) == "16-mixed"
    assert speed.resolve_precision(32, []) == "32"
    with pytest.raises(ProjectError, match=r"^precision='fp8' is invalid; expected auto or one of"):
        speed.resolve_precision("fp8", [])


# --------------------------------------------------------------------------- compile, layout
def test_compile_is_in_place_so_state_dict_keys_stay_plain() -> None:
    net = speed.maybe_compile(MLP(hidden=(8,)), True)
    assert getattr(net, "_compiled_call_impl", None) is not None
    assert all(not key.startswith("_orig_mod") for key in net.state_dict())
    plain = speed.maybe_compile(MLP(hidden=(8,)), False)
    assert getattr(plain, "_compiled_call_impl", None) is None


def _trainer_on(device: str) -> Any:
    """What prepare_net and the data module read of a Trainer: its strategy's root device."""
    return types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device(device)))


def test_channels_last_applies_to_conv_nets_on_cuda_only() -> None:
    conv = ConvNet(channels=(4, 8))
    assert speed.prepare_net(conv, _trainer_on("cpu"), False, True) is False
    assert not conv.features[3].weight.is_contiguous(memory_format=torch.channels_last)
    # The layout change is device-independent, so a CPU test can check it for a CUDA run.
    assert speed.prepare_net(conv, _trainer_on("cuda"), False, True) is True
    assert conv.features[3].weight.is_contiguous(memory_format=torch.channels_last)
    assert speed.prepare_net(MLP(), _trainer_on("cuda"), False, True) is False
    assert speed.prepare_net(ConvNet(), _trainer_on("cuda"), False, False) is False


def test_channels_last_batches_convert_images_and_leave_labels() -> None:
    images, labels = torch.rand(4, 3, 8, 8), torch.arange(4)
    out_images, out_labels = speed.to_channels_last((images, labels))
    assert out_images.is_contiguous(memory_format=torch.channels_last)
    assert not images.is_contiguous(memory_format=torch.channels_last)
    assert out_labels is labels


def test_compile_is_refused_under_data_parallel() -> None:
    from project.machinery.strategies.dp import DataParallelStrategy

    class OnCpu(DataParallelStrategy):
        root_device = torch.device("cpu")  # no GPUs needed to ask the question

    trainer = types.SimpleNamespace(strategy=OnCpu.__new__(OnCpu))
    with pytest.raises(ProjectError, match=r"^model\.compile=true does not work with"):
        speed.prepare_net(MLP(), trainer, True, False)


def test_module_switches_reach_the_network_through_configure_model() -> None:
    cfg = _compose("model.compile=true", "model.net.channels=[4,8]")
    model = instantiate(cfg.model)
    model._trainer = _trainer_on("cpu")  # what Lightning attaches before configure_model
    model.configure_model()
    assert getattr(model.net, "_compiled_call_impl", None) is not None
    assert model._channels_last is False  # CPU: the layout is left alone


@pytest.mark.slow
def test_compiled_network_trains_on_the_cpu(tmp_path: Path) -> None:
    cfg = _compose("model=mlp", "model.compile=true", "model.net.hidden=[16]")
    model = instantiate(cfg.model)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    before = [p.detach().clone() for p in model.net.parameters()]
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32))
    assert getattr(model.net, "_compiled_call_impl", None) is not None
    assert any(not torch.equal(a, b) for a, b in zip(before, model.net.parameters(), strict=True))
    assert torch.isfinite(torch.as_tensor(trainer.callback_metrics["train/loss"]))


# --------------------------------------------------------------------------- data loading
def test_pin_memory_auto_pins_only_for_cuda_runs() -> None:
    data = DigitsDataModule(pin_memory="auto")
    assert data._pin() is False  # no Trainer attached
    data.trainer = _trainer_on("cpu")
    assert data._pin() is False
    data.trainer = _trainer_on("cuda")
    assert data._pin() is True
    assert DigitsDataModule(pin_memory=True)._pin() is True
    assert DigitsDataModule(pin_memory=False, num_workers="auto").num_workers == 0


def test_bad_pin_memory_is_one_line() -> None:
    with pytest.raises(ProjectError, match=r"^data\.pin_memory='yes' is invalid; expected"):
        DigitsDataModule(pin_memory="yes")


# --------------------------------------------------------------------------- no per-step sync
# Every way a tensor's value reaches the host. On a GPU each is a wait for the device; on the CPU
# they cost little, which is why they are counted here rather than timed.
_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


def _host_side_by_design(caller: types.FrameType) -> bool:
    """Reads torch's optimisers make of their ``step`` counters: those tensors live on the CPU
    even when the parameters are on a GPU (unless ``capturable``), so reading them waits for
    nothing; on this CPU-only test every tensor is on the CPU, so they are told apart by caller."""
    return caller.f_code.co_filename.replace("\\", "/").endswith("torch/optim/optimizer.py")


class SyncProbe(pl.Callback):
    """Counts host reads of tensor values and calls to ``LightningModule.log`` per step window.

    A window runs from one batch's ``on_*_batch_start`` to the next batch's, so it holds the
    step, the backward pass, the optimiser step and every callback's batch hooks (progress bar,
    logger, checkpoint...). The first window of an epoch is left out (epoch-start work), and the
    last one ends with its batch (epoch-end work follows).
    """

    def __init__(self) -> None:
        self.active: str | None = None
        self.counts: dict[str, int] = {}
        self.windows = 0
        self.reads: list[str] = []
        self.logs: list[str] = []

    def _open(self, stage: str, batch_idx: int) -> None:
        self.active = stage if batch_idx >= 1 else None
        if self.active:
            self.windows += 1

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        self._open("train", idx)

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, idx: int, *_: Any
    ) -> None:
        self._open("val", idx if not trainer.sanity_checking else 0)

    def _close(self, *_: Any) -> None:
        self.active = None

    on_train_epoch_end = on_validation_epoch_end = on_validation_start = _close
    on_train_epoch_start = on_validation_end = _close

    # The last batch's window ends with the batch: what follows is epoch-end work (the validation
    # loop setting up its loader, say), done once per epoch rather than per step.
    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, out: Any, batch: Any, idx: int
    ) -> None:
        if idx == trainer.num_training_batches - 1:
            self._close()

    def on_validation_batch_end(
        self, trainer: Any, pl_module: Any, out: Any, batch: Any, idx: int, *_: Any
    ) -> None:
        if idx == trainer.num_val_batches[0] - 1:
            self._close()


def _watch(probe: SyncProbe, monkeypatch: pytest.MonkeyPatch) -> None:
    """Record in ``probe`` every host read of a tensor value, and every ``LightningModule.log``
    call, made while one of its windows is open."""
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def counted(
            self: torch.Tensor, *args: Any, _name: str = name, _orig: Any = original
        ) -> Any:
            if probe.active and not _host_side_by_design(sys._getframe(1)):
                probe.reads.append(f"{probe.active}:{_name}")
            return _orig(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    original_unique = torch.unique  # on a GPU it waits to learn the size of its result

    def unique(*args: Any, **kwargs: Any) -> Any:
        if probe.active:
            probe.reads.append(f"{probe.active}:torch.unique")
        return original_unique(*args, **kwargs)

    monkeypatch.setattr(torch, "unique", unique)
    original_log = pl.LightningModule.log

    def log(self: pl.LightningModule, name: str, *args: Any, **kwargs: Any) -> Any:
        if probe.active:
            probe.logs.append(f"{probe.active}:{name}")
        return original_log(self, name, *args, **kwargs)

    monkeypatch.setattr(pl.LightningModule, "log", log)


def test_a_training_step_reads_nothing_from_the_device_and_logs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The template's default loop (its module, metrics, CSV logger, Rich progress bar,
    checkpointing, GPU statistics callback) makes no host read and no ``log`` call per step."""
    cfg = _compose(
        f"paths.output_dir={tmp_path}",
        "trainer.accelerator=cpu",
        "trainer.max_epochs=2",
        "model=mlp",
        "data.batch_size=256",
    )
    probe = SyncProbe()
    _watch(probe, monkeypatch)

    data, model = instantiate(cfg.data), instantiate(cfg.model)
    trainer = builders.build_trainer(cfg)
    trainer.callbacks.insert(0, probe)
    trainer.fit(model, datamodule=data)

    assert probe.windows >= 6  # train and validation windows were really observed
    assert probe.reads == []
    assert probe.logs == []
    assert trainer.callback_metrics["train/acc"] > 0  # and the epoch-level figures still came


def test_the_sync_probe_sees_a_per_step_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe itself works: torchmetrics' NaN check (off in the template) branches on a
    device value at every update, and the probe catches it; with the check off it sees nothing."""
    from torchmetrics import MeanMetric

    probe = SyncProbe()
    _watch(probe, monkeypatch)
    probe.active = "train"
    MeanMetric(nan_strategy="warn").update(torch.ones(4))
    assert "train:__bool__" in probe.reads
    probe.reads.clear()
    MeanMetric(nan_strategy="disable").update(torch.ones(4))
    assert probe.reads == []


# --------------------------------------------------------------------------- train.py wiring
def _built_trainer_kwargs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str
) -> dict[str, Any]:
    """The keyword arguments project.train hands to build_trainer for a run that trains nothing."""
    from project import train as train_module

    seen: dict[str, Any] = {}
    original = builders.build_trainer

    def spy(cfg: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return original(cfg, **kwargs)

    monkeypatch.setattr(builders, "build_trainer", spy)
    monkeypatch.setattr("project.machinery.plots.after_run", lambda out: None)
    cfg = _compose(
        f"paths.output_dir={tmp_path}",
        "trainer.accelerator=cpu",
        "train=false",
        "test=false",
        "export_weights=false",
        "model=mlp",
        *overrides,
    )
    train_module.train(cfg)
    return seen


def test_train_passes_the_resolved_precision_to_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_matmul_precision: Any
) -> None:
    assert _built_trainer_kwargs(tmp_path / "a", monkeypatch)["precision"] == "32-true"
    # trainer.precision set: it reaches the Trainer from the config, untouched.
    assert "precision" not in _built_trainer_kwargs(
        tmp_path / "b", monkeypatch, "trainer.precision=bf16-mixed"
    )
    # A run on an Ampere GPU (faked: the Trainer itself still runs on the CPU).
    monkeypatch.setattr(speed, "cuda_indices", lambda accelerator, devices: [0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    torch.set_float32_matmul_precision("highest")
    assert _built_trainer_kwargs(tmp_path / "c", monkeypatch)["precision"] == "bf16-mixed"
    assert torch.get_float32_matmul_precision() == "high"


def test_in_memory_batches_come_from_one_index_and_match_the_per_sample_path() -> None:
    from torch.utils.data import DataLoader

    from project.data.arrays import BatchedTensorDataset, Rows, collate_rows

    data = DigitsDataModule(batch_size=32)
    data.setup()
    fast = data.val_dataloader()
    assert fast.collate_fn is collate_rows and data.train_dataloader().collate_fn is collate_rows
    rows = data.val_set.__getitems__([3, 1, 2])  # Subset passes the call to the tensors
    assert isinstance(rows, Rows) and len(rows) == 3 and rows.tensors[0].shape[0] == 3
    # A loader built by hand over the split (default collate) still gets (input, label) samples.
    by_hand = DataLoader(data.val_set, batch_size=32)
    for (x_fast, y_fast), (x_slow, y_slow) in zip(fast, by_hand, strict=True):
        assert torch.equal(x_fast, x_slow) and torch.equal(y_fast, y_slow)
    assert isinstance(data.val_set.dataset, BatchedTensorDataset)
