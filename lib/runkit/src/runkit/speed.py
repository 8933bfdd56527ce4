"""The speed switches: each a config key, defaulting to the fast choice where it is safe, and a
no-op where it would not help (TF32 on the CPU or older GPUs, the allocator switch without glibc).

``matmul_precision`` (``high``: TF32 on Ampere and newer), ``precision`` (``auto``: ``bf16-mixed``
on a GPU that supports it, else ``32-true``), ``keep_freed_memory`` (glibc's malloc keeps freed
memory for the next step), ``callbacks.speed.compile`` and ``callbacks.speed.channels_last``
(:class:`NetworkSpeedups`, a callback, so the module carries no speed code), and
``trainer.profiler=null`` as :class:`NoProfiler`. The library README's performance table says what
each does. The entry points import this module inside their task functions, so ``--help`` stays
instant.
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
# What Lightning turns into bf16-mixed on the CPU (with a warning): fp16 AMP is CUDA-only.
CPU_HAS_NO_FP16_AMP = ("16-mixed", "16")
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
# glibc's mallopt parameters (malloc.h) and the values keep_freed_memory sets.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEPT_FREE_BYTES = 1 << 30  # at most this much freed memory stays with the process
MMAP_THRESHOLD_BYTES = 32 << 20  # blocks at least this large still come from, and go back to, mmap


def cuda_indices(accelerator: Any, devices: Any) -> list[int]:
    """The CUDA device indices a run with this ``accelerator``/``devices`` trains on; ``[]`` for
    a run on the CPU (or on an accelerator that is not CUDA, or a machine without CUDA).

    ``devices`` as the Trainer takes it: a count, a list of indices, ``-1`` or ``"auto"``.
    """
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
    if value not in MATMUL_PRECISIONS:
        raise RunError(
            f"matmul_precision={value!r} is invalid; expected one of {', '.join(MATMUL_PRECISIONS)}"
        )
    if not cuda or any(torch.cuda.get_device_capability(i) < TF32_MIN_CAPABILITY for i in cuda):
        return torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    return value


def keep_freed_memory(enabled: Any) -> bool:
    """Let this process keep the memory a training step frees for the next step (glibc's malloc,
    on Linux); return whether that is in force. ``False`` leaves the allocator as it is.

    Why: each step frees its activations and gradients and allocates the same sizes again at the
    next one. By default glibc hands large freed blocks back to the kernel (``munmap``, or a trim
    of the heap's top past a threshold that adapts up to 64 MB), so the next step page-faults
    them in again, zeroed: on the default network ~2,000 faults a step, 15 to 25 % of a CPU step
    (the template repository's loop-parity benchmark). PyTorch's CPU tuning guide gets this by
    swapping the allocator (jemalloc, tcmalloc with ``LD_PRELOAD``); glibc's own ``mallopt``
    does it in process, with nothing to install: the mmap threshold fixed at 32 MB (larger
    blocks are still mapped and returned at once) and the trim threshold at 1 GiB (up to that
    much freed memory stays with the process, so its resident size stays near its high-water
    mark). GPU runs allocate little on the host and are unaffected either way. Process-wide and
    not undone: every rank and entry point calls this in its own process.
    """
    if not isinstance(enabled, bool):
        raise RunError(f"keep_freed_memory={enabled!r} is invalid; expected true or false")
    if not enabled or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and libc.mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES)
    )


def resolve_precision(value: Any, cuda: Sequence[int]) -> str:
    """``auto`` -> ``bf16-mixed`` when every GPU the run uses has native bf16 (Ampere and newer),
    else ``32-true`` (the CPU included: bf16 there is slow on most processors);
    any other value is a Lightning precision and is returned as it is (as text).
    """
    text = str(value).strip()
    if text != "auto":
        if text not in LIGHTNING_PRECISIONS:
            raise RunError(
                f"precision={value!r} is invalid; expected auto or one of "
                f"{', '.join(LIGHTNING_PRECISIONS)}"
            )
        return text
    if not cuda:
        return "32-true"
    # Native bf16 arithmetic starts with Ampere (capability 8.0), as torch.cuda.is_bf16_supported
    # decides for the current device; here every device of the run is asked.
    if all(torch.cuda.get_device_capability(i) >= BF16_MIN_CAPABILITY for i in cuda):
        return "bf16-mixed"
    return "32-true"


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
    if isinstance(batch, torch.Tensor):
        return batch.contiguous(memory_format=torch.channels_last) if batch.ndim == 4 else batch
    if isinstance(batch, list | tuple):
        return type(batch)(to_channels_last(item) for item in batch)
    return batch


def uses_channels_last(enabled: bool, device: Any) -> bool:
    """Whether channels-last applies: switched on, and the module lives on a CUDA device."""
    return bool(enabled) and getattr(device, "type", str(device)) == "cuda"


def describe(matmul: str, precision: str, cuda: Sequence[int], kept: bool = False) -> str:
    """One log line with the choices in force, so a run's log says how it ran."""
    where = f"cuda:{','.join(map(str, cuda))}" if cuda else "cpu"
    memory = ", freed memory kept" if kept else ""
    return f"Speed: precision={precision}, float32 matmul precision={matmul}{memory} ({where})"


class NetworkSpeedups(Callback):
    """``callbacks.speed``: ``torch.compile`` and channels-last for the LightningModule's network.

    Both act on ``pl_module.<network>`` (``net`` by default) in ``setup``, before the strategy
    moves the module to its device and wraps it (DDP):

    * ``compile``: :func:`maybe_compile`, in place, once.
    * ``channels_last``: on a CUDA run of a network with a 2-D convolution, the network's weights
      go NHWC, and a forward pre-hook converts its 4-D inputs (removed again at ``teardown``).
      On the CPU, and for networks without convolutions, nothing changes.

    A LightningModule without that attribute is left alone, with one line from rank 0 saying so
    on a CUDA run (on the CPU channels-last means nothing, so nothing is said; ``compile=true``
    then fails in one line, since it was asked for explicitly).
    """

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
        device = getattr(trainer.strategy, "root_device", None)
        if not isinstance(net, nn.Module):
            if self.compile:
                raise RunError(
                    f"callbacks.speed.compile=true compiles {type(pl_module).__name__}."
                    f"{self.network}, but there is no such network; set callbacks.speed.network "
                    "to the attribute holding it"
                )
            # Only where channels-last would have applied (CUDA), and once, not once per rank.
            on_cuda = uses_channels_last(self.channels_last, device)
            if on_cuda and stage == "fit" and trainer.is_global_zero:
                log.info(
                    "callbacks.speed: %s has no nn.Module attribute %r, so channels_last is not "
                    "applied; set callbacks.speed.network to the attribute holding your network",
                    type(pl_module).__name__,
                    self.network,
                )
            return
        has_conv = any(isinstance(m, nn.Conv2d) for m in net.modules())
        if uses_channels_last(self.channels_last, device) and has_conv:
            net.to(memory_format=torch.channels_last)
            if self._input_hook is None:
                self._input_hook = net.register_forward_pre_hook(_inputs_to_channels_last)
        # private: nn.Module.compile's marker, so a second setup (fit, then test) compiles once.
        if self.compile and getattr(net, "_compiled_call_impl", None) is None:
            maybe_compile(net, True)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._input_hook is not None:
            self._input_hook.remove()
            self._input_hook = None


def _inputs_to_channels_last(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return to_channels_last(args)


def trainer_settings(cfg: Any, plan: Any) -> dict[str, Any]:
    """The Trainer arguments a run decides for its hardware, with TF32 and
    :func:`keep_freed_memory` applied on the way.

    ``plan`` is the :class:`runkit.gpus.resolve.DevicePlan` (its accelerator and
    devices); ``precision`` is the top-level key resolved for those devices. Logs one line.
    """
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
        # Lightning would warn and run bf16-mixed; the line below says what runs, once.
        if rank_zero_only.rank == 0:
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
        log.info(describe(matmul, precision, cuda, kept))
    return kwargs


class NoProfiler(Profiler):
    """A Lightning profiler that times nothing, at the least cost per hook call.

    Lightning calls ``trainer.profiler.profile(name)`` around every hook of every callback, of the
    module and of the strategy: about 90 a training step with the template's callbacks. Its
    default, ``PassThroughProfiler``, also times nothing, but through a ``@contextmanager``
    generator built, entered and closed each time (~3 us); this returns one shared
    ``nullcontext`` (~0.5 us). On a small model's 5 ms step that is ~4 % of the step.
    """

    def start(self, action_name: str) -> None:
        pass

    def stop(self, action_name: str) -> None:
        pass

    def profile(self, action_name: str) -> contextlib.nullcontext:
        return _NOTHING

    def summary(self) -> str:
        return ""


_NOTHING = contextlib.nullcontext()
