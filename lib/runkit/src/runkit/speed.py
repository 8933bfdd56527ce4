"""The speed switches: each a config key, defaulting to the fast choice where it is safe, and a
no-op where it would not help (TF32 on the CPU or older GPUs, the allocator switch without glibc).

``matmul_precision``, ``precision`` (``auto``: ``bf16-mixed`` on a GPU that supports it),
``keep_freed_memory``, ``callbacks.speed`` (:class:`NetworkSpeedups`: compile, channels-last) and
``trainer.profiler=null`` as :class:`NoProfiler`; the library README's performance table says
what each does.
"""

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

from runkit import compat, quoting
from runkit.errors import RunError

log = logging.getLogger(__name__)

MATMUL_PRECISIONS = ("highest", "high", "medium")
CPU_HAS_NO_FP16_AMP = ("16-mixed", "16")  # fp16 AMP is CUDA-only: Lightning runs bf16-mixed
LIGHTNING_PRECISIONS = (
    *("transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true"),
    *("bf16-mixed", "32-true", "64-true", "64", "32", "16", "bf16"),
)
AMPERE = (8, 0)  # TF32 and native bf16 from this compute capability on
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def cuda_indices(accelerator: Any, devices: Any) -> list[int]:
    """The CUDA device indices a run trains on (``devices`` as the Trainer takes it); ``[]`` for
    a run on the CPU, another accelerator or a machine without CUDA."""
    name = str(accelerator).strip().lower()
    if name not in ("auto", "gpu", "cuda") or not torch.cuda.is_available():
        return []
    if isinstance(devices, str):
        text = devices.strip()
        devices = [i for i in text.split(",") if i.strip()] if "," in text else text
        devices = -1 if devices == "auto" else devices
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return [int(i) for i in devices]
    visible = torch.cuda.device_count()
    return list(range(visible if int(devices) == -1 else min(int(devices), visible)))


def apply_matmul_precision(value: str, cuda: Sequence[int]) -> str:
    """Set the float32 matmul precision when every GPU of the run is Ampere or newer (``high``:
    TF32); return what is in force. Elsewhere nothing changes: there is no TF32 there, and a CPU
    backend could trade float32 accuracy for bf16 arithmetic."""
    if value not in MATMUL_PRECISIONS:
        raise RunError(
            f"matmul_precision={value!r} is invalid; expected one of {', '.join(MATMUL_PRECISIONS)}"
        )
    if not cuda or any(torch.cuda.get_device_capability(i) < AMPERE for i in cuda):
        return torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    return value


def keep_freed_memory(enabled: Any) -> bool:
    """Let this process keep the memory a training step frees for the next step (glibc's malloc);
    return whether that is in force. Process-wide and not undone.

    Each step frees its activations and allocates the same sizes again; by default glibc hands
    large blocks back to the kernel and the next step faults them in again, zeroed (15 to 25 % of
    a CPU step). ``mallopt`` keeps them: mmap threshold 32 MB, trim threshold 1 GiB.
    """
    if not isinstance(enabled, bool):
        raise RunError(f"keep_freed_memory={enabled!r} is invalid; expected true or false")
    if not enabled or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    )


def resolve_precision(value: Any, cuda: Sequence[int]) -> str:
    """``auto``: ``bf16-mixed`` when every GPU of the run is Ampere or newer, else ``32-true``
    (the CPU included); any other value must be a Lightning precision (returned as text)."""
    text = str(value).strip()
    if text != "auto" and text not in LIGHTNING_PRECISIONS:
        raise RunError(
            f"precision={value!r} is invalid; expected auto or one of "
            f"{', '.join(LIGHTNING_PRECISIONS)}"
        )
    if text != "auto":
        return text
    bf16 = cuda and all(torch.cuda.get_device_capability(i) >= AMPERE for i in cuda)
    return "bf16-mixed" if bf16 else "32-true"


