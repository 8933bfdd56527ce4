"""``trainer.strategy=dp``: registration, the CPU refusal, and the step plumbing.

On a machine without GPUs ``nn.DataParallel`` only calls the module, which would hide every
mistake in splitting and gathering. So most tests here swap in :class:`SplitDataParallel`, a CPU
stand-in that does what DataParallel does with GPUs (split the batch, run shallow per-"device"
copies of the module, concatenate the outputs) and compare against plain single-device training.
The ``gpu`` tests at the end run the real thing.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import OmegaConf
from torch import Tensor, nn

from project.data.digits import DigitsDataModule
from project.errors import ProjectError
from project.machinery.run.preflight import check_config, check_strategy
from project.machinery.strategies.dp import (
    DataParallelStrategy,
    _ReplicaStep,
    check_dp_request,
    mean_loss,
    steps_run_in_replicas,
)
from project.models.classifier import ClassifierModule
from project.models.nets import MLP

# ------------------------------------------------------------------------------------------------
# A CPU stand-in for nn.DataParallel


def _replicate(module: nn.Module) -> nn.Module:
    """Like torch.nn.parallel.replicate: shallow copies of every submodule, sharing the parameters
    (a real replicate broadcasts copies to each GPU, differentiably)."""
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


def _gather(outputs: list[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, Tensor):
        return torch.cat([o.unsqueeze(0) if o.ndim == 0 else o for o in outputs])
    if isinstance(first, dict):
        return {key: _gather([o[key] for o in outputs]) for key in first}
    return first


class SplitDataParallel(nn.Module):
    def __init__(self, module: nn.Module, parts: int, calls: list[str]) -> None:
        super().__init__()
        self.module, self.parts, self.calls = module, parts, calls

    def forward(self, *args: Any) -> Any:
        self.calls.append(args[0])  # the step's name
        chunks = _split(args, self.parts)
        return _gather([_replicate(self.module)(*chunk) for chunk in chunks])


class CpuSplitDP(DataParallelStrategy):
    """The real strategy with the stand-in wrapper, allowed on the CPU for this test."""

    def _require_cuda(self) -> None:
        return None

    calls: list[str]

    def _data_parallel(self, module: nn.Module) -> nn.Module:
        self.calls = getattr(self, "calls", [])
        return SplitDataParallel(module, parts=2, calls=self.calls)


# ------------------------------------------------------------------------------------------------


def make_module() -> ClassifierModule:
    # No dropout and no BatchNorm: then DP over two halves must match one device exactly.
    return ClassifierModule(MLP(hidden=(32,), dropout=0.0), partial(torch.optim.SGD, lr=0.1))


def fit(strategy: Any, tmp_path: Path) -> tuple[ClassifierModule, dict[str, Tensor]]:
    pl.seed_everything(3)
    module = make_module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 if isinstance(strategy, DataParallelStrategy) else 1,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        limit_test_batches=2,
        logger=False,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    datamodule = DigitsDataModule(batch_size=61)  # odd: the halves differ in size
    trainer.fit(module, datamodule=datamodule)
    metrics = dict(trainer.callback_metrics)
    trainer.test(module, datamodule=datamodule, verbose=False)
    return module, {**metrics, **trainer.callback_metrics}


def test_dp_is_registered_and_accepted_by_preflight() -> None:
    assert "dp" in StrategyRegistry
    check_strategy("dp")  # no error
    trainer = pl.Trainer(strategy="dp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, DataParallelStrategy)
    assert trainer.num_devices == 2 and trainer.world_size == 1 and trainer.is_global_zero


def test_dp_without_cuda_fails_in_one_line() -> None:
    with pytest.raises(
        ProjectError, match=r"dp asks for a GPU .*, but trainer.accelerator=cpu; .*ddp_sim"
    ):
        check_dp_request("cpu", 2)
    with pytest.raises(ProjectError, match=r"num_nodes=2"):
        check_dp_request("gpu", 2, num_nodes=2)
    if not torch.cuda.is_available():
        with pytest.raises(
            ProjectError, match=r"strategy=dp asks for a GPU .*, but: No usable GPU"
        ):
            check_dp_request("auto", 2)
        cfg = OmegaConf.create(
            {"trainer": {"strategy": "dp", "accelerator": "auto", "devices": 2, "num_nodes": 1}}
        )
        with pytest.raises(ProjectError, match="strategy=dp asks for a GPU"):
            check_config(cfg)


def test_dp_strategy_refuses_cpu_devices_at_setup(tmp_path: Path) -> None:
    trainer = pl.Trainer(strategy="dp", accelerator="cpu", devices=2, max_epochs=1, logger=False)
    with pytest.raises(ProjectError, match=r"asks for a GPU .*, but the Trainer's devices are cpu"):
        trainer.fit(make_module(), datamodule=DigitsDataModule(batch_size=64))


def test_loss_of_every_gpu_is_averaged() -> None:
    assert mean_loss(torch.tensor([1.0, 3.0])).item() == 2.0
    assert mean_loss({"loss": torch.tensor([2.0, 4.0]), "n": 1})["loss"].item() == 3.0
    assert mean_loss(torch.tensor(5.0)).item() == 5.0
    assert mean_loss(None) is None


def test_replica_step_returns_vectors_the_gather_can_stack() -> None:
    class Steps(pl.LightningModule):
        def training_step(self, batch: Tensor, batch_idx: int) -> Any:
            return {"loss": batch.sum(), "count": 3}

    out = _ReplicaStep(Steps())("training_step", torch.ones(4), 0)
    assert out["loss"].shape == (1,) and out["loss"].item() == 4.0
    assert out["count"].shape == (1,)


def test_steps_inside_replicas_defer_metric_updates() -> None:
    module = make_module()
    batch = (torch.rand(6, 1, 8, 8), torch.randint(0, 10, (6,)))
    trainer = pl.Trainer(strategy="dp", accelerator="cpu", devices=2, logger=False)
    module.trainer = trainer  # attached, as during fit
    assert steps_run_in_replicas(module)
    outputs = module.training_step(batch, 0)
    assert set(outputs) == {"losses", "logits", "targets"} and outputs["losses"].shape == (6,)
    assert module.train_metrics["loss"].update_count == 0  # nothing changed in the "replica"
    loss = module.training_step_end(outputs)
    assert loss.ndim == 0 and module.train_metrics["loss"].update_count == 1


def test_split_dp_trains_exactly_like_one_device_and_saves_plain_keys(tmp_path: Path) -> None:
    single, metrics_single = fit("auto", tmp_path / "single")
    strategy = CpuSplitDP()
    split, metrics_split = fit(strategy, tmp_path / "dp")

    # every step ran through the splitting wrapper
    assert strategy.calls == ["training_step"] * 4 + ["validation_step"] * 2 + ["test_step"] * 2
    for (name, a), (_, b) in zip(
        single.state_dict().items(), split.state_dict().items(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-5), name
    for key in ("train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc"):
        assert torch.isclose(metrics_single[key], metrics_split[key], atol=1e-5), key

    ckpt = next((tmp_path / "dp" / "checkpoints").glob("*.ckpt"))
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    assert not [key for key in state if key.startswith("module.")]
    make_module().load_state_dict(state, strict=True)


def test_module_without_step_end_still_trains_on_the_mean_loss(tmp_path: Path) -> None:
    seen: list[Tensor] = []

    class Plain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.layer(x), y)

        def on_before_backward(self, loss: Tensor) -> None:
            seen.append(loss.detach())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CpuSplitDP(),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Plain(), torch.utils.data.DataLoader(data, batch_size=8))
    assert len(seen) == 2 and all(loss.ndim == 0 for loss in seen)


# ------------------------------------------------------------------------------------------------
# Real GPUs


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 2])
def test_dp_on_real_gpus_matches_one_gpu(tmp_path: Path, count: int) -> None:
    if _gpus() < count:
        pytest.skip(f"needs {count} CUDA GPU(s); this machine has {_gpus()}")

    def run(strategy: Any, devices: int, root: Path) -> tuple[ClassifierModule, pl.Trainer]:
        pl.seed_everything(3)
        module = make_module()
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=devices,
            strategy=strategy,
            max_epochs=1,
            limit_train_batches=4,
            limit_val_batches=2,
            logger=False,
            default_root_dir=root,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            deterministic=True,
        )
        trainer.fit(module, datamodule=DigitsDataModule(batch_size=61))
        return module, trainer

    single, single_trainer = run("auto", 1, tmp_path / "single")
    dp, dp_trainer = run("dp", count, tmp_path / "dp")
    assert isinstance(dp_trainer.strategy, DataParallelStrategy)
    for (name, a), (_, b) in zip(single.state_dict().items(), dp.state_dict().items(), strict=True):
        assert torch.allclose(a.float(), b.float(), atol=1e-4), name
    for key in ("train/loss", "val/acc", "val/loss"):
        assert torch.isclose(
            single_trainer.callback_metrics[key].cpu(),
            dp_trainer.callback_metrics[key].cpu(),
            atol=1e-4,
        ), key
    state = torch.load(next((tmp_path / "dp" / "checkpoints").glob("*.ckpt")), weights_only=True)
    assert not [key for key in state["state_dict"] if key.startswith("module.")]
