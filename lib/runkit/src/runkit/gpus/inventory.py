"""The GPUs of this machine and which ``cuda:N`` each one is, from this process's point of view.

NVML is read at the detail the caller needs (``identity`` to number ``cuda:N``, ``load`` for
``least_used``, ``full`` for the listing), once per job for device resolution
(:func:`cached_inventory`). torch is imported inside functions so the listing starts quickly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from runkit.gpus import nvml
from runkit.gpus.reader import DeviceReader
from runkit.gpus.records import Gpu, GpuProcess, Inventory, TorchCuda
from runkit.gpus.visible import DEVICE_ORDERS, apply_visible_devices

IDENTITY, LOAD, FULL = "identity", "load", "full"
DETAILS = (IDENTITY, LOAD, FULL)

_MIB = 1024 * 1024


def probe_torch(*, uuids: bool = True) -> TorchCuda:
    """Ask torch about CUDA; ``uuids=False`` only counts, from NVML as Lightning does, so that a
    process that later forks DDP workers keeps CUDA uninitialised."""
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


def _mib(value: Any) -> int | None:
    return None if value is None else int(value) // _MIB


def _processes(reader: DeviceReader) -> tuple[GpuProcess, ...]:
    lib = reader.lib
    seen: dict[int, GpuProcess] = {}
    for kind in ("Compute", "Graphics"):
        for pid, used in nvml.optional(lib, reader.compute_processes, kind) or ():
            if pid not in seen:
                name = nvml.optional(lib, "nvmlSystemGetProcessName", pid)
                seen[pid] = GpuProcess(pid, _mib(used), nvml.as_text(name) if name else None)
    return tuple(seen.values())


def _read_gpu(reader: DeviceReader, detail: str, **where: Any) -> Gpu:
    """One device at ``detail``; what NVML will not say stays ``None``."""

    def get(query: Any) -> Any:
        return nvml.optional(reader.lib, query)

    uuid, name = get(reader.uuid), get(reader.name)
    figures: dict[str, Any] = {}
    if detail in (LOAD, FULL):
        total, used, free = get(reader.memory) or (None, None, None)
        util = get(reader.utilization)
        figures.update(
            memory_total_mib=_mib(total),
            memory_used_mib=_mib(used),
            memory_free_mib=_mib(free),
            utilization_percent=None if util is None else util[0],
        )
    if detail == FULL:
        if not reader.is_mig:  # a slice has no temperature or power of its own: its GPU has
            power, limit = get(reader.power_mw), get(reader.power_limit_mw)
            figures.update(
                temperature_c=get(reader.temperature_c),
                power_w=None if power is None else power / 1000.0,
                power_limit_w=None if limit is None else limit / 1000.0,
            )
        figures["processes"] = _processes(reader)
    return Gpu(
        uuid=uuid or "",
        name=name or "unknown GPU",
        pci_bus_id=get(reader.pci_bus_id),
        **figures,
        **where,
    )


def _read_physical(lib: Any, detail: str) -> tuple[list[Gpu], list[str]]:
    gpus: list[Gpu] = []
    notes: list[str] = []
    for index in range(lib.nvmlDeviceGetCount()):
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(index)
        except lib.NVMLError as err:
            notes.append(f"NVML cannot open GPU {index} ({err}); it is listed without details.")
            gpus.append(Gpu(uuid="", name="unreadable GPU", nvml_index=index, error=str(err)))
            continue
        reader = DeviceReader(lib, handle)
        mig_on = bool(nvml.optional(lib, reader.mig_enabled))
        gpu = _read_gpu(reader, detail, nvml_index=index, mig_enabled=mig_on)
        if mig_on:
            slices = tuple(
                _read_gpu(
                    child,
                    detail,
                    nvml_index=index,
                    parent_uuid=gpu.uuid,
                    mig_index=slot,
                    gpu_instance_id=nvml.optional(lib, child.gpu_instance_id),
                    compute_instance_id=nvml.optional(lib, child.compute_instance_id),
                )
                for slot, child in reader.mig_slices()
            )
            gpu = replace(gpu, mig_devices=slices)
        gpus.append(gpu)
    return gpus, notes


def read_nvml(detail: str = FULL) -> tuple[list[Gpu], str | None, list[str]]:
    """Every physical GPU (with its MIG devices) in NVML order, the driver version, and notes on
    GPUs NVML cannot open; :class:`~runkit.gpus.nvml.NvmlUnavailable` when NVML cannot start."""
    if detail not in DETAILS:
        raise ValueError(f"detail={detail!r}; use one of {', '.join(DETAILS)}")
    with nvml.nvml_session() as lib:
        driver = nvml.optional(lib, "nvmlSystemGetDriverVersion")
        gpus, notes = _read_physical(lib, detail)
    return gpus, (nvml.as_text(driver) if driver else None), notes


def _torch_devices(
    torch_info: TorchCuda, physical: Sequence[Gpu] | None
) -> tuple[list[Gpu], list[str]]:
    """``cuda:i`` as torch names it, matched by UUID to NVML's ``physical`` devices if given."""
    by_uuid = {nvml.bare_uuid(g.uuid): g for p in physical or () for g in (p, *p.mig_devices)}
    names, uuids = torch_info.names or (), torch_info.uuids or ()
    visible, notes = [], []
    for i in range(torch_info.device_count):
        uuid = uuids[i] if i < len(uuids) else ""
        gpu = by_uuid.get(nvml.bare_uuid(uuid))
        if gpu is None:
            if physical is not None:
                notes.append(f"cuda:{i} ({uuid}) is not in NVML's list; shown without metrics.")
            name = "unknown GPU" if physical is not None else f"cuda:{i}"
            gpu = Gpu(uuid=uuid, name=names[i] if i < len(names) else name)
        visible.append(gpu)
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
    all_notes = list(notes)
    if order not in DEVICE_ORDERS:
        all_notes.append(
            f"CUDA_DEVICE_ORDER={order!r} is not one of {', '.join(DEVICE_ORDERS)}; "
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
        visible = _torch_devices(torch_info, None)[0] if torch_info.available else []
        mapping = "torch-only" if visible else "none"
        return Inventory(**base, mapping=mapping, visible=tuple(visible), notes=tuple(all_notes))
    if torch_info.available and torch_info.uuids and all(torch_info.uuids):
        visible, extra = _torch_devices(torch_info, physical)
        mapping = "torch-uuid"
    else:
        visible, extra = apply_visible_devices(physical, cvd, order, driver_version)
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


def _reading(detail: str) -> Any:
    """:func:`read_nvml`'s answer, or why NVML is unavailable."""
    try:
        return read_nvml(detail)
    except nvml.NvmlUnavailable as err:
        return str(err)


def _inventory(reading: Any, torch_info: TorchCuda, env: Mapping[str, str] | None) -> Inventory:
    if isinstance(reading, str):
        return build_inventory(None, torch_info, env=env, nvml_reason=reading)
    physical, driver, notes = reading
    return build_inventory(physical, torch_info, env=env, driver_version=driver, notes=notes)


def collect_inventory(
    *,
    torch_info: TorchCuda | None = None,
    env: Mapping[str, str] | None = None,
    probe_uuids: bool = True,
    detail: str = FULL,
) -> Inventory:
    """NVML (at ``detail``) and torch (``torch_info``, else probed) read afresh."""
    return _inventory(_reading(detail), torch_info or probe_torch(uuids=probe_uuids), env)


# The last NVML reading: (library, detail, what _reading gave).
_last: tuple[Any, str, Any] | None = None


def cached_inventory(detail: str = IDENTITY) -> Inventory:
    """The inventory device resolution uses: NVML read once per job (until :func:`forget_readings`)
    or again when more ``detail`` or another library is asked for; torch's count and
    ``CUDA_VISIBLE_DEVICES`` are looked at afresh, as NVML's GPU list does not depend on them."""
    global _last
    try:
        lib = nvml.load_library()
    except nvml.NvmlUnavailable:
        lib = None
    held = _last
    if (
        held is None
        or held[0] is not lib
        or not (isinstance(held[2], str) or DETAILS.index(held[1]) >= DETAILS.index(detail))
    ):
        _last = held = (lib, detail, _reading(detail))
    return _inventory(held[2], probe_torch(uuids=False), None)


def forget_readings() -> None:
    """Drop the reading :func:`cached_inventory` keeps: the next call reads NVML again."""
    global _last
    _last = None
