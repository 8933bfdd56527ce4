"""What GPUs this process may use, which ``cuda:N`` each one is, and which ones to train on.

Three jobs share one module because they share one question, "which physical GPU is ``cuda:N``?":

* :func:`collect_inventory` reads every GPU from NVML (name, UUID, memory, load, processes, MIG
  children) and works out which of them CUDA will show this process, in what order, following
  ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``. ``python -m project.devices`` prints it.
* :func:`resolve_devices` turns the ``accelerator``/``devices`` the user typed into what the
  Lightning ``Trainer`` gets, before anything is built, so that "4 GPUs on a 2-GPU machine" is one
  clear line instead of a traceback from deep inside Lightning, and "no GPU" falls back to the CPU
  with one message.
* ``select="least_used"`` picks the N GPUs with the most free memory (then the lowest utilisation,
  then the lowest index) and makes every DDP rank agree on that choice.

Why the index mapping is subtle: NVML numbers GPUs in PCI bus order, while CUDA numbers them in
``CUDA_DEVICE_ORDER`` (default ``FASTEST_FIRST``, which may differ on a machine with mixed GPUs),
then filters and reorders them by ``CUDA_VISIBLE_DEVICES``. When torch can see CUDA the listing
matches each ``cuda:N`` to NVML by UUID (exact); otherwise it applies CUDA's documented rules:

* entries are comma separated; each is a device ordinal (parsed like ``strtoul``: leading digits
  count, so ``"1gpu"`` means 1), a ``GPU-`` UUID or a prefix of one that matches exactly one GPU,
  or a ``MIG-`` UUID (also the pre-R470 form ``MIG-GPU-<uuid>/<gi>/<ci>``);
* the list ends at the first entry that is invalid (negative, out of range, unknown or ambiguous
  UUID), so ``0,2,-1,1`` shows devices 0 and 2;
* a device named twice hides every device (torch's NVML-based counting encodes the same rule);
* an empty string hides every GPU;
* a GPU in MIG mode cannot run CUDA work itself; CUDA shows its MIG devices instead.

Importing this module is cheap (no torch, no Lightning, no Rich): torch is imported inside the
functions that need it, so ``python -m project.devices`` answers quickly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from project.errors import ProjectError
from project.machinery.gpus import nvml

SELECTION_ENV = "PROJECT_GPU_SELECTION"
"""Environment variable through which DDP rank 0 hands its ``least_used`` choice to the other
ranks (Lightning's subprocess launcher re-runs the command line; children inherit the env)."""

SELECT_CHOICES = ("first", "least_used")
"""Accepted values of ``select`` (config key ``select_gpus``)."""

JSON_SCHEMA_VERSION = 1
"""Bumped whenever a key of ``python -m project.devices --json`` changes meaning or goes away."""

_MIB = 1024 * 1024
_ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")


class DeviceError(ProjectError, ValueError):
    """The requested accelerator/devices cannot be satisfied; the message is one line naming what
    was asked and what exists."""


# --------------------------------------------------------------------------------------------
# Data


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
    ``None`` when the entry comes only from torch. Metrics NVML cannot give are ``None``.
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
        return f"No usable GPU: {_no_gpu_reason(self)}; training will use the CPU."


@dataclass(frozen=True)
class DevicePlan:
    """What to give the Lightning ``Trainer``: ``Trainer(accelerator=plan.accelerator,
    devices=plan.devices)`` (or ``**plan.trainer_kwargs()``).

    ``message`` is one line for the caller to log once (CPU fallback, the GPUs chosen by load);
    ``None`` when there is nothing worth saying. ``gpus`` describes the chosen GPUs when known.
    """

    accelerator: Any
    devices: int | str | list[int]
    message: str | None = None
    selected: tuple[int, ...] | None = None
    gpus: tuple[Gpu, ...] = ()

    def trainer_kwargs(self) -> dict[str, Any]:
        """``accelerator`` and ``devices`` as keyword arguments for ``lightning.pytorch.Trainer``.

        A fresh list each call, so the Trainer cannot alter the plan."""
        devices = list(self.devices) if isinstance(self.devices, list) else self.devices
        return {"accelerator": self.accelerator, "devices": devices}


# --------------------------------------------------------------------------------------------
# Reading torch and NVML


def probe_torch(*, uuids: bool = True) -> TorchCuda:
    """Ask torch about CUDA.

    ``uuids=False`` only counts devices with ``torch.cuda.device_count()``, which torch answers
    from NVML without initialising CUDA, the same check Lightning makes (it sets
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``): a process that later forks DDP workers stays clean.
    ``uuids=True`` (the listing) runs the full ``is_available()`` check and reads each device's
    properties, which initialises CUDA in this process.
    """
    try:
        import torch
    except ImportError:
        return TorchCuda()
    mps_backend = getattr(torch.backends, "mps", None)
    mps = bool(mps_backend is not None and mps_backend.is_available())
    if not uuids:
        count = torch.cuda.device_count()
        return TorchCuda(count > 0, count, version=torch.version.cuda, mps_available=mps)
    if not torch.cuda.is_available():
        return TorchCuda(version=torch.version.cuda, mps_available=mps)
    count = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(count)]
    return TorchCuda(
        True,
        count,
        tuple(str(getattr(p, "uuid", "")) for p in props),
        tuple(p.name for p in props),
        torch.version.cuda,
        mps,
    )


