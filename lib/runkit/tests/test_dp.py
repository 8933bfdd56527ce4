"""``trainer.strategy=dp``: on the CPU a stand-in that splits the batch (``split``) replaces
``nn.DataParallel``, which there only calls the network; ``gpu`` tests the real thing."""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from torch import Tensor, nn

from conftest import compose_train
from tinyapp.data import DigitsDataModule
from tinyapp.models import MLP, ClassifierModule
from runkit.errors import RunError
from runkit.run.preflight import check_config, check_strategy
from runkit.speed import maybe_compile
from runkit.strategies import dp
from runkit.strategies.dp import AutocastDataParallel, DataParallelStrategy, check_dp_request

TWO_CPUS = [torch.device("cpu")] * 2


@pytest.fixture
def split(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The real strategy on the CPU, its wrapper running the network on each (uneven) half; the
    sizes of each call."""
    calls: list[list[int]] = []

    class SplitDataParallel(nn.Module):
        def __init__(self, module: nn.Module, device_ids: Any = None) -> None:
            super().__init__()
            self.module = module

        def forward(self, *inputs: Tensor) -> Tensor:
            chunks = list(zip(*(tensor.chunk(2) for tensor in inputs), strict=True))
            calls.append([len(chunk[0]) for chunk in chunks])
            return torch.cat([self.module(*chunk) for chunk in chunks])

    monkeypatch.setattr(dp, "AutocastDataParallel", SplitDataParallel)
    setup = ParallelStrategy.setup_environment  # no CUDA check
    monkeypatch.setattr(DataParallelStrategy, "setup_environment", setup)
    return calls


def make_module() -> ClassifierModule:
    # No dropout: then DP over two halves must match one device exactly.
    return ClassifierModule(MLP(hidden=(32,), dropout=0.0), partial(torch.optim.SGD, lr=0.1))


def make_trainer(strategy: Any, root: Path, accelerator: str = "cpu", **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator=accelerator, strategy=strategy,
        max_epochs=1, limit_train_batches=4, limit_val_batches=2, limit_test_batches=2,
        logger=False, default_root_dir=root, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip


def fit(strategy: Any, root: Path, accelerator: str, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    pl.seed_everything(3)
    module, trainer = make_module(), make_trainer(strategy, root, accelerator, **kwargs)
    datamodule = DigitsDataModule(batch_size=61)  # odd: the halves differ in size
    trainer.fit(module, datamodule=datamodule)
    metrics = dict(trainer.callback_metrics)
    trainer.test(module, datamodule=datamodule, verbose=False)
    return module, {k: v.float().cpu() for k, v in {**metrics, **trainer.callback_metrics}.items()}


def test_dp_is_registered_accepted_by_preflight_and_its_preset_names_the_network() -> None:
    from hydra.utils import instantiate

    assert "dp" in StrategyRegistry
    check_strategy("dp")  # no error
    trainer = pl.Trainer(strategy="dp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, DataParallelStrategy)
    assert trainer.strategy.network == "net"  # the registered name parallelises pl_module.net
    assert trainer.num_devices == 2 and trainer.world_size == 1 and trainer.is_global_zero
    cfg = compose_train("trainer=dp", "trainer.strategy.network=encoder")
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
        with pytest.raises(RunError, match=r"strategy=dp asks for a GPU .*trainer=ddp_sim"):
            check_config(compose_train("trainer=dp"))  # the preset, refused in the preflight
    # A Trainer built directly: the strategy refuses at setup.
    with pytest.raises(RunError, match=r"asks for a GPU .*, but the Trainer's devices are cpu"):
        make_trainer("dp", tmp_path, devices=2).fit(make_module(), datamodule=DigitsDataModule())


class Encoder(pl.LightningModule):  # its network is not called ``net``
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 2)


def test_the_step_runs_once_over_the_gathered_outputs_of_the_named_network(
    split: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # only the network is split: loss and metric update once, on the whole (odd) batch
    module = make_module()
    batch = (torch.rand(7, 1, 8, 8), torch.randint(0, 10, (7,)))
    expected = module.training_step(batch, 0).detach()
    module.train_metrics.reset()
    keys, parameters = list(module.state_dict()), list(module.parameters())
    DataParallelStrategy(parallel_devices=TWO_CPUS)._setup_model(module)
    assert module.net is not module._modules["net"] and module.net.module is module._modules["net"]
    loss = module.training_step(batch, 0)
    assert split == [[4, 3]]  # the network ran on both halves, in one call
    assert loss.ndim == 0 and torch.allclose(loss, expected, atol=1e-6)
    assert module.train_metrics["loss"].update_count == 1
    assert list(module.state_dict()) == keys  # the wrapper is not a submodule
    assert list(module.parameters()) == parameters  # each parameter once, as before

    encoder = Encoder()
    DataParallelStrategy(network="encoder", parallel_devices=TWO_CPUS)._setup_model(encoder)
    assert encoder.encoder(torch.randn(5, 4)).shape == (5, 2) and split[1:] == [[3, 2]]
    no_net = r"network in Encoder\.net, but .* attribute 'net'; set trainer\.strategy\.network"
    with pytest.raises(RunError, match=no_net):
        DataParallelStrategy(parallel_devices=TWO_CPUS)._setup_model(Encoder())
    compiled = make_module()
    monkeypatch.setattr(nn.Module, "compile", lambda self: None)  # marked as compiled, not run
    maybe_compile(compiled.net, True)
    with pytest.raises(RunError, match=r"^a compiled network \(callbacks\.speed\.compile=true\)"):
        DataParallelStrategy(parallel_devices=TWO_CPUS)._setup_model(compiled)


@pytest.mark.parametrize(
    "gpus",
    [0, pytest.param(1, marks=pytest.mark.gpu), pytest.param(2, marks=pytest.mark.gpu)],
    ids=["cpu-stand-in", "1-gpu", "2-gpus"],
)
def test_dp_trains_exactly_like_one_device_and_saves_plain_keys(
    tmp_path: Path, gpus: int, request: pytest.FixtureRequest
) -> None:
    if gpus > (torch.cuda.device_count() if torch.cuda.is_available() else 0):
        pytest.skip(f"needs {gpus} CUDA GPU(s)")
    accelerator, tol = ("gpu", 1e-4) if gpus else ("cpu", 1e-5)
    single, metrics_single = fit("auto", tmp_path / "single", accelerator, devices=1,
                                 deterministic=bool(gpus))  # fmt: skip
    calls = [] if gpus else request.getfixturevalue("split")
    dp_module, metrics_dp = fit("dp", tmp_path / "dp", accelerator, devices=gpus or 2,
                                deterministic=bool(gpus))  # fmt: skip
    if not gpus:  # every network call went through the splitting wrapper, in two uneven halves
        assert len(calls) == 4 + 2 + 2 and calls[0] == [31, 30]  # train, val, test batches
    assert isinstance(dp_module.net, MLP)  # after the run, pl_module.net is the plain network
    for (name, a), (_, b) in zip(
        single.state_dict().items(), dp_module.state_dict().items(), strict=True
    ):
        assert torch.allclose(a.float(), b.float(), atol=tol), name
    for key in ("train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc"):
        assert torch.isclose(metrics_single[key], metrics_dp[key], atol=tol), key
    state = torch.load(next((tmp_path / "dp" / "checkpoints").glob("*.ckpt")), weights_only=True)
    assert not [key for key in state["state_dict"] if "module." in key]
    make_module().load_state_dict(state["state_dict"], strict=True)


def test_copies_on_other_gpus_compute_in_the_callers_autocast_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch runs each copy in a thread at its default autocast dtype (CPU: bf16); the caller: fp16
    data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")  # not the function

    def threaded_apply(replicas: Any, inputs: Any, kwargs: Any, devices: Any) -> list[Any]:
        enabled = torch.is_autocast_enabled("cpu")

        def work(replica: Any, args: Any, kw: Any) -> Any:  # what torch's worker does, on the CPU
            with torch.autocast("cpu", enabled=enabled):
                return replica(*args, **kw)

        with ThreadPoolExecutor() as pool:
            return list(pool.map(work, replicas, inputs, kwargs))

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
