"""The GPU records: what NVML and torch say about the GPUs, as plain frozen data.

Shared by every module of :mod:`runkit.gpus`; no NVML, no torch here. Also the one
error of device resolution and claiming, :class:`DeviceError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from runkit.errors import RunError


class DeviceError(RunError, ValueError):
    """The requested accelerator/devices cannot be satisfied; the message is one line naming what
    was asked and what exists."""


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU, as NVML reports it."""

    pid: int
    used_memory_mib: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class Gpu:
    """One GPU or one MIG device, as read from NVML (or only from torch when NVML is missing).

    ``nvml_index`` is the physical GPU's NVML index (PCI bus order), also for its MIG devices;
    ``None`` when the entry comes only from torch. Metrics NVML cannot give, or that were not
    read at the detail asked, are ``None``.

    Why not nvitop's ``Device``: a plain record, read once; nvitop's devices query a module-level
    NVML state the fake NVML cannot reach (the library's design notes).
    """

    uuid: str
    name: str
    nvml_index: int | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None
    utilization_percent: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    pci_bus_id: str | None = None
    processes: tuple[GpuProcess, ...] = ()
    mig_enabled: bool = False
    mig_devices: tuple[Gpu, ...] = ()
    parent_uuid: str | None = None
    mig_index: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    error: str | None = None

    @property
    def is_mig(self) -> bool:
        """True for a MIG device (a slice of a physical GPU)."""
        return self.parent_uuid is not None


@dataclass(frozen=True)
class TorchCuda:
    """What torch says about CUDA: the injectable seam that lets CPU-only tests fake a GPU box.

    ``uuids`` holds ``torch.cuda.get_device_properties(i).uuid`` per ``cuda:i`` when probed;
    ``None`` when not probed (probing initialises CUDA, which a process that will later fork DDP
    workers must not do).
    """

    available: bool = False
    device_count: int = 0
    uuids: tuple[str, ...] | None = None
    names: tuple[str, ...] | None = None
    version: str | None = None
    mps_available: bool = False


@dataclass(frozen=True)
class Inventory:
    """Everything known about the GPUs of this machine, from this process's point of view.

    ``visible[i]`` is the GPU that ``cuda:i`` means. ``mapping`` says how that was established:
    ``"torch-uuid"`` (torch's UUIDs matched to NVML: exact), ``"env-rules"`` (CUDA's rules for
    ``CUDA_VISIBLE_DEVICES``/``CUDA_DEVICE_ORDER`` applied to NVML's list), ``"torch-only"`` (no
    NVML: names from torch, no metrics) or ``"none"`` (no GPU at all).
    """

    torch: TorchCuda
    nvml_available: bool
    nvml_reason: str | None = None
    driver_version: str | None = None
    cuda_visible_devices: str | None = None
    cuda_device_order: str = "FASTEST_FIRST"
    mapping: str = "none"
    physical: tuple[Gpu, ...] = ()
    visible: tuple[Gpu, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def usable_gpu_count(self) -> int:
        """How many ``cuda:N`` devices training can use: torch's count, or 0 without torch CUDA."""
        return self.torch.device_count if self.torch.available else 0

    @property
    def hidden(self) -> tuple[Gpu, ...]:
        """Physical GPUs NVML sees that CUDA will not show this process."""
        shown = {g.uuid for g in self.visible} | {g.parent_uuid for g in self.visible}
        return tuple(g for g in self.physical if g.uuid not in shown)

    def summary(self) -> str:
        """One line: how many GPUs training can use, or why it will use the CPU."""
        n = self.usable_gpu_count
        if n:
            plural = "s" if n != 1 else ""
            return f"{n} CUDA GPU{plural} visible; training can use cuda:0..cuda:{n - 1}."
        return f"No usable GPU: {no_gpu_reason(self)}; training will use the CPU."


def no_gpu_reason(inv: Inventory) -> str:
    """Why ``inv`` offers training no GPU, in a few words."""
    if inv.cuda_visible_devices is not None and inv.cuda_visible_devices.strip() == "":
        return "CUDA_VISIBLE_DEVICES is set to an empty string"
    if inv.physical and not inv.torch.available:
        n = len(inv.physical)
        return f"NVML sees {n} GPU{'s' if n != 1 else ''} but torch has no CUDA (CPU-only build?)"
    if inv.physical and not inv.visible:
        return f"CUDA_VISIBLE_DEVICES={inv.cuda_visible_devices!r} hides every GPU"
    if not inv.nvml_available and inv.nvml_reason:
        return inv.nvml_reason
    return "no NVIDIA GPU found"
