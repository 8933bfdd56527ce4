"""Which physical GPU is ``cuda:N``: the ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` rules.

NVML numbers GPUs in PCI bus order; CUDA in ``CUDA_DEVICE_ORDER``, then filtered and reordered by
``CUDA_VISIBLE_DEVICES``. When torch sees CUDA the inventory matches devices by UUID; otherwise
these pure functions apply the rules of the CUDA programming guide (section 5.2.1.1) and, where it
is silent, those torch's NVML-based device count encodes (Lightning uses that count): ordinals
parsed like ``strtoul``, UUID prefixes, the first entry's kind sets the list's, the list ends at
the first invalid entry, a duplicate hides every device, an empty string hides all, and a GPU in
MIG mode shows its MIG devices (:func:`apply_mig_limits`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from runkit.gpus.records import Gpu

DEVICE_ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")
"""Accepted values of ``CUDA_DEVICE_ORDER``; CUDA uses the first for anything else."""

MIG_PER_GPU_INSTANCE_DRIVER = 570
"""The driver branch from which CUDA enumerates one MIG device per GPU instance [MIG]."""

MAX_MIG_DEVICES = 64
"""At most this many MIG devices in one CUDA process, across all GPUs (R570+) [MIG]."""

_ORDINAL = re.compile(r"([+-]?\d+)")
_AMBIGUOUS = "ambiguous"


def driver_major(driver_version: str | None) -> int | None:
    """The driver branch of an NVML driver version (``"570.86.10"`` → 570), ``None`` if unknown."""
    match = re.match(r"\s*(\d+)", driver_version or "")
    return int(match.group(1)) if match else None


def _cuda_units(gpu: Gpu) -> list[Gpu]:
    """What CUDA may show for a physical GPU: itself, or its MIG devices when MIG mode is on
    (before :func:`apply_mig_limits` keeps those the driver enumerates).

    Why not nvitop: it always applies the pre-R570 rule, one MIG device in all
    (the library's design notes).
    """
    return list(gpu.mig_devices) if gpu.mig_enabled else [gpu]


def apply_mig_limits(
    units: Sequence[Gpu], driver_version: str | None
) -> tuple[list[Gpu], list[str]]:
    """The devices CUDA enumerates out of ``units`` (in CUDA order), by the driver's MIG rule
    (MIG user guide, "CUDA Device Enumeration"): before R570 one MIG device in all and no other
    GPU; from R570 (and for an unknown driver) one compute instance per GPU instance, at most 64,
    beside non-MIG GPUs. Which instance CUDA takes is not documented: the first in CUDA order, and
    a note says so. nvitop applies the pre-R570 rule whatever the driver.
    """
    notes: list[str] = []
    mig = [u for u in units if u.is_mig]
    if not mig:
        return list(units), notes
    major = driver_major(driver_version)
    if major is not None and major < MIG_PER_GPU_INSTANCE_DRIVER:
        kept = mig[0]
        if len(units) > 1:
            notes.append(
                f"driver {driver_version} (before R570): CUDA enumerates one MIG device and no "
                f"other GPU; shown: {kept.uuid} (the first in CUDA order; which one CUDA takes "
                "is not documented)."
            )
        return [kept], notes
    seen: set[tuple[str | None, object]] = set()
    result: list[Gpu] = []
    dropped: list[Gpu] = []
    count = 0
    for unit in units:
        if not unit.is_mig:
            result.append(unit)
            continue
        instance = unit.gpu_instance_id if unit.gpu_instance_id is not None else unit.uuid
        key = (unit.parent_uuid, instance)
        if key in seen or count >= MAX_MIG_DEVICES:
            dropped.append(unit)
            continue
        seen.add(key)
        result.append(unit)
        count += 1
    if dropped:
        notes.append(
            "CUDA enumerates one compute instance per GPU instance and at most "
            f"{MAX_MIG_DEVICES} MIG devices; not shown: {', '.join(u.uuid for u in dropped)} "
            "(which compute instance CUDA takes is not documented; the first in CUDA order is "
            "assumed)."
        )
    return result, notes


def cuda_enumeration(physical: Sequence[Gpu], order: str | None) -> tuple[list[Gpu], list[str]]:
    """Physical GPUs in the order CUDA numbers them before ``CUDA_VISIBLE_DEVICES`` applies.

    ``PCI_BUS_ID`` is NVML's order (sorted by bus id where NVML reports one). CUDA's default
    ``FASTEST_FIRST`` ranks by an unpublished speed estimate and breaks ties by PCI bus id, so it
    equals PCI order when all GPUs are the same model; with mixed models the result is a guess and a
    note says so.

    Why not nvitop: without a driver it ignores ``CUDA_DEVICE_ORDER`` and uses NVML index order,
    not PCI bus order (the library's design notes).
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
        return _AMBIGUOUS
    return hits[0] if hits else None


def _match_old_mig(entry: str, physical: Sequence[Gpu]) -> Gpu | None:
    """``MIG-GPU-<uuid>/<gpu instance>/<compute instance>``, the form used before driver R470.

    Why not nvitop: it cannot resolve this form from NVML alone (the library's design notes)."""
    match = re.fullmatch(r"MIG-(GPU-[^/]+)/(\d+)/(\d+)", entry.strip())
    if not match:
        return None
    parent_uuid, gi, ci = match.group(1), int(match.group(2)), int(match.group(3))
    for gpu in physical:
        if gpu.uuid == parent_uuid:
            for child in gpu.mig_devices:
                if (child.gpu_instance_id, child.compute_instance_id) == (gi, ci):
                    return child
    return None


def _list_kind(value: str) -> str:
    """What the whole list holds, decided by how the value starts, as torch decides it."""
    if value.startswith("GPU-"):
        return "GPU- UUIDs"
    if value.startswith("MIG-"):
        return "MIG- UUIDs"
    return "indices"


def _find(
    raw: str, kind: str, physical: Sequence[Gpu], enumeration: Sequence[Gpu]
) -> Gpu | str | None:
    """The device one entry names in a list of ``kind``; ``"ambiguous"``, ``None`` (invalid),
    or ``"kind"`` (an entry of another kind, which ends the list)."""
    if kind == "GPU- UUIDs":  # torch compares the raw entry: a blank before "GPU-" ends the list
        return _match_uuid(raw, physical) if raw.startswith("GPU-") else "kind"
    if kind == "MIG- UUIDs":
        if raw.startswith("MIG-GPU-"):
            return _match_old_mig(raw, physical)
        if raw.startswith("MIG-"):
            return _match_uuid(raw, [c for gpu in physical for c in gpu.mig_devices])
        return "kind"
    text = raw.strip()
    if text.startswith(("GPU-", "MIG-")):
        return "kind"
    match = _ORDINAL.match(text)  # strtoul: an optional sign, then the leading digits
    ordinal = int(match.group(1)) if match else -1
    return enumeration[ordinal] if 0 <= ordinal < len(enumeration) else None


def first_entry_problem(cuda_visible_devices: str | None) -> str | None:
    """Why a ``CUDA_VISIBLE_DEVICES`` value hides every GPU on any machine, or None.

    CUDA reads the list up to its first invalid entry, so a list of indices whose first entry is
    not an index >= 0 (``banana,,7``, ``-1``, ``,0``) shows no GPU whatever the machine has: this
    can be said without NVML, where the GPU count is unknown. UUID lists depend on the GPUs
    (:func:`apply_visible_devices` decides them); an empty value is left to its own message."""
    if cuda_visible_devices is None or cuda_visible_devices.strip() == "":
        return None
    if _list_kind(cuda_visible_devices) != "indices":
        return None
    first = cuda_visible_devices.split(",")[0]
    match = _ORDINAL.match(first.strip())
    if first.strip().startswith(("GPU-", "MIG-")) or (match and int(match.group(1)) >= 0):
        return None
    return (
        f"its first entry {first!r} is not a GPU index or UUID, and CUDA ignores the list from "
        "its first invalid entry on"
    )


def apply_visible_devices(
    physical: Sequence[Gpu],
    cuda_visible_devices: str | None,
    order: str | None = None,
    driver_version: str | None = None,
) -> tuple[list[Gpu], list[str]]:
    """The GPUs CUDA shows, ``result[i]`` being ``cuda:i``, and notes explaining any surprise.

    Implements CUDA's rules (see the module docstring). ``physical`` is NVML's list of physical
    GPUs, each with its MIG devices; ``driver_version`` (NVML's) decides the MIG rule
    (:func:`apply_mig_limits`).

    Why not nvitop: without a driver its rules miss unique UUID prefixes and ``+1``, and with one
    it spawns a child process per new value (the library's design notes).
    """
    enumeration, notes = cuda_enumeration(physical, order)
    if cuda_visible_devices is None:
        units = [unit for gpu in enumeration for unit in _cuda_units(gpu)]
        shown, mig_notes = apply_mig_limits(units, driver_version)
        return shown, notes + mig_notes
    if cuda_visible_devices.strip() == "":
        notes.append("CUDA_VISIBLE_DEVICES is empty, which hides every GPU.")
        return [], notes
    kind = _list_kind(cuda_visible_devices)
    chosen: list[Gpu] = []
    picked_ids: list[str] = []
    entries = cuda_visible_devices.split(",")
    for position, raw in enumerate(entries):
        found = _find(raw, kind, physical, enumeration)
        if found is None or isinstance(found, str):
            why = {
                _AMBIGUOUS: "matches more than one GPU",
                "kind": f"is not of the list's kind ({kind}, set by its first entry)",
            }.get(str(found), "names no GPU here")
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
    shown, mig_notes = apply_mig_limits(chosen, driver_version)
    return shown, notes + mig_notes
