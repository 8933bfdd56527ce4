"""The GPU-ready speed switches: each one a config key, each defaulting to the fast choice where
that choice is safe, and each a no-op where it would not help (on the CPU, on older GPUs).

==================  =========================  ================================================
config key          default                    what it does
==================  =========================  ================================================
matmul_precision    ``high``                   ``torch.set_float32_matmul_precision`` on CUDA
                                               GPUs of compute capability >= 8.0 (Ampere and
                                               newer): float32 matmuls and convolutions run on
                                               TF32 tensor cores. Elsewhere left at ``highest``.
precision           ``auto``                   ``bf16-mixed`` on a CUDA GPU that supports bf16,
                                               ``32-true`` elsewhere; any Lightning precision is
                                               used as given. ``trainer.precision`` set to a
                                               value wins over this key.
model.compile       ``false``                  ``torch.compile`` of the network only (in place,
                                               so ``state_dict`` keys and ``model.pth`` stay
                                               plain): pays off on long GPU runs; the first
                                               steps pay the compilation.
model.channels_last ``true`` (ConvNet)         NHWC layout for the network and the 4-D input
                                               batches on CUDA (tensor-core convolutions);
                                               nothing changes on the CPU.
==================  =========================  ================================================

Everything here imports torch lazily, inside the functions, because ``project.train`` must answer
``--help`` and ``--cfg job`` without importing torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from project.errors import ProjectError

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

MATMUL_PRECISIONS = ("highest", "high", "medium")
# Lightning 2.x precision values (the short legacy spellings are accepted by Lightning as well).
LIGHTNING_PRECISIONS = (
    "transformer-engine",
    "transformer-engine-float16",
    "16-true",
    "16-mixed",
    "bf16-true",
    "bf16-mixed",
    "32-true",
    "64-true",
    "64",
    "32",
    "16",
    "bf16",
)
TF32_MIN_CAPABILITY = (8, 0)
BF16_MIN_CAPABILITY = (8, 0)


def cuda_indices(accelerator: Any, devices: Any) -> list[int]:
    """The CUDA device indices a run with this ``accelerator``/``devices`` trains on; ``[]`` for
    a run on the CPU (or on an accelerator that is not CUDA, or a machine without CUDA).

    ``devices`` as the Trainer takes it: a count, a list of indices, ``-1`` or ``"auto"``.
    """
    import torch

    name = str(accelerator).strip().lower()
    if name not in ("auto", "gpu", "cuda") or not torch.cuda.is_available():
        return []
    visible = torch.cuda.device_count()
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return [int(i) for i in devices]
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "-1"):
            return list(range(visible))
        if "," in text:
            return [int(i) for i in text.split(",") if i.strip()]
        devices = int(text)
    count = visible if devices == -1 else int(devices)
    return list(range(min(count, visible)))


def apply_matmul_precision(value: str, cuda: Sequence[int]) -> str:
    """Set the float32 matmul precision for this process when every GPU it uses is Ampere or
    newer (capability >= 8.0), where ``high`` means TF32 tensor cores; return what is in force.

    On the CPU and on older GPUs nothing is changed (``highest``): there TF32 does not exist and
    ``high``/``medium`` could let a CPU backend trade float32 accuracy for bf16 arithmetic.
    """
    import torch

    if value not in MATMUL_PRECISIONS:
        raise ProjectError(
            f"matmul_precision={value!r} is invalid; expected one of {', '.join(MATMUL_PRECISIONS)}"
        )
    if not cuda or any(torch.cuda.get_device_capability(i) < TF32_MIN_CAPABILITY for i in cuda):
        return torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    return value


def resolve_precision(value: Any, cuda: Sequence[int]) -> str:
    """``auto`` -> ``bf16-mixed`` when every GPU the run uses has native bf16 (Ampere and newer),
    else ``32-true`` (the CPU included: bf16 there is slow on most processors);
    any other value is a Lightning precision and is returned as it is (as text).
    """
    text = str(value).strip()
    if text != "auto":
        if text not in LIGHTNING_PRECISIONS:
            raise ProjectError(
                f"precision={value!r} is invalid; expected auto or one of "
                f"{', '.join(LIGHTNING_PRECISIONS)}"
            )
        return text
    if not cuda:
        return "32-true"
    import torch

    # Native bf16 arithmetic starts with Ampere (capability 8.0), as torch.cuda.is_bf16_supported
    # decides for the current device; here every device of the run is asked.
    if all(torch.cuda.get_device_capability(i) >= BF16_MIN_CAPABILITY for i in cuda):
        return "bf16-mixed"
    return "32-true"


def prepare_net(net: nn.Module, trainer: Any, compile: bool, channels_last: bool) -> bool:
    """Apply ``model.compile`` and ``model.channels_last`` to the network before the strategy
    wraps it (``LightningModule.configure_model``); return whether batches go channels-last.

    Channels-last is applied only when the run's device is a CUDA GPU and the network has a 2-D
    convolution (an MLP would only pay for the layout change). Compilation is refused under
    ``strategy=dp``, whose replicas would call the uncompiled original.
    """
    import torch

    from project.machinery.strategies.dp import DataParallelStrategy

    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    has_conv = any(isinstance(m, torch.nn.Conv2d) for m in net.modules())
    layout = uses_channels_last(channels_last, device) and has_conv
    if layout:
        net.to(memory_format=torch.channels_last)
    if compile and not getattr(net, "_compiled_call_impl", None):
        if isinstance(getattr(trainer, "strategy", None), DataParallelStrategy):
            raise ProjectError(
                "model.compile=true does not work with trainer.strategy=dp (its replicas run "
                "the uncompiled network); use strategy=ddp or model.compile=false"
            )
        maybe_compile(net, True)
    return layout


def maybe_compile(net: nn.Module, enabled: bool) -> nn.Module:
    """Compile ``net`` in place when ``enabled`` (``nn.Module.compile``), and return it.

    In place rather than ``torch.compile(net)``: the wrapper that returns would prefix every
    ``state_dict`` key with ``_orig_mod.``, and checkpoints and ``model.pth`` would no longer load
    into a plain network. Compilation itself happens at the first forward pass.
    """
    if enabled:
        net.compile()
    return net


def to_channels_last(batch: Any) -> Any:
    """The batch with its 4-D tensors (images) in channels-last layout; other entries as they are."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.contiguous(memory_format=torch.channels_last) if batch.ndim == 4 else batch
    if isinstance(batch, list | tuple):
        return type(batch)(to_channels_last(item) for item in batch)
    return batch


