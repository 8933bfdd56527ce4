"""``accelerator``/``devices`` as typed, checked against the machine before anything is built.

Why: "4 GPUs on a 2-GPU machine" is one clear line instead of Lightning's traceback, and "no GPU"
falls back to the CPU with one message. :func:`resolve_devices` decides and changes nothing;
:func:`resolve_for_run` also measures, waits for and claims ``least_used`` GPUs and hands rank 0's
choice to the DDP ranks.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from runkit.gpus import claims
from runkit.gpus.claims import rank_by_load
from runkit.gpus.inventory import IDENTITY, LOAD, cached_inventory
from runkit.gpus.records import DeviceError, Gpu, Inventory, no_gpu_reason

SELECTION_ENV = "RUNKIT_GPU_SELECTION"  # rank 0's least_used choice, inherited by its DDP ranks

SELECT_CHOICES = ("first", "least_used")  # the values of select_gpus


@dataclass(frozen=True)
class DevicePlan:
    """``Trainer(**plan.trainer_kwargs())``, a ``message`` to log once (or ``None``), the chosen
    ``gpus`` when known, and ``handoff``: rank 0's ``least_used`` choice for its DDP ranks."""

    accelerator: Any
    devices: int | str | list[int]
    message: str | None = None
    selected: tuple[int, ...] | None = None
    gpus: tuple[Gpu, ...] = ()
    handoff: str | None = None

    def trainer_kwargs(self) -> dict[str, Any]:
        """A fresh list each call, so the Trainer cannot alter the plan."""
        devices = list(self.devices) if isinstance(self.devices, list) else self.devices
        return {"accelerator": self.accelerator, "devices": devices}


def parse_devices(devices: Any) -> str | int | list[int]:
    """``devices`` as users type it (``2``, ``-1``, ``"auto"``, ``"0,1"``, ``"[0,1]"``, a list) as
    ``"auto"``, a count (``-1``: all) or a list of indices."""
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
    if isinstance(devices, Sequence):  # an OmegaConf ListConfig too
        items = list(devices)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
            raise DeviceError(f"devices={items!r} is not valid; use {accepted}")
        return _check_index_list(items, devices)
    raise DeviceError(f"devices={devices!r} is not valid; use {accepted}")


def _check_index_list(indices: list[int], original: Any) -> list[int]:
    if not indices:
        raise DeviceError(f"devices={original!r} lists no GPU; use a count or at least one index")
    if len(set(indices)) != len(indices):
        raise DeviceError(f"devices={original!r} names a GPU twice; each index may appear once")
    return indices


def _describe_visible(inv: Inventory) -> str:
    n = inv.usable_gpu_count
    if n == 0:
        return f"this machine has no usable GPU ({no_gpu_reason(inv)})"
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
    environ: Mapping[str, str] | None = None,
) -> DevicePlan:
    """What the Trainer gets: ``auto`` without a GPU is the CPU with a ``message``; a GPU, count or
    index that does not exist is a :class:`DeviceError`; ``cpu`` takes a process count; other
    accelerators pass through; ``least_used`` picks by load, or in a DDP child (``LOCAL_RANK``)
    reuses rank 0's choice from ``environ[SELECTION_ENV]``. ``environ`` is only read."""
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
    if inventory is None:
        inventory = cached_inventory(LOAD if select == "least_used" else IDENTITY)
    if inventory.usable_gpu_count == 0:
        return _no_gpu_plan(accelerator, acc, wanted, inventory)
    return _gpu_plan(
        accelerator, wanted, inventory, select, os.environ if environ is None else environ
    )


def _no_gpu_plan(accelerator: Any, acc: Any, wanted: Any, inv: Inventory) -> DevicePlan:
    if acc == "auto" and inv.torch.mps_available:
        return DevicePlan(accelerator, wanted)
    if acc != "auto":
        remedy = "use accelerator=cpu or accelerator=auto"
        if no_gpu_reason(inv).startswith("CUDA_VISIBLE_DEVICES="):
            remedy = "set CUDA_VISIBLE_DEVICES to GPU indices or UUIDs (e.g. 0,1) or unset it"
        raise DeviceError(
            f"accelerator={accelerator} asks for a GPU, but {_describe_visible(inv)}; {remedy}"
        )
    message = f"No usable GPU: {no_gpu_reason(inv)}; this run uses the CPU."
    return _cpu_plan("cpu", "auto" if wanted == -1 else wanted, message=message)


