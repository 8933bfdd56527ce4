"""Which physical GPU is ``cuda:N``: CUDA's ``CUDA_VISIBLE_DEVICES``/``CUDA_DEVICE_ORDER`` rules.

Pure functions over :class:`~runkit.gpus.records.Gpu` records, for when torch gives no UUIDs to
match; the rules and their sources are in lib/runkit/docs/cuda-visible-devices.md.

Why not nvitop: without a driver it misses unique UUID prefixes, ``+1``, PCI bus order and the
R570 MIG rule; with one it spawns a child process per value (the library's design notes).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from runkit.gpus.records import ORDINAL, Gpu, list_kind

DEVICE_ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")
"""Accepted values of ``CUDA_DEVICE_ORDER``; CUDA uses the first for anything else."""

MAX_MIG_DEVICES = 64
"""At most this many MIG devices in one CUDA process, across all GPUs (R570+)."""

_AMBIGUOUS = "ambiguous"


def _units(gpu: Gpu) -> list[Gpu]:
    """What CUDA may show for a GPU: itself, or its MIG devices when MIG mode is on."""
    return list(gpu.mig_devices) if gpu.mig_enabled else [gpu]


def apply_mig_limits(
    units: Sequence[Gpu], driver_version: str | None
) -> tuple[list[Gpu], list[str]]:
    """The devices CUDA enumerates out of ``units`` by the driver's MIG rule: before R570 one MIG
    device and no other GPU; from R570 (or unknown) one per GPU instance, at most 64."""
    mig = [u for u in units if u.is_mig]
    if not mig:
        return list(units), []
    major = re.match(r"\s*(\d+)", driver_version or "")
    if major and int(major.group(1)) < 570:
        note = (
            f"driver {driver_version} (before R570): CUDA enumerates one MIG device and no "
            f"other GPU; shown: {mig[0].uuid} (the first in CUDA order; which one CUDA takes "
            "is not documented)."
        )
        return [mig[0]], [note] if len(units) > 1 else []
    seen: set[tuple[str | None, object]] = set()
    result: list[Gpu] = []
    dropped: list[Gpu] = []
    for unit in units:
        key = (
            unit.parent_uuid,
            unit.uuid if unit.gpu_instance_id is None else unit.gpu_instance_id,
        )
        if unit.is_mig and (key in seen or len(seen) >= MAX_MIG_DEVICES):
            dropped.append(unit)
            continue
        seen.update([key] if unit.is_mig else [])
        result.append(unit)
    if not dropped:
        return result, []
    return result, [
        "CUDA enumerates one compute instance per GPU instance and at most "
        f"{MAX_MIG_DEVICES} MIG devices; not shown: {', '.join(u.uuid for u in dropped)} "
        "(which compute instance CUDA takes is not documented; the first in CUDA order is "
        "assumed)."
    ]


def cuda_enumeration(physical: Sequence[Gpu], order: str | None) -> tuple[list[Gpu], list[str]]:
    """Physical GPUs in CUDA's order before ``CUDA_VISIBLE_DEVICES``: PCI bus order (NVML's where
    a bus id is missing); ``FASTEST_FIRST`` equals it unless the models differ, then a note."""
    if any(g.pci_bus_id is None for g in physical):
        ordered = sorted(physical, key=lambda g: g.nvml_index or 0)
    else:
        ordered = sorted(physical, key=lambda g: (g.pci_bus_id, g.nvml_index or 0))
    if (order or "").strip().upper() == "PCI_BUS_ID" or len({g.name for g in physical}) < 2:
        return ordered, []
    return ordered, [
        "CUDA_DEVICE_ORDER is FASTEST_FIRST (CUDA's default) and the GPUs are different "
        "models, so CUDA may number them differently from PCI bus order; the indices shown "
        "assume PCI order. Set CUDA_DEVICE_ORDER=PCI_BUS_ID to make them exact."
    ]


def _match_uuid(prefix: str, candidates: Sequence[Gpu]) -> Gpu | str | None:
    """The single candidate whose UUID starts with ``prefix``; ``"ambiguous"`` or ``None`` else."""
    hits = [g for g in candidates if g.uuid and g.uuid.startswith(prefix)]
    return _AMBIGUOUS if len(hits) > 1 else (hits[0] if hits else None)


def _find(
    raw: str, kind: str, physical: Sequence[Gpu], enumeration: Sequence[Gpu]
) -> Gpu | str | None:
    """The device one entry names in a list of ``kind``; ``"ambiguous"``, ``None`` (invalid),
    or ``"kind"`` (an entry of another kind, which ends the list)."""
    if kind == "GPU- UUIDs":  # torch compares the raw entry: a blank before "GPU-" ends the list
        return _match_uuid(raw, physical) if raw.startswith("GPU-") else "kind"
    if kind == "MIG- UUIDs":
        old = re.fullmatch(r"MIG-(GPU-[^/]+)/(\d+)/(\d+)", raw.strip())  # before driver R470
        if old:
            ids = (old.group(1), int(old.group(2)), int(old.group(3)))
            return next(
                (c for g in physical for c in g.mig_devices
                 if (g.uuid, c.gpu_instance_id, c.compute_instance_id) == ids),
                None,
            )  # fmt: skip
        if raw.startswith("MIG-"):
            return _match_uuid(raw, [c for gpu in physical for c in gpu.mig_devices])
        return "kind"
    if raw.strip().startswith(("GPU-", "MIG-")):
        return "kind"
    match = ORDINAL.match(raw)
    ordinal = int(match.group(1)) if match else -1
    return enumeration[ordinal] if 0 <= ordinal < len(enumeration) else None


def apply_visible_devices(
    physical: Sequence[Gpu],
    cuda_visible_devices: str | None,
    order: str | None = None,
    driver_version: str | None = None,
) -> tuple[list[Gpu], list[str]]:
    """The GPUs CUDA shows out of NVML's ``physical`` list, ``result[i]`` being ``cuda:i``, and
    notes explaining any surprise; ``driver_version`` decides the MIG rule."""
    enumeration, notes = cuda_enumeration(physical, order)
    chosen: list[Gpu] = []
    picked: list[Gpu] = []
    if cuda_visible_devices is None:
        chosen = [unit for gpu in enumeration for unit in _units(gpu)]
    elif cuda_visible_devices.strip() == "":
        return [], [*notes, "CUDA_VISIBLE_DEVICES is empty, which hides every GPU."]
    else:
        kind = list_kind(cuda_visible_devices)
        entries = cuda_visible_devices.split(",")
        for position, raw in enumerate(entries):
            found = _find(raw, kind, physical, enumeration)
            if found is None or isinstance(found, str):
                why = {
                    _AMBIGUOUS: "matches more than one GPU",
                    "kind": f"is not of the list's kind ({kind}, set by its first entry)",
                }.get(str(found), "names no GPU here")
                notes.append(
                    f"CUDA_VISIBLE_DEVICES entry {raw!r} {why}; CUDA stops at the first invalid "
                    f"entry, so {','.join(entries[position:])!r} is ignored."
                )
                break
            if found in picked:
                notes.append(
                    f"CUDA_VISIBLE_DEVICES names {raw.strip()!r} twice; CUDA then shows no GPU "
                    "at all."
                )
                return [], notes
            picked.append(found)
            chosen.extend(_units(found))  # a MIG device is its own unit
    shown, mig_notes = apply_mig_limits(chosen, driver_version)
    return shown, notes + mig_notes
