"""Which physical GPU is ``cuda:N``: the ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` rules.

NVML numbers GPUs in PCI bus order, while CUDA numbers them in ``CUDA_DEVICE_ORDER`` (default
``FASTEST_FIRST``, which may differ on a machine with mixed GPUs), then filters and reorders them
by ``CUDA_VISIBLE_DEVICES``. When torch can see CUDA the inventory matches each ``cuda:N`` to NVML
by UUID (exact); otherwise it applies these rules, as the CUDA programming guide documents them:

* entries are comma separated; each is a device ordinal (parsed like ``strtoul``: leading digits
  count, so ``"1gpu"`` means 1), a ``GPU-`` UUID or a prefix of one that matches exactly one GPU,
  or a ``MIG-`` UUID (also the pre-R470 form ``MIG-GPU-<uuid>/<gi>/<ci>``);
* the list ends at the first entry that is invalid (negative, out of range, unknown or ambiguous
  UUID), so ``0,2,-1,1`` shows devices 0 and 2;
* a device named twice hides every device (torch's NVML-based counting encodes the same rule);
* an empty string hides every GPU;
* a GPU in MIG mode cannot run CUDA work itself; CUDA shows its MIG devices instead.

Pure functions over :class:`~project.machinery.gpus.records.Gpu` records: no NVML, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from project.machinery.gpus.records import Gpu

DEVICE_ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")
"""Accepted values of ``CUDA_DEVICE_ORDER``; CUDA uses the first for anything else."""

_ORDINAL = re.compile(r"\s*([+-]?)(\d+)")
_AMBIGUOUS = "ambiguous"


def _cuda_units(gpu: Gpu) -> list[Gpu]:
    """What CUDA shows for a physical GPU: itself, or its MIG devices when MIG mode is on.

    Why not nvitop: it always applies the pre-R570 rule, one MIG device in all
    (docs/design/notes.md).
    """
    return list(gpu.mig_devices) if gpu.mig_enabled else [gpu]


def cuda_enumeration(physical: Sequence[Gpu], order: str | None) -> tuple[list[Gpu], list[str]]:
    """Physical GPUs in the order CUDA numbers them before ``CUDA_VISIBLE_DEVICES`` applies.

    ``PCI_BUS_ID`` is NVML's order (sorted by bus id where NVML reports one). CUDA's default
    ``FASTEST_FIRST`` ranks by an unpublished speed estimate and breaks ties by PCI bus id, so it
    equals PCI order when all GPUs are the same model; with mixed models the result is a guess and a
    note says so.

    Why not nvitop: without a driver it ignores ``CUDA_DEVICE_ORDER`` and uses NVML index order,
    not PCI bus order (docs/design/notes.md).
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

    Why not nvitop: it cannot resolve this form from NVML alone (docs/design/notes.md)."""
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

    Implements CUDA's rules (see the module docstring). ``physical`` is NVML's list of physical
    GPUs, each with its MIG devices.

    Why not nvitop: without a driver its rules miss unique UUID prefixes and ``+1``, and with one
    it spawns a child process per new value (docs/design/notes.md).
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
        if found is None or isinstance(found, str):
            why = "matches more than one GPU" if found == _AMBIGUOUS else "names no GPU here"
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