def _gpu_plan(
    accelerator: Any, wanted: Any, inv: Inventory, select: str, environ: Mapping[str, str]
) -> DevicePlan:
    count = inv.usable_gpu_count
    if isinstance(wanted, list):
        missing = [i for i in wanted if i >= count]
        if missing:
            raise DeviceError(
                f"devices={wanted} names GPU {', '.join(map(str, missing))}, "
                f"but {_describe_visible(inv)}"
            )
        return DevicePlan(accelerator, wanted, gpus=_gpus_at(inv, wanted))
    if wanted not in ("auto", -1) and wanted > count:
        raise DeviceError(f"devices={wanted} asks for {wanted} GPUs, but {_describe_visible(inv)}")
    if select == "least_used":
        number = count if wanted in ("auto", -1) else wanted
        return _least_used_plan(accelerator, number, inv, environ)
    if wanted in ("auto", -1):
        return DevicePlan(accelerator, wanted, gpus=inv.visible[:count])
    return DevicePlan(accelerator, wanted, gpus=inv.visible[:wanted])


def resolve_for_run(
    accelerator: Any = "auto",
    devices: Any = "auto",
    *,
    select: str = "first",
    policy: claims.SelectionPolicy | None = None,
    environ: MutableMapping[str, str] | None = None,
) -> DevicePlan:
    """:func:`resolve_devices` for the run that starts now: rank 0 gives back its earlier claims,
    then measures, waits for and claims ``least_used`` GPUs under ``policy``
    (:func:`~runkit.gpus.claims.wait_and_claim`) and puts its choice in ``environ[SELECTION_ENV]``."""
    environ = os.environ if environ is None else environ
    claims.release_claims()
    plan = resolve_devices(accelerator, devices, select=select, environ=environ)
    if plan.handoff is None:
        return plan
    inv = cached_inventory(IDENTITY)
    count = len(plan.selected or ())
    chosen, message = claims.wait_and_claim(inv, count, policy or claims.SelectionPolicy())
    plan = _rank0_plan(plan.accelerator, chosen, message, inv, count)
    environ[SELECTION_ENV] = plan.handoff  # type: ignore[assignment]
    return plan


def _cpu_plan(accelerator: Any, wanted: str | int | list[int], message: str | None) -> DevicePlan:
    if isinstance(wanted, list):
        raise DeviceError(
            f"devices={wanted} lists GPU indices, but this run uses the CPU, where devices is "
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


def _request_key(count: int, inv: Inventory) -> str:
    return f"devices={count} CUDA_VISIBLE_DEVICES={inv.cuda_visible_devices}"


def _least_used_plan(
    accelerator: Any, count: int, inv: Inventory, environ: Mapping[str, str]
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
        chosen, message = claims.first_gpus(count, inv.nvml_reason or "NVML gave none")
    else:
        chosen = sorted(rank_by_load(candidates)[:count])
        message = (
            f"select_gpus=least_used picked {', '.join(f'cuda:{i}' for i in chosen)} of "
            f"{len(candidates)} (most free memory, then lowest utilisation)"
        )
    return _rank0_plan(accelerator, chosen, message, inv, count)


def _rank0_plan(
    accelerator: Any, chosen: list[int], message: str, inv: Inventory, count: int
) -> DevicePlan:
    """Rank 0's choice, with the record its DDP ranks will find in ``SELECTION_ENV``."""
    handoff = json.dumps({"pid": os.getpid(), "request": _request_key(count, inv), "gpus": chosen})
    return DevicePlan(accelerator, chosen, message, tuple(chosen), _gpus_at(inv, chosen), handoff)


def _parse_record(text: str) -> dict[str, Any] | None:
    try:
        record = json.loads(text)
        if (
            isinstance(record, dict)
            and isinstance(record.get("pid"), int)
            and isinstance(record.get("request"), str)
            and isinstance(record.get("gpus"), list)
            and record["gpus"]
            and len(set(record["gpus"])) == len(record["gpus"])
            and all(type(i) is int and i >= 0 for i in record["gpus"])
        ):
            return record
    except ValueError:
        pass
    raise DeviceError(
        f"{SELECTION_ENV}={text!r} is not a GPU choice written by this template; unset it"
    )
