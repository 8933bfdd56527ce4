"""What NVML and torch say about the GPUs, as plain frozen data, and CUDA's rules for which
physical GPU is ``cuda:N`` (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``, the MIG limits): pure
functions used when torch gives no UUIDs to match. The rules and their sources are in
lib/runkit/docs/cuda-visible-devices.md. nvitop misses unique UUID prefixes, ``+1``, PCI bus order
and the R570 MIG rule, and its ``Device`` reads a module-level NVML the fake cannot reach."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from runkit.errors import RunError

DEVICE_ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")  # CUDA uses the first for anything else
MAX_MIG_DEVICES = 64  # in one CUDA process, across all GPUs (R570+)
ORDINAL = re.compile(r"\s*([+-]?\d+)")  # strtoul: blanks, an optional sign, the leading digits


class DeviceError(RunError, ValueError):
    """The accelerator/devices asked for cannot be had; one line naming what was asked and exists."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_mib: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class Gpu:
    """One GPU or MIG device; ``nvml_index`` is its physical GPU's; ``None``: not known."""

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
    """The GPUs as this process sees them: ``visible[i]`` is ``cuda:i``; ``mapping`` says how that
    was found (``torch-uuid``, ``env-rules``, ``torch-only`` or ``none``)."""

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
        if n := self.usable_gpu_count:
            return f"{n} CUDA GPU{'s' * (n != 1)} visible; training can use cuda:0..cuda:{n - 1}."
        return f"No usable GPU: {no_gpu_reason(self)}; training will use the CPU."


def no_gpu_reason(inv: Inventory) -> str:
    """Why ``inv`` offers no GPU; a ``CUDA_VISIBLE_DEVICES`` hiding them all is named first."""
    value = inv.cuda_visible_devices
    if value is not None and value.strip() == "":
        return "CUDA_VISIBLE_DEVICES is set to an empty string"
    why = first_entry_problem(value)
    if why or (value is not None and inv.physical and not inv.visible):
        return f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU" + (f": {why}" if why else "")
    if n := inv.physical and not inv.torch.available and len(inv.physical):
        return f"NVML sees {n} GPU{'s' * (n != 1)} but torch has no CUDA (CPU-only build?)"
    return inv.nvml_reason if not inv.nvml_available and inv.nvml_reason else "no NVIDIA GPU found"


def list_kind(value: str) -> str:
    """What the whole list holds, decided by how the value starts, as torch decides it."""
    return {"GPU-": "GPU- UUIDs", "MIG-": "MIG- UUIDs"}.get(value[:4], "indices")


def first_entry_problem(cuda_visible_devices: str | None) -> str | None:
    """Why a list of indices hides every GPU on any machine (its first entry is no index >= 0),
    or None: said without NVML, where the GPU count is unknown."""
    value = cuda_visible_devices or ""
    if not value.strip() or list_kind(value) != "indices":
        return None
    first = value.split(",")[0]
    if (match := ORDINAL.match(first)) and int(match.group(1)) >= 0:
        return None
    return (
        f"its first entry {first!r} is not a GPU index or UUID, and CUDA ignores the list from "
        "its first invalid entry on"
    )


def apply_mig_limits(units: Sequence[Gpu], driver: str | None) -> tuple[list[Gpu], list[str]]:
    """What CUDA enumerates of ``units`` by the driver's MIG rule: before R570 one MIG device and
    no other GPU; from R570 (or unknown) one per GPU instance, at most 64."""
    mig = [u for u in units if u.is_mig]
    if (major := re.match(r"\s*(\d+)", driver or "")) and mig and int(major.group(1)) < 570:
        note = (
            f"driver {driver} (before R570): CUDA enumerates one MIG device and no other GPU; "
            f"shown: {mig[0].uuid} (the first in CUDA order; which one CUDA takes is not "
            "documented)."
        )
        return [mig[0]], [note] if len(units) > 1 else []
    seen: set[tuple[str | None, object]] = set()
    shown, dropped = [], []
    for unit in units:
        gi = unit.gpu_instance_id
        key = (unit.parent_uuid, unit.uuid if gi is None else gi)
        if unit.is_mig and (key in seen or len(seen) >= MAX_MIG_DEVICES):
            dropped.append(unit.uuid)
            continue
        seen.update([key] if unit.is_mig else [])
        shown.append(unit)
    return shown, [
        "CUDA enumerates one compute instance per GPU instance and at most "
        f"{MAX_MIG_DEVICES} MIG devices; not shown: {', '.join(dropped)} (which compute "
        "instance CUDA takes is not documented; the first in CUDA order is assumed)."
    ][: bool(dropped)]