def uses_channels_last(enabled: bool, device: Any) -> bool:
    """Whether channels-last applies: switched on, and the module lives on a CUDA device."""
    return bool(enabled) and getattr(device, "type", str(device)) == "cuda"


def describe(matmul: str, precision: str, cuda: Sequence[int]) -> str:
    """One log line with the choices in force, so a run's log says how it ran."""
    where = f"cuda:{','.join(map(str, cuda))}" if cuda else "cpu"
    return f"Speed: precision={precision}, float32 matmul precision={matmul} ({where})"


def trainer_settings(cfg: Any, plan: Any) -> dict[str, Any]:
    """The Trainer arguments a run decides for its hardware, with TF32 applied on the way.

    ``plan`` is the :class:`project.machinery.gpus.devices.DevicePlan` (its accelerator and devices); the
    precision ``auto`` picks is added unless ``trainer.precision`` names one. Logs one line.
    """
    cuda = cuda_indices(plan.accelerator, plan.devices)
    matmul = apply_matmul_precision(cfg.get("matmul_precision", "high"), cuda)
    kwargs = plan.trainer_kwargs()
    if cfg.trainer.get("precision") is None:  # a value in trainer.precision wins
        kwargs["precision"] = resolve_precision(cfg.get("precision", "auto"), cuda)
    log.info(describe(matmul, kwargs.get("precision", cfg.trainer.precision), cuda))
    return kwargs
