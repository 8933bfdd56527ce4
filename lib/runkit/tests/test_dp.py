"""``trainer.strategy=dp``. Without GPUs ``nn.DataParallel`` only calls the network, hiding every
mistake in splitting and gathering, so most tests swap in :class:`SplitDataParallel`, a CPU
stand-in over shallow copies of the network, and compare with one device; ``gpu`` tests the real
thing."""

from __future__ import annotations

import importlib
import threading
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import OmegaConf
from torch import Tensor, nn

from tinyapp.data import DigitsDataModule
from tinyapp.models import MLP, ClassifierModule
from runkit.errors import RunError
from runkit.run.preflight import check_config, check_strategy
from runkit.speed import maybe_compile
from runkit.strategies.dp import AutocastDataParallel, DataParallelStrategy, check_dp_request


def _replicate(module: nn.Module) -> nn.Module:
    """Like torch.nn.parallel.replicate: shallow copies of every submodule, sharing parameters."""
    copies = {}
    for sub in module.modules():
        replica = sub._replicate_for_data_parallel()
        replica._parameters = dict(sub._parameters)
        copies[sub] = replica
    for sub, replica in copies.items():
        replica._modules = {k: copies.get(c) for k, c in sub._modules.items()}
    return copies[module]


def _split(value: Any, parts: int) -> list[Any]:
    if isinstance(value, Tensor):
        return list(value.chunk(parts))
    if isinstance(value, list | tuple):
        columns = [_split(v, parts) for v in value]
        count = min((len(c) for c in columns), default=parts)
        return [type(value)(c[i] for c in columns) for i in range(count)]
    return [value] * parts


class SplitDataParallel(nn.Module):
    """Records the size of each slice it runs the network on, one list per call."""

    def __init__(self, module: nn.Module, parts: int, calls: list[list[int]]) -> None:
        super().__init__()
        self.module, self.parts, self.calls = module, parts, calls

    def forward(self, *inputs: Any) -> Any:
        chunks = _split(inputs, self.parts)
        self.calls.append([len(chunk[0]) for chunk in chunks])
        return torch.cat([_replicate(self.module)(*chunk) for chunk in chunks])


class CpuSplitDP(DataParallelStrategy):
    """The real strategy with the stand-in wrapper, allowed on the CPU for this test."""

    calls: list[list[int]]

    def _require_cuda(self) -> None:
        return None

    def _data_parallel(self, net: nn.Module) -> nn.Module:
        self.calls = getattr(self, "calls", [])
        return SplitDataParallel(net, parts=2, calls=self.calls)


def make_module() -> ClassifierModule:
    # No dropout: then DP over two halves must match one device exactly.
    return ClassifierModule(MLP(hidden=(32,), dropout=0.0), partial(torch.optim.SGD, lr=0.1))