def _call(lib: Any, name: str, *args: Any) -> Any:
    """One NVML query that may be unsupported on this GPU/driver (or missing from the bindings)."""
    func = getattr(lib, name, None)
    if func is None:
        return None
    try:
        return func(*args)
    except lib.NVMLError:
        return None


def _mib(value: Any) -> int | None:
    return None if value is None else int(value) // _MIB


def _processes(lib: Any, handle: Any) -> tuple[GpuProcess, ...]:
    seen: dict[int, GpuProcess] = {}
    for query in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        for proc in _call(lib, query, handle) or ():
            pid = int(proc.pid)
            if pid in seen:
                continue
            used = getattr(proc, "usedGpuMemory", None)
            name = _call(lib, "nvmlSystemGetProcessName", pid)
            seen[pid] = GpuProcess(pid, _mib(used), nvml.as_text(name) if name else None)
    return tuple(seen.values())


def _read_device(lib: Any, handle: Any, **extra: Any) -> Gpu:
    uuid = _call(lib, "nvmlDeviceGetUUID", handle)
    name = _call(lib, "nvmlDeviceGetName", handle)
    mem = _call(lib, "nvmlDeviceGetMemoryInfo", handle)
    util = _call(lib, "nvmlDeviceGetUtilizationRates", handle)
    temp_sensor = getattr(lib, "NVML_TEMPERATURE_GPU", 0)
    power = _call(lib, "nvmlDeviceGetPowerUsage", handle)
    limit = _call(lib, "nvmlDeviceGetEnforcedPowerLimit", handle)
    pci = _call(lib, "nvmlDeviceGetPciInfo", handle)
    bus_id = getattr(pci, "busId", None) if pci is not None else None
    return Gpu(
        uuid=nvml.as_text(uuid) if uuid else "",
        name=nvml.as_text(name) if name else "unknown GPU",
        memory_total_mib=_mib(getattr(mem, "total", None)),
        memory_used_mib=_mib(getattr(mem, "used", None)),
        memory_free_mib=_mib(getattr(mem, "free", None)),
        utilization_percent=None if util is None else int(util.gpu),
        temperature_c=_call(lib, "nvmlDeviceGetTemperature", handle, temp_sensor),
        power_w=None if power is None else power / 1000.0,
        power_limit_w=None if limit is None else limit / 1000.0,
        pci_bus_id=nvml.as_text(bus_id) if bus_id else None,
        processes=_processes(lib, handle),
        **extra,
    )


