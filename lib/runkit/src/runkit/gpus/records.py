"""What NVML and torch say about the GPUs as plain frozen data, and why none is usable (no NVML
or torch here; the first-entry rule of ``CUDA_VISIBLE_DEVICES`` lives here for that)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from runkit.errors import RunError


class DeviceError(RunError, ValueError):
    """The accelerator/devices asked for cannot be had; one line naming what was asked and exists."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_mib: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class Gpu:
    """One GPU or MIG device; ``nvml_index`` is its physical GPU's; ``None``: not known.

    Why not nvitop's ``Device``: it queries a module-level NVML state the fake cannot reach."""

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
        return self.parent_uuid is not None


@dataclass(frozen=True)
class TorchCuda:
    """What torch says about CUDA (``uuids``: ``None`` unless probed, which initialises CUDA)."""

    available: bool = False
    device_count: int = 0
    uuids: tuple[str, ...] | None = None
    names: tuple[str, ...] | None = None
    version: str | None = None
    mps_available: bool = False


@dataclass(frozen=True)
class Inventory:
    """The GPUs from this process's point of view: ``visible[i]`` is ``cuda:i``; ``mapping`` says
    how that was found (``torch-uuid``, ``env-rules``, ``torch-only`` or ``none``)."""

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
        return self.torch.device_count if self.torch.available else 0

    @property
    def hidden(self) -> tuple[Gpu, ...]:
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
    """Why ``inv`` offers training no GPU, in a few words; a ``CUDA_VISIBLE_DEVICES`` that hides
    every GPU is named first, so that a mistyped value is not taken for a machine without GPUs."""
    value = inv.cuda_visible_devices
    if value is not None and value.strip() == "":
        return "CUDA_VISIBLE_DEVICES is set to an empty string"
    why = first_entry_problem(value)
    if why or (value is not None and inv.physical and not inv.visible):
        return f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU" + (f": {why}" if why else "")
    if inv.physical and not inv.torch.available:
        n = len(inv.physical)
        return f"NVML sees {n} GPU{'s' if n != 1 else ''} but torch has no CUDA (CPU-only build?)"
    if not inv.nvml_available and inv.nvml_reason:
        return inv.nvml_reason
    return "no NVIDIA GPU found"


ORDINAL = re.compile(r"\s*([+-]?\d+)")  # strtoul: blanks, an optional sign, the leading digits


def list_kind(value: str) -> str:
    """What the whole list holds, decided by how the value starts, as torch decides it."""
    return {"GPU-": "GPU- UUIDs", "MIG-": "MIG- UUIDs"}.get(value[:4], "indices")


def first_entry_problem(cuda_visible_devices: str | None) -> str | None:
    """Why a list of indices hides every GPU on any machine (its first entry is not an index
    >= 0, so CUDA reads nothing), or None: said without NVML, where the GPU count is unknown."""
    value = cuda_visible_devices or ""
    if not value.strip() or list_kind(value) != "indices":
        return None
    first = value.split(",")[0]
    match = ORDINAL.match(first)
    if match and int(match.group(1)) >= 0:
        return None
    return (
        f"its first entry {first!r} is not a GPU index or UUID, and CUDA ignores the list from "
        "its first invalid entry on"
    )