def maybe_compile(net: nn.Module, enabled: bool) -> nn.Module:
    """Compile ``net`` in place when ``enabled`` and return it: ``torch.compile(net)``'s wrapper
    would prefix every ``state_dict`` key with ``_orig_mod.``."""
    if enabled:
        net.compile()
    return net


def to_channels_last(batch: Any) -> Any:
    """The batch with its 4-D tensors (images) in channels-last layout."""
    if isinstance(batch, torch.Tensor):
        return batch.contiguous(memory_format=torch.channels_last) if batch.ndim == 4 else batch
    if isinstance(batch, list | tuple):
        return type(batch)(to_channels_last(item) for item in batch)
    return batch


def uses_channels_last(enabled: bool, device: Any) -> bool:
    """Whether channels-last applies: switched on, and the module lives on a CUDA device."""
    return bool(enabled) and getattr(device, "type", str(device)) == "cuda"


class NetworkSpeedups(Callback):
    """``callbacks.speed``: ``compile`` and ``channels_last`` for ``pl_module.<network>``, in
    ``setup``, before the strategy moves and wraps the module. Channels-last applies on CUDA to a
    network with a 2-D convolution: NHWC weights and a forward pre-hook for its 4-D inputs."""

    def __init__(
        self, compile: bool = False, channels_last: bool = True, network: str = "net"
    ) -> None:
        self.compile = compile
        self.channels_last = channels_last
        self.network = network
        self._input_hook: Any = None
        compat.skip_unused_batch_hooks(self)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        net = getattr(pl_module, self.network, None)
        on_cuda = uses_channels_last(self.channels_last, trainer.strategy.root_device)
        if not isinstance(net, nn.Module):
            if self.compile:
                raise RunError(
                    f"callbacks.speed.compile=true compiles {type(pl_module).__name__}."
                    f"{self.network}, but there is no such network; set callbacks.speed.network "
                    "to the attribute holding it"
                )
            # Said where channels-last would have applied (CUDA), once.
            if on_cuda and stage == "fit" and trainer.is_global_zero:
                log.info(
                    "callbacks.speed: %s has no nn.Module attribute %r, so channels_last is not "
                    "applied; set callbacks.speed.network to the attribute holding your network",
                    type(pl_module).__name__,
                    self.network,
                )
            return
        if on_cuda and any(isinstance(m, nn.Conv2d) for m in net.modules()):
            net.to(memory_format=torch.channels_last)
            if self._input_hook is None:
                self._input_hook = net.register_forward_pre_hook(lambda m, a: to_channels_last(a))
        # private (compat): nn.Module.compile's marker; fit, then test compiles once.
        if self.compile and getattr(net, "_compiled_call_impl", None) is None:
            maybe_compile(net, True)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._input_hook is not None:
            self._input_hook.remove()
            self._input_hook = None


def trainer_settings(cfg: Any, plan: Any) -> dict[str, Any]:
    """The Trainer arguments a run decides for the devices of ``plan`` (a
    :class:`runkit.gpus.resolve.DevicePlan`), applying TF32 and :func:`keep_freed_memory` on the
    way; ``precision`` is the top-level key. Logs one line."""
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
    if precision in CPU_HAS_NO_FP16_AMP and str(plan.accelerator).strip().lower() == "cpu":
        if rank_zero_only.rank == 0:  # what Lightning would run, said once
            log.info(
                "precision=%s: fp16 mixed precision does not exist on the CPU, so this run "
                "uses bf16-mixed (set precision=bf16-mixed or 32-true to choose)",
                precision,
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
    """A profiler that times nothing at the least cost: one shared ``nullcontext`` for the ~90
    hook calls a step, where Lightning's ``PassThroughProfiler`` builds a generator each time."""

    def start(self, action_name: str) -> None: ...

    def stop(self, action_name: str) -> None: ...

    def profile(self, action_name: str) -> contextlib.nullcontext:
        return _NOTHING

    def summary(self) -> str:
        return ""


_NOTHING = contextlib.nullcontext()