def _read_physical(lib: Any) -> tuple[list[Gpu], list[str]]:
    gpus: list[Gpu] = []
    notes: list[str] = []
    for index in range(lib.nvmlDeviceGetCount()):
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(index)
        except lib.NVMLError as err:
            notes.append(f"NVML cannot open GPU {index} ({err}); it is listed without details.")
            gpus.append(Gpu(uuid="", name="unreadable GPU", nvml_index=index, error=str(err)))
            continue
        mode = _call(lib, "nvmlDeviceGetMigMode", handle)
        mig_on = bool(mode) and mode[0] == getattr(lib, "NVML_DEVICE_MIG_ENABLE", 1)
        gpu = _read_device(lib, handle, nvml_index=index, mig_enabled=mig_on)
        if mig_on:
            children = []
            for slot in range(_call(lib, "nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
                child = _call(lib, "nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
                if child is None:  # empty slot: NVML says NOT_FOUND
                    continue
                children.append(
                    _read_device(
                        lib,
                        child,
                        nvml_index=index,
                        parent_uuid=gpu.uuid,
                        mig_index=slot,
                        gpu_instance_id=_call(lib, "nvmlDeviceGetGpuInstanceId", child),
                        compute_instance_id=_call(lib, "nvmlDeviceGetComputeInstanceId", child),
                    )
                )
            gpu = replace(gpu, mig_devices=tuple(children))
        gpus.append(gpu)
    return gpus, notes


def read_nvml() -> tuple[list[Gpu], str | None, list[str]]:
    """Every physical GPU (with its MIG devices) in NVML index order, the driver version, and notes
    about GPUs NVML could not open. Raises :class:`project.machinery.gpus.nvml.NvmlUnavailable` when NVML cannot
    start."""
    with nvml.nvml_session() as lib:
        driver = _call(lib, "nvmlSystemGetDriverVersion")
        gpus, notes = _read_physical(lib)
    return gpus, (nvml.as_text(driver) if driver else None), notes


# --------------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER


_ORDINAL = re.compile(r"\s*([+-]?)(\d+)")


def _cuda_units(gpu: Gpu) -> list[Gpu]:
    """What CUDA shows for a physical GPU: itself, or its MIG devices when MIG mode is on."""
    return list(gpu.mig_devices) if gpu.mig_enabled else [gpu]


def cuda_enumeration(physical: Sequence[Gpu], order: str | None) -> tuple[list[Gpu], list[str]]:
    """Physical GPUs in the order CUDA numbers them before ``CUDA_VISIBLE_DEVICES`` applies.

    ``PCI_BUS_ID`` is NVML's order (sorted by bus id where NVML reports one). CUDA's default
    ``FASTEST_FIRST`` ranks by an unpublished speed estimate and breaks ties by PCI bus id, so it
    equals PCI order when all GPUs are the same model; with mixed models the result is a guess and a
    note says so.
    """
    notes: list[str] = []
    ordered = sorted(physical, key=lambda g: (g.pci_bus_id or "", g.nvml_index or 0))
    if any(g.pci_bus_id is None for g in physical):
        ordered = sorted(physical, key=lambda g: g.nvml_index or 0)
    normalised = (order or "FASTEST_FIRST").strip().upper()
    if normalised != "PCI_BUS_ID" and len({g.name for g in physical}) > 1:
        notes.append(
            "CUDA_DEVICE_ORDER is FASTEST_FIRST (CUDA's default) and the GPUs are different "
            "models, so CUDA may number them differently from PCI bus order; the indices shown "
            "assume PCI order. Set CUDA_DEVICE_ORDER=PCI_BUS_ID to make them exact."
        )
    return ordered, notes


def _match_uuid(prefix: str, candidates: Sequence[Gpu]) -> Gpu | str | None:
    """The single candidate whose UUID starts with ``prefix``; ``"ambiguous"`` or ``None`` else."""
    hits = [g for g in candidates if g.uuid and g.uuid.startswith(prefix)]
    if len(hits) > 1:
        return "ambiguous"
    return hits[0] if hits else None


def _match_old_mig(entry: str, physical: Sequence[Gpu]) -> Gpu | None:
    """``MIG-GPU-<uuid>/<gpu instance>/<compute instance>``, the form used before driver R470."""
    match = re.fullmatch(r"MIG-(GPU-[^/]+)/(\d+)/(\d+)", entry)
    if not match:
        return None
    parent_uuid, gi, ci = match.group(1), int(match.group(2)), int(match.group(3))
    for gpu in physical:
        if gpu.uuid == parent_uuid:
            for child in gpu.mig_devices:
                if (child.gpu_instance_id, child.compute_instance_id) == (gi, ci):
                    return child
    return None


def apply_visible_devices(
    physical: Sequence[Gpu], cuda_visible_devices: str | None, order: str | None = None
) -> tuple[list[Gpu], list[str]]:
    """The GPUs CUDA shows, ``result[i]`` being ``cuda:i``, and notes explaining any surprise.

    Implements CUDA's rules as documented in the CUDA programming guide's environment-variable
    appendix (see the module docstring). ``physical`` is NVML's list of physical GPUs.
    """
    enumeration, notes = cuda_enumeration(physical, order)
    if cuda_visible_devices is None:
        return [unit for gpu in enumeration for unit in _cuda_units(gpu)], notes
    if cuda_visible_devices.strip() == "":
        notes.append("CUDA_VISIBLE_DEVICES is empty, which hides every GPU.")
        return [], notes
    all_mig = [child for gpu in physical for child in gpu.mig_devices]
    chosen: list[Gpu] = []
    picked_ids: list[str] = []
    entries = cuda_visible_devices.split(",")
    for position, raw in enumerate(entries):
        entry = raw.strip()
        found: Gpu | str | None = None
        if entry.startswith("GPU-"):
            found = _match_uuid(entry, physical)
        elif entry.startswith("MIG-GPU-"):
            found = _match_old_mig(entry, physical)
        elif entry.startswith("MIG-"):
            found = _match_uuid(entry, all_mig)
        else:
            match = _ORDINAL.match(raw)
            if match and match.group(1) != "-":
                ordinal = int(match.group(2))
                found = enumeration[ordinal] if ordinal < len(enumeration) else None
        if not isinstance(found, Gpu):
            why = "matches more than one GPU" if found == "ambiguous" else "names no GPU here"
            ignored = entries[position:]
            notes.append(
                f"CUDA_VISIBLE_DEVICES entry {raw!r} {why}; CUDA stops at the first invalid entry, "
                f"so {','.join(ignored)!r} is ignored."
            )
            break
        key = found.uuid or f"nvml:{found.nvml_index}"
        if key in picked_ids:
            notes.append(
                f"CUDA_VISIBLE_DEVICES names {raw.strip()!r} twice; CUDA then shows no GPU at all."
            )
            return [], notes
        picked_ids.append(key)
        chosen.extend([found] if found.is_mig else _cuda_units(found))
    return chosen, notes


def _bare_uuid(uuid: str) -> str:
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text


def _map_by_torch_uuid(
    physical: Sequence[Gpu], torch_info: TorchCuda
) -> tuple[list[Gpu], list[str]]:
    by_uuid: dict[str, Gpu] = {}
    for gpu in physical:
        by_uuid[_bare_uuid(gpu.uuid)] = gpu
        for child in gpu.mig_devices:
            by_uuid[_bare_uuid(child.uuid)] = child
    visible: list[Gpu] = []
    notes: list[str] = []
    names = torch_info.names or ()
    for i, uuid in enumerate(torch_info.uuids or ()):
        gpu = by_uuid.get(_bare_uuid(uuid))
        if gpu is None:
            name = names[i] if i < len(names) else "unknown GPU"
            notes.append(f"cuda:{i} ({uuid}) is not in NVML's list; shown without metrics.")
            gpu = Gpu(uuid=uuid, name=name)
        visible.append(gpu)
    return visible, notes


def _torch_only(torch_info: TorchCuda) -> list[Gpu]:
    names = torch_info.names or ()
    uuids = torch_info.uuids or ()
    return [
        Gpu(
            uuid=uuids[i] if i < len(uuids) else "",
            name=names[i] if i < len(names) else f"cuda:{i}",
        )
        for i in range(torch_info.device_count)
    ]


def build_inventory(
    physical: Sequence[Gpu] | None,
    torch_info: TorchCuda,
    *,
    env: Mapping[str, str] | None = None,
    nvml_reason: str | None = None,
    driver_version: str | None = None,
    notes: Sequence[str] = (),
) -> Inventory:
    """Combine NVML's GPUs (``None``: NVML unavailable, ``nvml_reason`` says why) with torch's view.

    Pure: everything it needs is an argument, which is what the tests feed with fakes.
    """
    env = os.environ if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    order = (env.get("CUDA_DEVICE_ORDER") or "FASTEST_FIRST").strip().upper()
    all_notes = list(notes)
    if order not in _ORDERS:
        all_notes.append(
            f"CUDA_DEVICE_ORDER={order!r} is not one of {', '.join(_ORDERS)}; "
            "CUDA uses FASTEST_FIRST."
        )
        order = "FASTEST_FIRST"
    base = {
        "torch": torch_info,
        "nvml_available": physical is not None,
        "nvml_reason": nvml_reason,
        "driver_version": driver_version,
        "cuda_visible_devices": cvd,
        "cuda_device_order": order,
    }
    if physical is None:
        visible = _torch_only(torch_info) if torch_info.available else []
        mapping = "torch-only" if visible else "none"
        return Inventory(**base, mapping=mapping, visible=tuple(visible), notes=tuple(all_notes))
    if torch_info.available and torch_info.uuids and all(torch_info.uuids):
        visible, extra = _map_by_torch_uuid(physical, torch_info)
        mapping = "torch-uuid"
    else:
        visible, extra = apply_visible_devices(physical, cvd, order)
        mapping = "env-rules" if visible else "none"
        if torch_info.available and torch_info.device_count != len(visible):
            extra.append(
                f"torch sees {torch_info.device_count} CUDA device(s) but the CUDA_VISIBLE_DEVICES "
                f"rules give {len(visible)}; trust torch's count, the GPU details may be misplaced."
            )
    all_notes.extend(extra)
    return Inventory(
        **base,
        mapping=mapping,
        physical=tuple(physical),
        visible=tuple(visible),
        notes=tuple(all_notes),
    )


def collect_inventory(
    *,
    torch_info: TorchCuda | None = None,
    env: Mapping[str, str] | None = None,
    probe_uuids: bool = True,
) -> Inventory:
    """Read NVML (through :mod:`project.machinery.gpus.nvml`) and torch, and build the :class:`Inventory`.

    ``torch_info`` replaces the torch probe (tests, or a caller that already asked torch);
    ``probe_uuids=False`` keeps CUDA uninitialised (see :func:`probe_torch`).
    """
    if torch_info is None:
        torch_info = probe_torch(uuids=probe_uuids)
    try:
        physical, driver, notes = read_nvml()
    except nvml.NvmlUnavailable as err:
        return build_inventory(None, torch_info, env=env, nvml_reason=str(err))
    return build_inventory(physical, torch_info, env=env, driver_version=driver, notes=notes)


def _no_gpu_reason(inv: Inventory) -> str:
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


# --------------------------------------------------------------------------------------------
# Resolution


def parse_devices(devices: Any) -> str | int | list[int]:
    """Normalise ``devices`` to ``"auto"``, a count (``-1`` = all) or a list of indices.

    Accepts what users type on a Hydra command line or in YAML: ``2``, ``-1``, ``"auto"``,
    ``"2"``, ``"0,1"``, ``"[0,1]"``, ``[0, 1]`` (also an OmegaConf ``ListConfig``).
    """
    accepted = "a count ≥ 1, -1 (all), 'auto', or GPU indices such as [0,1] or '0,1'"
    if isinstance(devices, bool):
        raise DeviceError(f"devices={devices!r} is not valid; use {accepted}")
    if isinstance(devices, int):
        if devices == -1 or devices >= 1:
            return devices
        raise DeviceError(f"devices={devices} is not valid; use {accepted}")
    if isinstance(devices, str):
        text = devices.strip()
        if text.lower() == "auto":
            return "auto"
        listed = text.startswith("[") and text.endswith("]")
        body = text[1:-1] if listed else text
        parts = [p.strip() for p in body.split(",")]
        if not listed and len(parts) == 1:
            if re.fullmatch(r"-?\d+", text):
                return parse_devices(int(text))
            raise DeviceError(f"devices={devices!r} is not valid; use {accepted}")
        if parts and parts[-1] == "" and not listed:
            parts = parts[:-1]  # "0," is a one-element list, as Lightning reads it
        if not all(re.fullmatch(r"\d+", p) for p in parts):
            raise DeviceError(f"devices={devices!r} is not valid; use {accepted}")
        return _check_index_list([int(p) for p in parts], devices)
    if isinstance(devices, Sequence) or _is_listconfig(devices):
        items = list(devices)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
            raise DeviceError(f"devices={items!r} is not valid; use {accepted}")
        return _check_index_list(items, devices)
    raise DeviceError(f"devices={devices!r} is not valid; use {accepted}")


def _is_listconfig(value: Any) -> bool:
    return type(value).__name__ == "ListConfig"


def _check_index_list(indices: list[int], original: Any) -> list[int]:
    if not indices:
        raise DeviceError(f"devices={original!r} lists no GPU; use a count or at least one index")
    if len(set(indices)) != len(indices):
        raise DeviceError(f"devices={original!r} names a GPU twice; each index may appear once")
    return indices


def _describe_visible(inv: Inventory) -> str:
    n = inv.usable_gpu_count
    if n == 0:
        return f"this machine has no usable GPU ({_no_gpu_reason(inv)})"
    names = [g.name for g in inv.visible[:n]]
    if len(names) == n and n <= 4:
        listing = ", ".join(f"cuda:{i} {name}" for i, name in enumerate(names))
        return f"only {n} GPU{'s are' if n != 1 else ' is'} visible ({listing})"
    return f"only {n} GPU{'s are' if n != 1 else ' is'} visible (cuda:0..cuda:{n - 1})"


def resolve_devices(
    accelerator: Any = "auto",
    devices: Any = "auto",
    *,
    select: str = "first",
    inventory: Inventory | None = None,
    environ: MutableMapping[str, str] | None = None,
) -> DevicePlan:
    """Check ``accelerator``/``devices`` against the machine and decide what the Trainer gets.

    * ``accelerator="auto"`` without a usable CUDA GPU → CPU, with a one-line ``message``.
    * ``accelerator="gpu"``/``"cuda"`` without one, more GPUs than exist, or an index that does not
      exist → :class:`DeviceError` (one line: what was asked, what exists).
    * ``accelerator="cpu"``: ``devices=N`` means N processes (Lightning's meaning) and is allowed.
    * ``select="least_used"`` with ``devices=N`` (fewer than all GPUs): the N GPUs with the most
      free memory, then the lowest utilisation, then the lowest index, handed over as a sorted list
      of indices. Rank 0 stores the choice in ``environ[SELECTION_ENV]``; DDP children started by
      Lightning (``LOCAL_RANK`` set) reuse it instead of measuring again, so all ranks agree.

    Other accelerators (``mps``, ``tpu``, an ``Accelerator`` object) pass through untouched.
    ``environ`` defaults to ``os.environ``; ``inventory`` defaults to :func:`collect_inventory`
    without UUID probing, so CUDA stays uninitialised for fork-based launchers.
    """
    if select not in SELECT_CHOICES:
        raise DeviceError(
            f"select_gpus={select!r} is not valid; use one of {', '.join(SELECT_CHOICES)}"
        )
    wanted = parse_devices(devices)
    acc = accelerator.strip().lower() if isinstance(accelerator, str) else accelerator
    if acc == "cpu":
        return _cpu_plan(accelerator, wanted, message=None)
    if acc not in ("auto", "gpu", "cuda"):
        return DevicePlan(accelerator, wanted)
    inv = inventory if inventory is not None else collect_inventory(probe_uuids=False)
    count = inv.usable_gpu_count
    if count == 0:
        if acc == "auto" and inv.torch.mps_available:
            return DevicePlan(accelerator, wanted)
        if acc != "auto":
            raise DeviceError(
                f"accelerator={accelerator} asks for a GPU, but {_describe_visible(inv)}; "
                "use accelerator=cpu or accelerator=auto"
            )
        message = f"No usable GPU: {_no_gpu_reason(inv)}; training runs on the CPU."
        return _cpu_plan("cpu", "auto" if wanted == -1 else wanted, message=message)
    if isinstance(wanted, list):
        missing = [i for i in wanted if i >= count]
        if missing:
            raise DeviceError(
                f"devices={wanted} names GPU {', '.join(map(str, missing))}, "
                f"but {_describe_visible(inv)}"
            )
        return DevicePlan(accelerator, wanted, gpus=_gpus_at(inv, wanted))
    if wanted in ("auto", -1):
        return DevicePlan(accelerator, wanted, gpus=inv.visible[:count])
    if wanted > count:
        raise DeviceError(f"devices={wanted} asks for {wanted} GPUs, but {_describe_visible(inv)}")
    if select == "first" or wanted == count:
        return DevicePlan(accelerator, wanted, gpus=inv.visible[:wanted])
    return _least_used_plan(accelerator, wanted, inv, os.environ if environ is None else environ)


def _cpu_plan(accelerator: Any, wanted: str | int | list[int], message: str | None) -> DevicePlan:
    if isinstance(wanted, list):
        raise DeviceError(
            f"devices={wanted} lists GPU indices, but training runs on the CPU, where devices is "
            "a process count (an integer ≥ 1 or 'auto')"
        )
    if wanted == -1:
        raise DeviceError(
            "devices=-1 means 'every GPU' and has no meaning with accelerator=cpu; "
            "use a process count ≥ 1 or 'auto'"
        )
    return DevicePlan(accelerator, wanted, message=message)


def _gpus_at(inv: Inventory, indices: Sequence[int]) -> tuple[Gpu, ...]:
    return tuple(inv.visible[i] for i in indices if i < len(inv.visible))


def rank_by_load(gpus: Sequence[Gpu]) -> list[int]:
    """Indices of ``gpus`` (``cuda:N`` positions), best first: most free memory, then lowest
    utilisation, then lowest index. Unknown values rank after known ones."""

    def key(i: int) -> tuple[bool, int, bool, int, int]:
        g = gpus[i]
        free, util = g.memory_free_mib, g.utilization_percent
        return (free is None, -(free or 0), util is None, util or 0, i)

    return sorted(range(len(gpus)), key=key)


def select_least_used(gpus: Sequence[Gpu], count: int) -> list[int]:
    """The ``count`` best GPUs by :func:`rank_by_load`, as a sorted list of ``cuda:N`` indices."""
    return sorted(rank_by_load(gpus)[:count])


def _request_key(count: int, inv: Inventory) -> str:
    return f"devices={count} CUDA_VISIBLE_DEVICES={inv.cuda_visible_devices}"


def _least_used_plan(
    accelerator: Any, count: int, inv: Inventory, environ: MutableMapping[str, str]
) -> DevicePlan:
    key = _request_key(count, inv)
    saved = environ.get(SELECTION_ENV)
    local_rank = environ.get("LOCAL_RANK")
    record = _parse_record(saved) if saved else None
    if record is not None and record["pid"] != os.getpid() and local_rank is not None:
        if record["request"] != key:
            raise DeviceError(
                f"{SELECTION_ENV} holds rank 0's GPU choice for '{record['request']}', but this "
                f"process asks '{key}'; unset {SELECTION_ENV} and start again"
            )
        chosen = list(record["gpus"])
        if any(i >= inv.usable_gpu_count for i in chosen):
            raise DeviceError(
                f"rank 0 chose GPUs {chosen} ({SELECTION_ENV}), but {_describe_visible(inv)} "
                "in this process"
            )
        message = f"GPUs chosen by rank 0 (least used): {chosen}"
        return DevicePlan(accelerator, chosen, message, tuple(chosen), _gpus_at(inv, chosen))
    if local_rank is not None and record is None:
        raise DeviceError(
            f"select_gpus=least_used cannot coordinate processes started by an external launcher "
            f"(LOCAL_RANK={local_rank} is set but {SELECTION_ENV} is not); pin GPUs with "
            "CUDA_VISIBLE_DEVICES or use select_gpus=first"
        )
    candidates = inv.visible[: inv.usable_gpu_count]
    if len(candidates) < inv.usable_gpu_count or all(g.memory_free_mib is None for g in candidates):
        chosen = list(range(count))
        message = (
            "select_gpus=least_used: no GPU load readings "
            f"({inv.nvml_reason or 'NVML gave none'}); "
            f"using the first {count}: {chosen}"
        )
    else:
        chosen = select_least_used(candidates, count)
        message = (
            f"select_gpus=least_used picked {', '.join(f'cuda:{i}' for i in chosen)} of "
            f"{len(candidates)} (most free memory, then lowest utilisation)"
        )
    environ[SELECTION_ENV] = json.dumps({"pid": os.getpid(), "request": key, "gpus": chosen})
    return DevicePlan(accelerator, chosen, message, tuple(chosen), _gpus_at(inv, chosen))


def _parse_record(text: str) -> dict[str, Any] | None:
    try:
        record = json.loads(text)
        if (
            isinstance(record, dict)
            and isinstance(record.get("pid"), int)
            and isinstance(record.get("request"), str)
            and isinstance(record.get("gpus"), list)
            and all(isinstance(i, int) for i in record["gpus"])
        ):
            return record
    except ValueError:
        pass
    raise DeviceError(
        f"{SELECTION_ENV}={text!r} is not a GPU choice written by this template; unset it"
    )


# --------------------------------------------------------------------------------------------
# CLI


def _gpu_json(gpu: Gpu, index: int | None) -> dict[str, Any]:
    return {
        "index": index,
        "nvml_index": gpu.nvml_index,
        "name": gpu.name,
        "uuid": gpu.uuid,
        "mig": gpu.is_mig,
        "parent_uuid": gpu.parent_uuid,
        "memory_used_mib": gpu.memory_used_mib,
        "memory_total_mib": gpu.memory_total_mib,
        "memory_free_mib": gpu.memory_free_mib,
        "utilization_percent": gpu.utilization_percent,
        "temperature_c": gpu.temperature_c,
        "power_w": gpu.power_w,
        "power_limit_w": gpu.power_limit_w,
        "processes": [
            {"pid": p.pid, "used_memory_mib": p.used_memory_mib, "name": p.name}
            for p in gpu.processes
        ],
    }


def inventory_to_json(inv: Inventory) -> dict[str, Any]:
    """The ``--json`` document. Keys (schema_version 1; values may be ``null`` when unknown):

    ``schema_version``; ``cuda_available`` (torch can use CUDA); ``device_count`` (``cuda:N``
    devices training can use); ``training_device`` (``"cuda"`` or ``"cpu"``); ``message`` (the
    one-line summary); ``nvml`` {``available``, ``reason``, ``driver_version``};
    ``cuda_visible_devices`` (raw value or ``null`` if unset); ``cuda_device_order``;
    ``index_mapping`` (``torch-uuid`` | ``env-rules`` | ``torch-only`` | ``none``); ``gpus``: one
    object per ``cuda:N`` with ``index`` (N), ``nvml_index``, ``name``, ``uuid``, ``mig``,
    ``parent_uuid``, ``memory_used_mib``, ``memory_total_mib``, ``memory_free_mib``,
    ``utilization_percent``, ``temperature_c``, ``power_w``, ``power_limit_w``, ``processes``
    [{``pid``, ``used_memory_mib``, ``name``}]; ``hidden_gpus``: physical GPUs CUDA does not show
    this process, same keys with ``index`` null; ``notes``: list of one-line remarks.
    """
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "cuda_available": inv.torch.available,
        "device_count": inv.usable_gpu_count,
        "training_device": "cuda" if inv.usable_gpu_count else "cpu",
        "message": inv.summary(),
        "nvml": {
            "available": inv.nvml_available,
            "reason": inv.nvml_reason,
            "driver_version": inv.driver_version,
        },
        "cuda_visible_devices": inv.cuda_visible_devices,
        "cuda_device_order": inv.cuda_device_order,
        "index_mapping": inv.mapping,
        "gpus": [_gpu_json(g, i) for i, g in enumerate(inv.visible)],
        "hidden_gpus": [_gpu_json(g, None) for g in inv.hidden],
        "notes": list(inv.notes),
    }


def _fmt(value: Any, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}{unit}" if isinstance(value, float) else f"{value}{unit}"


def _memory(g: Gpu) -> str:
    if g.memory_total_mib is None:
        return "-"
    return f"{_fmt(g.memory_used_mib)} / {g.memory_total_mib} MiB"


def _procs(g: Gpu) -> str:
    if not g.processes:
        return "-"
    return ", ".join(
        f"{p.pid}{' ' + p.name if p.name else ''} ({_fmt(p.used_memory_mib, ' MiB')})"
        for p in g.processes
    )


_MAPPING_TEXT = {
    "torch-uuid": "cuda:N matched to NVML by UUID (torch)",
    "env-rules": "cuda:N worked out by CUDA's CUDA_VISIBLE_DEVICES/CUDA_DEVICE_ORDER rules",
    "torch-only": "names from torch; NVML unavailable, so no metrics",
    "none": "no GPU",
}


def render(inv: Inventory, console: Any) -> None:
    """Print the human listing on a Rich ``console``."""
    from rich.table import Table

    if not inv.visible:
        console.print(inv.summary(), highlight=False, soft_wrap=True)
        return
    if inv.torch.available:
        built = f"torch CUDA {inv.torch.version}, " if inv.torch.version else ""
        cuda = f"yes ({built}{inv.torch.device_count} device(s))"
    else:
        cuda = "no (training will use the CPU)"
    console.print(f"CUDA available: {cuda}", highlight=False)
    console.print(
        f"NVML driver {inv.driver_version or '?'}; CUDA_VISIBLE_DEVICES="
        f"{'(unset)' if inv.cuda_visible_devices is None else repr(inv.cuda_visible_devices)}; "
        f"CUDA_DEVICE_ORDER={inv.cuda_device_order}; {_MAPPING_TEXT[inv.mapping]}",
        highlight=False,
        soft_wrap=True,
    )
    table = Table(title=inv.summary(), title_justify="left")
    for column in ("cuda", "nvml", "name", "uuid", "memory", "util", "temp", "power", "processes"):
        table.add_column(column, overflow="fold")
    for i, g in enumerate(inv.visible):
        nvml_idx = "-" if g.nvml_index is None else str(g.nvml_index)
        if g.is_mig:
            nvml_idx += f" MIG {g.mig_index}"
        power = _fmt(g.power_w, " W")
        if g.power_limit_w is not None:
            power += f" / {_fmt(g.power_limit_w, ' W')}"
        table.add_row(
            f"cuda:{i}",
            nvml_idx,
            g.name,
            g.uuid,
            _memory(g),
            _fmt(g.utilization_percent, "%"),
            _fmt(g.temperature_c, " °C"),
            power,
            _procs(g),
        )
    console.print(table)
    for g in inv.hidden:
        console.print(
            f"not visible to CUDA here: NVML GPU {g.nvml_index} {g.name} {g.uuid}", highlight=False
        )
    for note in inv.notes:
        console.print(f"note: {note}", highlight=False)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m project.devices [--json]``: list the GPUs this process may use."""
    parser = argparse.ArgumentParser(
        prog="python -m project.devices",
        description="List the GPUs this process may use (as cuda:N), their load and processes.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    args = parser.parse_args(argv)
    inv = collect_inventory()
    if args.json:
        print(json.dumps(inventory_to_json(inv), indent=2))
        return 0
    from rich.console import Console

    render(inv, Console())
    return 0


if __name__ == "__main__":
    sys.exit(main())