def cuda_enumeration(physical: Sequence[Gpu], order: str | None) -> tuple[list[Gpu], list[str]]:
    """Physical GPUs in CUDA's order: PCI bus order (NVML's where a bus id is missing), which
    ``FASTEST_FIRST`` equals unless the models differ: then a note."""
    no_bus = any(g.pci_bus_id is None for g in physical)
    ordered = sorted(physical, key=lambda g: ("" if no_bus else g.pci_bus_id, g.nvml_index or 0))
    if (order or "").strip().upper() == "PCI_BUS_ID" or len({g.name for g in physical}) < 2:
        return ordered, []
    return ordered, [
        "CUDA_DEVICE_ORDER is FASTEST_FIRST (CUDA's default) and the GPUs are different "
        "models, so CUDA may number them differently from PCI bus order; the indices shown "
        "assume PCI order. Set CUDA_DEVICE_ORDER=PCI_BUS_ID to make them exact."
    ]


def _find(raw: str, kind: str, physical: Sequence[Gpu], enumeration: Sequence[Gpu]) -> Gpu | str:
    """The device one entry names in a list of ``kind``, or why none (which ends the list)."""
    wrong = f"is not of the list's kind ({kind}, set by its first entry)"
    if kind == "indices":
        if raw.strip().startswith(("GPU-", "MIG-")):
            return wrong
        ordinal = int(match.group(1)) if (match := ORDINAL.match(raw)) else -1
        return enumeration[ordinal] if 0 <= ordinal < len(enumeration) else "names no GPU here"
    slices = [c for g in physical for c in g.mig_devices]
    old = re.fullmatch(r"MIG-(GPU-[^/]+)/(\d+)/(\d+)", raw.strip())  # before driver R470
    if old and kind == "MIG- UUIDs":
        ids = (old.group(1), int(old.group(2)), int(old.group(3)))
        hits = [
            c for c in slices if (c.parent_uuid, c.gpu_instance_id, c.compute_instance_id) == ids
        ]
    elif not raw.startswith(kind[:4]):  # torch compares raw entries: a blank first ends the list
        return wrong
    else:
        hits = [g for g in (slices if kind == "MIG- UUIDs" else physical) if g.uuid.startswith(raw)]
    if len(hits) != 1:
        return "matches more than one GPU" if hits else "names no GPU here"
    return hits[0]


def apply_visible_devices(
    physical: Sequence[Gpu],
    cuda_visible_devices: str | None,
    order: str | None = None,
    driver_version: str | None = None,
) -> tuple[list[Gpu], list[str]]:
    """The GPUs CUDA shows out of NVML's ``physical`` list (``result[i]`` is ``cuda:i``) and notes
    explaining any surprise; ``driver_version`` decides the MIG rule."""
    enumeration, notes = cuda_enumeration(physical, order)
    value = cuda_visible_devices
    if value is not None and not value.strip():
        return [], [*notes, "CUDA_VISIBLE_DEVICES is empty, which hides every GPU."]
    picked: list[Gpu] = []
    entries = [] if value is None else value.split(",")
    for position, raw in enumerate(entries):
        found = _find(raw, list_kind(value or ""), physical, enumeration)
        if isinstance(found, str):
            notes.append(
                f"CUDA_VISIBLE_DEVICES entry {raw!r} {found}; CUDA stops at the first invalid "
                f"entry, so {','.join(entries[position:])!r} is ignored."
            )
            break
        if found in picked:
            notes.append(
                f"CUDA_VISIBLE_DEVICES names {raw.strip()!r} twice; CUDA then shows no GPU at all."
            )
            return [], notes
        picked.append(found)
    units = [
        unit
        for gpu in (enumeration if value is None else picked)
        for unit in (gpu.mig_devices if gpu.mig_enabled else [gpu])
    ]
    shown, mig_notes = apply_mig_limits(units, driver_version)
    return shown, notes + mig_notes
