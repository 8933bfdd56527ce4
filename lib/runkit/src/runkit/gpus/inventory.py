"""The GPUs of this machine as plain data, and which one is ``cuda:N`` for this process: torch's
UUIDs matched to NVML where torch has them, else CUDA's ``CUDA_VISIBLE_DEVICES`` /
``CUDA_DEVICE_ORDER`` / MIG rules (lib/runkit/docs/cuda-visible-devices.md). nvitop misses unique
UUID prefixes, ``+1``, PCI bus order and the R570 MIG rule, and cannot read the fake NVML."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from runkit.errors import RunError
from runkit.gpus import nvml
from runkit.gpus.reader import DeviceReader

DEVICE_ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")  # CUDA uses the first for anything else
MAX_MIG_DEVICES = 64  # in one CUDA process, across all GPUs (R570+)
ORDINAL = re.compile(r"\s*([+-]?\d+)")  # strtoul: blanks, an optional sign, the leading digits
IDENTITY, FULL = "identity", "full"  # how much of NVML to read: names and UUIDs, or everything


class DeviceError(RunError, ValueError):
    """The accelerator/devices asked for cannot be had (one line)."""


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
        if n := self.usable_gpu_count:
            return f"{n} CUDA GPU{'s' * (n != 1)} visible; training can use cuda:0..cuda:{n - 1}."
        return f"No usable GPU: {no_gpu_reason(self)}; training will use the CPU."


def no_gpu_reason(inv: Inventory) -> str:
    value = inv.cuda_visible_devices
    if value is not None and value.strip() == "":
        return "CUDA_VISIBLE_DEVICES is set to an empty string"
    why = first_entry_problem(value)
    if why or (value is not None and inv.physical and not inv.visible):
        return f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU" + (f": {why}" if why else "")
    if (n := len(inv.physical)) and not inv.torch.available:
        return f"NVML sees {n} GPU{'s' * (n != 1)} but torch has no CUDA (CPU-only build?)"
    return inv.nvml_reason if not inv.nvml_available and inv.nvml_reason else "no NVIDIA GPU found"


def list_kind(value: str) -> str:
    return {"GPU-": "GPU- UUIDs", "MIG-": "MIG- UUIDs"}.get(value[:4], "indices")


def first_entry_problem(cuda_visible_devices: str | None) -> str | None:
    """Why a list of indices hides every GPU on any machine (its first entry is no index >= 0)."""
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
    """What CUDA enumerates of ``units`` by the driver's MIG rule (changed in R570)."""
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
        key = (
            unit.parent_uuid,
            unit.uuid if unit.gpu_instance_id is None else unit.gpu_instance_id,
        )
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


def _find(raw: str, kind: str, physical: Sequence[Gpu], enumeration: Sequence[Gpu]) -> Gpu | str:
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
    """The GPUs CUDA shows out of NVML's ``physical`` list (``result[i]`` is ``cuda:i``), in PCI bus
    order, and notes explaining any surprise."""
    no_bus = any(g.pci_bus_id is None for g in physical)
    enumeration = sorted(
        physical, key=lambda g: ("" if no_bus else g.pci_bus_id, g.nvml_index or 0)
    )
    notes = []
    if (order or "").strip().upper() != "PCI_BUS_ID" and len({g.name for g in physical}) > 1:
        notes.append(
            "CUDA_DEVICE_ORDER is FASTEST_FIRST (CUDA's default) and the GPUs are different "
            "models, so CUDA may number them differently from PCI bus order; the indices shown "
            "assume PCI order. Set CUDA_DEVICE_ORDER=PCI_BUS_ID to make them exact."
        )
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


def probe_torch(*, uuids: bool = True) -> TorchCuda:
    """Ask torch about CUDA; ``uuids=False`` only counts, so that CUDA stays uninitialised."""
    import torch

    mps, version = torch.backends.mps.is_available(), torch.version.cuda
    if not uuids:
        count = torch.cuda.device_count()
        return TorchCuda(count > 0, count, version=version, mps_available=mps)
    if not torch.cuda.is_available():
        return TorchCuda(version=version, mps_available=mps)
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    uuid_list = tuple(str(getattr(p, "uuid", "")) for p in props)
    return TorchCuda(True, len(props), uuid_list, tuple(p.name for p in props), version, mps)


def _mib(value: Any) -> int | None:
    return None if value is None else int(value) // 2**20


def _read_gpu(reader: DeviceReader, detail: str, **where: Any) -> Gpu:
    lib = reader.lib
    figures: dict[str, Any] = {}
    if detail == FULL:
        total, used, free = nvml.optional(lib, reader.memory) or (None, None, None)
        util = nvml.optional(lib, reader.utilization)
        figures.update(memory_total_mib=_mib(total), memory_used_mib=_mib(used))
        figures.update(memory_free_mib=_mib(free), utilization_percent=util and util[0])
        if not reader.is_mig:  # a slice has no temperature or power of its own: its GPU has
            power, limit = (nvml.optional(lib, q) for q in (reader.power_mw, reader.power_limit_mw))
            figures.update(power_w=power and power / 1000, power_limit_w=limit and limit / 1000)
            figures["temperature_c"] = nvml.optional(lib, reader.temperature_c)
        seen: dict[int, GpuProcess] = {}
        for kind in ("Compute", "Graphics"):
            for pid, mem in nvml.optional(lib, reader.compute_processes, kind) or ():
                name = nvml.as_text(nvml.optional(lib, "nvmlSystemGetProcessName", pid) or "")
                seen.setdefault(pid, GpuProcess(pid, _mib(mem), name or None))
        figures["processes"] = tuple(seen.values())
    return Gpu(
        nvml.optional(lib, reader.uuid) or "",
        nvml.optional(lib, reader.name) or "unknown GPU",
        pci_bus_id=nvml.optional(lib, reader.pci_bus_id),
        **figures,
        **where,
    )


