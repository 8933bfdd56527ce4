"""The speed switches: each a config key, the fast choice by default where it is safe, a no-op
where it would not help (the library README's performance table says what each does)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import platform
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

from runkit import quoting
from runkit.errors import RunError
from runkit.gpus.resolve import parse_devices

log = logging.getLogger(__name__)

MATMUL_PRECISIONS = ("highest", "high", "medium")
LIGHTNING_PRECISIONS = (
    *("transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true"),
    *("bf16-mixed", "32-true", "64-true", "64", "32", "16", "bf16"),
)


def cuda_indices(accelerator: Any, devices: Any) -> list[int]:
    """The CUDA device indices a run trains on (``devices`` as the Trainer takes it), or ``[]``."""
    if str(accelerator).strip().lower() not in ("auto", "gpu", "cuda"):
        return []
    if not torch.cuda.is_available():
        return []
    if isinstance(wanted := parse_devices(devices), list):
        return wanted
    visible = torch.cuda.device_count()
    return list(range(visible if wanted in ("auto", -1) else min(int(wanted), visible)))


def _ampere(cuda: Sequence[int]) -> bool:
    return bool(cuda) and all(torch.cuda.get_device_capability(i) >= (8, 0) for i in cuda)


def _invalid(key: str, value: Any, expected: str) -> RunError:
    return RunError(f"{key}={value!r} is invalid; expected {expected}")


def apply_matmul_precision(value: str, cuda: Sequence[int]) -> str:
    """Set it when every GPU is Ampere or newer (a CPU backend could trade accuracy)."""
    if value not in MATMUL_PRECISIONS:
        raise _invalid("matmul_precision", value, f"one of {', '.join(MATMUL_PRECISIONS)}")
    if _ampere(cuda):
        torch.set_float32_matmul_precision(value)
    return torch.get_float32_matmul_precision()


def keep_freed_memory(enabled: Any) -> bool:
    """Let glibc's malloc keep the memory a step frees for the next one; whether in force."""
    if not isinstance(enabled, bool):
        raise _invalid("keep_freed_memory", enabled, "true or false")
    if not enabled or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt  # M_MMAP_THRESHOLD -3, M_TRIM_THRESHOLD -1 (malloc.h)
    return bool(mallopt(-3, 32 << 20) and mallopt(-1, 1 << 30))


def resolve_precision(value: Any, cuda: Sequence[int]) -> str:
    """``auto``: ``bf16-mixed`` when every GPU is Ampere or newer, else ``32-true``."""
    text = str(value).strip()
    if text != "auto" and text not in LIGHTNING_PRECISIONS:
        raise _invalid("precision", value, f"auto or one of {', '.join(LIGHTNING_PRECISIONS)}")
    return text if text != "auto" else "bf16-mixed" if _ampere(cuda) else "32-true"


def maybe_compile(net: nn.Module, enabled: bool) -> nn.Module:
    """Compile in place (keys keep no ``_orig_mod.``), once; marked, so DP can refuse it."""
    if enabled and not getattr(net, "compiled_by_runkit", False):
        net.compile()
        setattr(net, "compiled_by_runkit", True)  # noqa: B010 (nn.Module types its attributes)
    return net


def to_channels_last(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.contiguous(memory_format=torch.channels_last) if batch.ndim == 4 else batch
    if isinstance(batch, list | tuple):
        return type(batch)(to_channels_last(item) for item in batch)
    return batch


class NetworkSpeedups(Callback):
    """``compile``, ``channels_last`` for ``pl_module.<network>`` before the strategy wraps it."""

    def __init__(
        self, compile: bool = False, channels_last: bool = True, network: str = "net"
    ) -> None:
        self.compile, self.channels_last, self.network = compile, channels_last, network
        self._input_hook: Any = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        net = getattr(pl_module, self.network, None)
        on_cuda = self.channels_last and trainer.strategy.root_device.type == "cuda"
        if not isinstance(net, nn.Module):
            name = f"{type(pl_module).__name__}"
            if self.compile:
                raise RunError(
                    f"callbacks.speed.compile=true compiles {name}.{self.network}, but there is "
                    "no such network; set callbacks.speed.network to the attribute holding it"
                )
            if on_cuda and stage == "fit" and trainer.is_global_zero:  # once, where it applies
                log.info(
                    f"callbacks.speed: {name} has no nn.Module attribute {self.network!r}, so "
                    "channels_last is not applied; set callbacks.speed.network to the attribute "
                    "holding your network"
                )
            return
        if on_cuda and any(isinstance(m, nn.Conv2d) for m in net.modules()):
            net.to(memory_format=torch.channels_last)
            if self._input_hook is None:
                self._input_hook = net.register_forward_pre_hook(lambda m, a: to_channels_last(a))
        maybe_compile(net, self.compile)  # fit, then test: compiled once

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._input_hook is not None:
            self._input_hook.remove()
            self._input_hook = None


def trainer_settings(cfg: Any, plan: Any) -> dict[str, Any]:
    """The Trainer arguments for the devices of ``plan``, applying TF32 and the allocator."""
    if cfg.trainer.get("precision") is not None:
        hint = quoting.override("precision", cfg.trainer.precision)  # pasteable as it is
        raise RunError(
            f"trainer.precision={cfg.trainer.precision} is not read; the run's precision (auto: "
            f"bf16-mixed on a bf16 GPU) is the top-level key: {hint}"
        )
    cuda = cuda_indices(plan.accelerator, plan.devices)
    matmul = apply_matmul_precision(cfg.get("matmul_precision", "high"), cuda)
    kept = keep_freed_memory(cfg.get("keep_freed_memory", True))
    kwargs = plan.trainer_kwargs()
    precision = resolve_precision(cfg.get("precision", "auto"), cuda)
    if precision in ("16-mixed", "16") and str(plan.accelerator).strip().lower() == "cpu":
        if rank_zero_only.rank == 0:  # fp16 AMP is CUDA-only: what Lightning would run, said once
            log.info(
                f"precision={precision}: fp16 mixed precision does not exist on the CPU, so this "
                "run uses bf16-mixed (set precision=bf16-mixed or 32-true to choose)"
            )
        precision = "bf16-mixed"
    kwargs["precision"] = precision
    if cfg.trainer.get("profiler") is None:
        kwargs["profiler"] = NoProfiler()
    if rank_zero_only.rank == 0:  # once, not once per DDP process
        where = f"cuda:{','.join(map(str, cuda))}" if cuda else "cpu"
        memory = ", freed memory kept" if kept else ""
        log.info(
            f"Speed: precision={precision}, float32 matmul precision={matmul}{memory} ({where})"
        )
    return kwargs


class NoProfiler(Profiler):
    """Times nothing: one shared ``nullcontext`` (``PassThroughProfiler`` builds a generator)."""

    def start(self, action_name: str) -> None: ...

    def stop(self, action_name: str) -> None: ...

    def profile(self, action_name: str) -> contextlib.nullcontext:
        return _NOTHING

    def summary(self) -> str:
        return ""


_NOTHING = contextlib.nullcontext()
