"""What GPUs this machine has and which ``cuda:N`` each one is, from this process's point of view.

:func:`collect_inventory` reads NVML at the detail the caller needs (``"identity"`` to number
``cuda:N``, ``"load"`` for ``select_gpus=least_used``, ``"full"`` for the listing), asks torch
about CUDA, and numbers the visible GPUs (:mod:`runkit.gpus.visible`). :func:`cached_inventory`
reads NVML once per job however often devices are resolved. torch is imported inside functions,
so ``python -m runkit.devices`` answers quickly.
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
"""How much :func:`read_nvml` reads, least first (see the module docstring)."""

_MIB = 1024 * 1024


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


def _mib(value: Any) -> int | None:
    return None if value is None else int(value) // _MIB


def _processes(reader: DeviceReader) -> tuple[GpuProcess, ...]:
    lib = reader.lib
    seen: dict[int, GpuProcess] = {}
    for query in (reader.compute_processes, reader.graphics_processes):
        for pid, used in nvml.optional(lib, query) or ():
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
    """Every physical GPU (with its MIG devices) in NVML index order, the driver version, and notes
    about GPUs NVML could not open; ``detail`` is one of :data:`DETAILS`. Raises
    :class:`runkit.gpus.nvml.NvmlUnavailable` when NVML cannot start.

    Why not nvitop: the same queries, but through the one door the fake NVML replaces, also in a
    subprocess (the library's design notes)."""
    if detail not in DETAILS:
        raise ValueError(f"detail={detail!r}; use one of {', '.join(DETAILS)}")
    with nvml.nvml_session() as lib:
        driver = nvml.optional(lib, "nvmlSystemGetDriverVersion")
        gpus, notes = _read_physical(lib, detail)
    return gpus, (nvml.as_text(driver) if driver else None), notes


# --------------------------------------------------------------------------------------------
# Putting NVML and torch together


def _map_by_torch_uuid(
    physical: Sequence[Gpu], torch_info: TorchCuda
) -> tuple[list[Gpu], list[str]]:
    by_uuid: dict[str, Gpu] = {}
    for gpu in physical:
        by_uuid[nvml.bare_uuid(gpu.uuid)] = gpu
        for child in gpu.mig_devices:
            by_uuid[nvml.bare_uuid(child.uuid)] = child
    visible: list[Gpu] = []
    notes: list[str] = []
    names = torch_info.names or ()
    for i, uuid in enumerate(torch_info.uuids or ()):
        gpu = by_uuid.get(nvml.bare_uuid(uuid))
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
        visible = _torch_only(torch_info) if torch_info.available else []
        mapping = "torch-only" if visible else "none"
        return Inventory(**base, mapping=mapping, visible=tuple(visible), notes=tuple(all_notes))
    if torch_info.available and torch_info.uuids and all(torch_info.uuids):
        visible, extra = _map_by_torch_uuid(physical, torch_info)
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


def collect_inventory(
    *,
    torch_info: TorchCuda | None = None,
    env: Mapping[str, str] | None = None,
    probe_uuids: bool = True,
    detail: str = FULL,
) -> Inventory:
    """Read NVML (at ``detail``) and torch, and build the :class:`Inventory`.

    ``torch_info`` replaces the torch probe (tests, or a caller that already asked torch);
    ``probe_uuids=False`` keeps CUDA uninitialised (see :func:`probe_torch`).
    """
    if torch_info is None:
        torch_info = probe_torch(uuids=probe_uuids)
    try:
        physical, driver, notes = read_nvml(detail)
    except nvml.NvmlUnavailable as err:
        return build_inventory(None, torch_info, env=env, nvml_reason=str(err))
    return build_inventory(physical, torch_info, env=env, driver_version=driver, notes=notes)


# The last NVML reading: (library, detail, (gpus, driver, notes) or why NVML is unavailable).
_last: tuple[Any, str, Any] | None = None


def cached_inventory(detail: str = IDENTITY) -> Inventory:
    """The inventory device resolution uses, NVML read once per job.

    The NVML reading is kept until :func:`forget_readings` (called at the end of every job, so
    each job of a sweep measures anew) and reused by every later call that needs no more
    ``detail`` than it holds; a call that needs more reads again (and keeps that). NVML's list of
    physical GPUs does not depend on ``CUDA_VISIBLE_DEVICES``, so only torch's count (cheap, and
    cached by torch) and the environment are looked at afresh each call: the result always
    reflects the current ``CUDA_VISIBLE_DEVICES``. A different NVML library (a fake installed by a
    test or demo) is read afresh. CUDA stays uninitialised (see :func:`probe_torch`). The load a
    run waits on and claims by is measured afresh (:mod:`runkit.gpus.claims`).
    """
    global _last
    torch_info = probe_torch(uuids=False)
    try:
        lib = nvml.load_library()
    except nvml.NvmlUnavailable as err:
        return build_inventory(None, torch_info, nvml_reason=str(err))
    if not _answers(_last, lib, detail):
        try:
            reading: Any = read_nvml(detail)
        except nvml.NvmlUnavailable as err:
            reading = str(err)
        _last = (lib, detail, reading)
    reading = _last[2]
    if isinstance(reading, str):
        return build_inventory(None, torch_info, nvml_reason=reading)
    physical, driver, notes = reading
    return build_inventory(physical, torch_info, driver_version=driver, notes=notes)


def forget_readings() -> None:
    """Drop the reading :func:`cached_inventory` keeps: the next call reads NVML again."""
    global _last
    _last = None


def _answers(held: tuple[Any, str, Any] | None, lib: Any, detail: str) -> bool:
    """Whether ``held`` is a reading of ``lib`` with at least ``detail`` (a failure to start
    answers every detail)."""
    if held is None or held[0] is not lib:
        return False
    return isinstance(held[2], str) or DETAILS.index(held[1]) >= DETAILS.index(detail)
