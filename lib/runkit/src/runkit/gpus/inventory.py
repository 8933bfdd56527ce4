"""The GPUs of this machine and which ``cuda:N`` each one is, from this process's point of view.

NVML is read at the detail the caller needs (``identity`` for device resolution, once per job:
:func:`cached_inventory`; ``full`` for the listing)."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from runkit.gpus import nvml
from runkit.gpus.reader import DeviceReader
from runkit.gpus.records import (
    DEVICE_ORDERS,
    Gpu,
    GpuProcess,
    Inventory,
    TorchCuda,
    apply_visible_devices,
)

IDENTITY, FULL = "identity", "full"
DETAILS = (IDENTITY, FULL)


def probe_torch(*, uuids: bool = True) -> TorchCuda:
    """Ask torch about CUDA; ``uuids=False`` only counts (from NVML, as Lightning does), so that a
    process that later forks DDP workers keeps CUDA uninitialised."""
    try:
        import torch
    except ImportError:
        return TorchCuda()
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
    """One device at ``detail``; what NVML will not say stays ``None``."""
    get = functools.partial(nvml.optional, reader.lib)
    figures: dict[str, Any] = {}
    if detail == FULL:
        total, used, free = get(reader.memory) or (None, None, None)
        util = get(reader.utilization)
        figures.update(memory_total_mib=_mib(total), memory_used_mib=_mib(used))
        figures.update(memory_free_mib=_mib(free), utilization_percent=util and util[0])
        if not reader.is_mig:  # a slice has no temperature or power of its own: its GPU has
            power, limit = get(reader.power_mw), get(reader.power_limit_mw)
            figures.update(power_w=power and power / 1000, power_limit_w=limit and limit / 1000)
            figures["temperature_c"] = get(reader.temperature_c)
        seen: dict[int, GpuProcess] = {}
        for kind in ("Compute", "Graphics"):
            for pid, used in get(reader.compute_processes, kind) or ():
                name = nvml.as_text(get("nvmlSystemGetProcessName", pid) or "") or None
                seen.setdefault(pid, GpuProcess(pid, _mib(used), name))
        figures["processes"] = tuple(seen.values())
    name = get(reader.name) or "unknown GPU"
    return Gpu(get(reader.uuid) or "", name, pci_bus_id=get(reader.pci_bus_id), **figures, **where)


def read_nvml(detail: str = FULL) -> tuple[list[Gpu], str | None, list[str]]:
    """Every physical GPU (with its MIG devices) in NVML order, the driver version, and notes on
    GPUs NVML cannot open; :class:`~runkit.gpus.nvml.NvmlUnavailable` when NVML cannot start."""
    if detail not in DETAILS:
        raise ValueError(f"detail={detail!r}; use one of {', '.join(DETAILS)}")
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


def _torch_devices(
    torch_info: TorchCuda, physical: Sequence[Gpu] | None
) -> tuple[list[Gpu], list[str]]:
    """``cuda:i`` as torch names it, matched by UUID to NVML's ``physical`` devices if given."""
    by_uuid = {nvml.bare_uuid(g.uuid): g for p in physical or () for g in (p, *p.mig_devices)}
    names, uuids = torch_info.names or (), torch_info.uuids or ()
    visible, notes = [], []
    for i in range(torch_info.device_count):
        uuid = uuids[i] if i < len(uuids) else ""
        if (gpu := by_uuid.get(nvml.bare_uuid(uuid))) is None and physical is not None:
            notes.append(f"cuda:{i} ({uuid}) is not in NVML's list; shown without metrics.")
        name = "unknown GPU" if physical is not None else f"cuda:{i}"
        visible.append(gpu or Gpu(uuid, names[i] if i < len(names) else name))
    return visible, notes


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
    if physical is None:
        visible = _torch_devices(torch_info, None)[0] if torch_info.available else []
        mapping = "torch-only" if visible else "none"
    elif torch_info.available and torch_info.uuids and all(torch_info.uuids):
        visible, extra = _torch_devices(torch_info, physical)
        mapping, notes = "torch-uuid", notes + extra
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


def _inventory(reading: Any, torch_info: TorchCuda, env: Mapping[str, str] | None) -> Inventory:
    """An inventory from :func:`read_nvml`'s answer or why NVML is unavailable (a string)."""
    if isinstance(reading, str):
        return build_inventory(None, torch_info, env=env, nvml_reason=reading)
    physical, driver, notes = reading
    return build_inventory(physical, torch_info, env=env, driver_version=driver, notes=notes)


def _reading(detail: str) -> Any:
    try:
        return read_nvml(detail)
    except nvml.NvmlUnavailable as err:
        return str(err)


def collect_inventory(
    *,
    torch_info: TorchCuda | None = None,
    env: Mapping[str, str] | None = None,
    probe_uuids: bool = True,
    detail: str = FULL,
) -> Inventory:
    """NVML (at ``detail``) and torch (``torch_info``, else probed) read afresh."""
    return _inventory(_reading(detail), torch_info or probe_torch(uuids=probe_uuids), env)


_last: tuple[Any, Any] | None = None  # the last reading: (library, reading)


def cached_inventory() -> Inventory:
    """The inventory device resolution uses: NVML read once per job (until
    :func:`forget_readings`, or for another library); torch's count and ``CUDA_VISIBLE_DEVICES``
    are looked at afresh (NVML's GPU list does not depend on them)."""
    global _last
    try:
        lib = nvml.load_library()
    except nvml.NvmlUnavailable:
        lib = None
    if _last is None or _last[0] is not lib:
        _last = (lib, _reading(IDENTITY))
    return _inventory(_last[1], probe_torch(uuids=False), None)


def forget_readings() -> None:
    """Drop the reading :func:`cached_inventory` keeps: the next call reads NVML again."""
    global _last
    _last = None