def make_trainer(strategy: Any, root: Path, accelerator: str = "cpu", **kwargs: Any) -> pl.Trainer:
    devices = 2 if isinstance(strategy, DataParallelStrategy) else 1
    return pl.Trainer(
        accelerator=accelerator,
        devices=kwargs.pop("devices", devices),
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        limit_test_batches=2,
        logger=False,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def fit(strategy: Any, tmp_path: Path) -> tuple[ClassifierModule, dict[str, Tensor]]:
    pl.seed_everything(3)
    module, trainer = make_module(), make_trainer(strategy, tmp_path)
    datamodule = DigitsDataModule(batch_size=61)  # odd: the halves differ in size
    trainer.fit(module, datamodule=datamodule)
    metrics = dict(trainer.callback_metrics)
    trainer.test(module, datamodule=datamodule, verbose=False)
    return module, {**metrics, **trainer.callback_metrics}


def test_dp_is_registered_accepted_by_preflight_and_its_preset_names_the_network() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from tinyapp import config_dir

    assert "dp" in StrategyRegistry
    check_strategy("dp")  # no error
    trainer = pl.Trainer(strategy="dp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, DataParallelStrategy)
    assert trainer.strategy.network == "net"  # the registered name parallelises pl_module.net
    assert trainer.num_devices == 2 and trainer.world_size == 1 and trainer.is_global_zero
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["trainer=dp", "trainer.strategy.network=encoder"])
    assert instantiate(cfg.trainer.strategy).network == "encoder"


def test_dp_without_cuda_fails_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(
        RunError, match=r"dp asks for a GPU .*, but trainer.accelerator=cpu; .*ddp_sim"
    ):
        check_dp_request("cpu", 2)
    with pytest.raises(RunError, match=r"num_nodes=2"):
        check_dp_request("gpu", 2, num_nodes=2)
    if not torch.cuda.is_available():
        with pytest.raises(RunError, match=r"strategy=dp asks for a GPU .*, but: No usable GPU"):
            check_dp_request("auto", 2)
        cfg = OmegaConf.create(
            {"trainer": {"strategy": "dp", "accelerator": "auto", "devices": 2, "num_nodes": 1}}
        )
        with pytest.raises(RunError, match="strategy=dp asks for a GPU"):
            check_config(cfg)
    # A Trainer built directly: the strategy refuses at setup.
    with pytest.raises(RunError, match=r"asks for a GPU .*, but the Trainer's devices are cpu"):
        make_trainer("dp", tmp_path, devices=2).fit(make_module(), datamodule=DigitsDataModule())


def test_the_step_runs_once_over_the_gathered_outputs() -> None:
    """Only the network is split: the loss and the metric update happen once, on the whole
    (odd) batch, so they equal the single-device ones; the module's keys do not change."""
    module = make_module()
    batch = (torch.rand(7, 1, 8, 8), torch.randint(0, 10, (7,)))
    expected = module.training_step(batch, 0).detach()
    module.train_metrics.reset()
    keys, parameters = list(module.state_dict()), list(module.parameters())

    strategy = CpuSplitDP(parallel_devices=[torch.device("cpu")] * 2)
    strategy._setup_model(module)
    assert isinstance(module.net, SplitDataParallel) and module.net.module is module._modules["net"]
    loss = module.training_step(batch, 0)
    assert strategy.calls == [[4, 3]]  # the network ran on both halves, in one call
    assert loss.ndim == 0 and torch.allclose(loss, expected, atol=1e-6)
    assert module.train_metrics["loss"].update_count == 1
    assert list(module.state_dict()) == keys  # the wrapper is not a submodule
    assert list(module.parameters()) == parameters  # each parameter once, as before


def test_split_dp_trains_exactly_like_one_device_and_saves_plain_keys(tmp_path: Path) -> None:
    single, metrics_single = fit("auto", tmp_path / "single")
    strategy = CpuSplitDP()
    split, metrics_split = fit(strategy, tmp_path / "dp")

    # every step's network call went through the splitting wrapper, in two uneven halves
    assert len(strategy.calls) == 4 + 2 + 2  # training, validation, test batches
    assert strategy.calls[0] == [31, 30]
    assert isinstance(split.net, MLP)  # after the run, pl_module.net is the plain network again
    for (name, a), (_, b) in zip(
        single.state_dict().items(), split.state_dict().items(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-5), name
    for key in ("train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc"):
        assert torch.isclose(metrics_single[key], metrics_split[key], atol=1e-5), key

    ckpt = next((tmp_path / "dp" / "checkpoints").glob("*.ckpt"))
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    assert not [key for key in state if "module." in key]
    make_module().load_state_dict(state, strict=True)


class Encoder(pl.LightningModule):
    """A LightningModule whose network is not called ``net``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 2)


def test_the_network_attribute_is_configurable_and_a_compiled_one_refused() -> None:
    two_cpus = {"parallel_devices": [torch.device("cpu")] * 2}
    module, strategy = Encoder(), CpuSplitDP(network="encoder", **two_cpus)
    strategy._setup_model(module)
    assert module.encoder(torch.randn(5, 4)).shape == (5, 2) and strategy.calls == [[3, 2]]
    no_net = r"network in Encoder\.net, but .* attribute 'net'; set trainer\.strategy\.network"
    with pytest.raises(RunError, match=no_net):
        CpuSplitDP(**two_cpus)._setup_model(Encoder())
    compiled = make_module()
    maybe_compile(compiled.net, True)
    with pytest.raises(RunError, match=r"^a compiled network \(callbacks\.speed\.compile=true\)"):
        CpuSplitDP(**two_cpus)._setup_model(compiled)


def test_copies_on_other_gpus_compute_in_the_callers_autocast_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's parallel_apply runs each copy in a thread at the thread's default autocast dtype;
    the wrapper hands the caller's over. On the CPU (default bf16), the caller in float16."""
    data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")  # not the function

    def threaded_apply(replicas: Any, inputs: Any, kwargs: Any, devices: Any) -> list[Any]:
        enabled, results = torch.is_autocast_enabled("cpu"), {}

        def work(i: int) -> None:  # what torch's worker does, on the CPU
            with torch.autocast("cpu", enabled=enabled):
                results[i] = replicas[i](*inputs[i], **kwargs[i])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [results[i] for i in range(len(replicas))]

    monkeypatch.setattr(data_parallel, "parallel_apply", threaded_apply)
    wrapper = AutocastDataParallel(nn.Linear(4, 2))  # on a CPU-only machine: no device setup
    wrapper.src_device_obj, wrapper.device_ids = torch.device("cpu"), [0, 1]
    replicas = [wrapper.module, wrapper.module]
    inputs = [(torch.randn(2, 4),), (torch.randn(2, 4),)]
    with torch.autocast("cpu", dtype=torch.float16):
        outputs = wrapper.parallel_apply(replicas, inputs, [{}, {}])
    assert [out.dtype for out in outputs] == [torch.float16, torch.float16]
    plain = nn.DataParallel.parallel_apply
    with torch.autocast("cpu", dtype=torch.float16):
        outputs = plain(wrapper, replicas, inputs, [{}, {}])
    assert outputs[0].dtype == torch.bfloat16  # what the plain wrapper does: not the caller's


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 2])
def test_dp_on_real_gpus_matches_one_gpu(tmp_path: Path, count: int) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < count:
        pytest.skip(f"needs {count} CUDA GPU(s); this machine has {gpus}")
    runs = {}
    for name, strategy, devices in (("single", "auto", 1), ("dp", "dp", count)):
        pl.seed_everything(3)
        module = make_module()
        run = make_trainer(strategy, tmp_path / name, "gpu", devices=devices, deterministic=True)
        run.fit(module, datamodule=DigitsDataModule(batch_size=61))
        runs[name] = (module, run)
    (single, single_trainer), (dp, dp_trainer) = runs["single"], runs["dp"]
    assert isinstance(dp_trainer.strategy, DataParallelStrategy)
    for (name, a), (_, b) in zip(single.state_dict().items(), dp.state_dict().items(), strict=True):
        assert torch.allclose(a.float(), b.float(), atol=1e-4), name
    for key in ("train/loss", "val/acc", "val/loss"):
        a, b = (t.callback_metrics[key].cpu() for t in (single_trainer, dp_trainer))
        assert torch.isclose(a, b, atol=1e-4), key
    state = torch.load(next((tmp_path / "dp" / "checkpoints").glob("*.ckpt")), weights_only=True)
    assert not [key for key in state["state_dict"] if key.startswith("module.")]