def read_nvml(detail: str = FULL) -> tuple[list[Gpu], str | None, list[str]]:
    """Every physical GPU (with its MIG devices) in NVML order, the driver version, and notes."""
    gpus: list[Gpu] = []
    notes: list[str] = []
    with nvml.nvml_session() as lib:
        driver = nvml.optional(lib, "nvmlSystemGetDriverVersion")
        for index in range(lib.nvmlDeviceGetCount()):
            try:
                reader = DeviceReader(lib, lib.nvmlDeviceGetHandleByIndex(index))
            except lib.NVMLError as err:
                notes.append(f"NVML cannot open GPU {index} ({err}); it is listed without details.")
                gpus.append(Gpu("", "unreadable GPU", nvml_index=index, error=str(err)))
                continue
            mig_on = bool(nvml.optional(lib, reader.mig_enabled))
            gpu = _read_gpu(reader, detail, nvml_index=index, mig_enabled=mig_on)
            slices = tuple(
                _read_gpu(child, detail, nvml_index=index, parent_uuid=gpu.uuid, mig_index=slot,
                          gpu_instance_id=nvml.optional(lib, child.gpu_instance_id),
                          compute_instance_id=nvml.optional(lib, child.compute_instance_id))
                for slot, child in (reader.mig_slices() if mig_on else ())
            )  # fmt: skip
            gpus.append(replace(gpu, mig_devices=slices))
    return gpus, driver and nvml.as_text(driver), notes


def build_inventory(
    physical: Sequence[Gpu] | None,
    torch_info: TorchCuda,
    *,
    env: Mapping[str, str] | None = None,
    nvml_reason: str | None = None,
    driver_version: str | None = None,
    notes: Sequence[str] = (),
) -> Inventory:
    """NVML's GPUs (``None``: unavailable, ``nvml_reason`` says why) numbered as torch sees them."""
    env = os.environ if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    order = (env.get("CUDA_DEVICE_ORDER") or "FASTEST_FIRST").strip().upper()
    notes = list(notes)
    if order not in DEVICE_ORDERS:
        notes.append(
            f"CUDA_DEVICE_ORDER={order!r} is not one of {', '.join(DEVICE_ORDERS)}; "
            "CUDA uses FASTEST_FIRST."
        )
        order = "FASTEST_FIRST"
    if physical is None or (torch_info.available and torch_info.uuids and all(torch_info.uuids)):
        # cuda:i as torch names it, matched by UUID to NVML's devices where NVML answers
        by_uuid = {nvml.bare_uuid(g.uuid): g for p in physical or () for g in (p, *p.mig_devices)}
        names, uuids = torch_info.names or (), torch_info.uuids or ()
        visible = []
        for i in range(torch_info.device_count if torch_info.available else 0):
            uuid = uuids[i] if i < len(uuids) else ""
            if (gpu := by_uuid.get(nvml.bare_uuid(uuid))) is None and physical is not None:
                notes.append(f"cuda:{i} ({uuid}) is not in NVML's list; shown without metrics.")
            name = "unknown GPU" if physical is not None else f"cuda:{i}"
            visible.append(gpu or Gpu(uuid, names[i] if i < len(names) else name))
        mapping = ("torch-only" if visible else "none") if physical is None else "torch-uuid"
    else:
        visible, extra = apply_visible_devices(physical, cvd, order, driver_version)
        mapping, notes = ("env-rules" if visible else "none"), notes + extra
        if torch_info.available and torch_info.device_count != len(visible):
            notes.append(
                f"torch sees {torch_info.device_count} CUDA device(s) but the CUDA_VISIBLE_DEVICES "
                f"rules give {len(visible)}; trust torch's count, the GPU details may be misplaced."
            )
    return Inventory(
        torch_info, physical is not None, nvml_reason, driver_version, cvd, order, mapping,
        tuple(physical or ()), tuple(visible), tuple(notes),
    )  # fmt: skip


def _reading(detail: str) -> dict[str, Any]:
    try:
        physical, driver, notes = read_nvml(detail)
        return {"physical": physical, "driver_version": driver, "notes": notes}
    except nvml.NvmlUnavailable as err:
        return {"physical": None, "nvml_reason": str(err)}


def collect_inventory(
    *,
    torch_info: TorchCuda | None = None,
    env: Mapping[str, str] | None = None,
    probe_uuids: bool = True,
    detail: str = FULL,
) -> Inventory:
    torch_info = torch_info or probe_torch(uuids=probe_uuids)
    return build_inventory(torch_info=torch_info, env=env, **_reading(detail))


@functools.lru_cache(maxsize=1)
def _kept_reading(lib: Any) -> dict[str, Any]:
    return _reading(IDENTITY)


def cached_inventory() -> Inventory:
    """The inventory device resolution uses: NVML read once per job (:func:`forget_readings`)."""
    try:
        lib = nvml.load_library()
    except nvml.NvmlUnavailable:
        lib = None
    return build_inventory(torch_info=probe_torch(uuids=False), **_kept_reading(lib))


def forget_readings() -> None:
    _kept_reading.cache_clear()
