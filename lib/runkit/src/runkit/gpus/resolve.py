"""``accelerator``/``devices`` checked against the machine before anything is built: "4 GPUs on a
2-GPU machine" is one line instead of Lightning's traceback; "no GPU" falls back to the CPU."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from runkit.gpus import claims
from runkit.gpus.inventory import DeviceError, Gpu, Inventory, cached_inventory, no_gpu_reason

SELECTION_ENV = "RUNKIT_GPU_SELECTION"  # rank 0's least_used choice, inherited by its DDP ranks
SELECT_CHOICES = ("first", "least_used")  # the values of select_gpus
_ACCEPTED = "a count ≥ 1, -1 (all), 'auto', or GPU indices such as [0,1] or '0,1'"


@dataclass(frozen=True)
class DevicePlan:
    """``Trainer(**plan.trainer_kwargs())``, a ``message`` to log once (or ``None``), the chosen
    ``gpus`` when known; ``claim``: how many GPUs the run (rank 0 of ``least_used``) claims."""

    accelerator: Any
    devices: int | str | list[int]
    message: str | None = None
    gpus: tuple[Gpu, ...] = ()
    claim: int = 0

    def trainer_kwargs(self) -> dict[str, Any]:
        devices = list(self.devices) if isinstance(self.devices, list) else self.devices  # a copy
        return {"accelerator": self.accelerator, "devices": devices}


def parse_devices(devices: Any) -> str | int | list[int]:
    """``devices`` as users type it as ``"auto"``, a count (``-1``: all) or a list of indices."""
    if isinstance(devices, str):
        text = devices.strip()
        if text.lower() == "auto":
            return "auto"
        if re.fullmatch(r"-?\d+", text):
            return parse_devices(int(text))
        listed = text[:1] == "[" and text[-1:] == "]"
        body = text[1:-1] if listed else text.removesuffix(",") if "," in text else "x"
        parts = [p.strip() for p in body.split(",")]
        if all(re.fullmatch(r"\d+", p) for p in parts):
            return _check_index_list([int(p) for p in parts], devices)
    elif isinstance(devices, int) and not isinstance(devices, bool):
        if devices == -1 or devices >= 1:
            return devices
    elif isinstance(devices, Sequence):  # an OmegaConf ListConfig too
        items = list(devices)
        if all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
            return _check_index_list(items, devices)
        devices = items
    raise DeviceError(f"devices={devices!r} is not valid; use {_ACCEPTED}")


def _check_index_list(indices: list[int], original: Any) -> list[int]:
    if not indices:
        raise DeviceError(f"devices={original!r} lists no GPU; use a count or at least one index")
    if len(set(indices)) != len(indices):
        raise DeviceError(f"devices={original!r} names a GPU twice; each index may appear once")
    return indices


def _describe_visible(inv: Inventory) -> str:
    if (n := inv.usable_gpu_count) == 0:
        return f"this machine has no usable GPU ({no_gpu_reason(inv)})"
    names = [f"cuda:{i} {g.name}" for i, g in enumerate(inv.visible[:n])]
    listing = ", ".join(names) if len(names) == n <= 4 else f"cuda:0..cuda:{n - 1}"
    return f"only {n} GPU{'s are' if n != 1 else ' is'} visible ({listing})"


def resolve_devices(
    accelerator: Any = "auto",
    devices: Any = "auto",
    *,
    select: str = "first",
    inventory: Inventory | None = None,
    environ: Mapping[str, str] | None = None,
) -> DevicePlan:
    """What the Trainer gets; a GPU, count or index that does not exist is a :class:`DeviceError`.
    ``least_used`` is left to the run, or a DDP child reuses rank 0's choice (``SELECTION_ENV``)."""
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
    inv = inventory or cached_inventory()
    if (count := inv.usable_gpu_count) == 0:
        if acc == "auto" and inv.torch.mps_available:
            return DevicePlan(accelerator, wanted)
        if acc == "auto":
            message = f"No usable GPU: {no_gpu_reason(inv)}; this run uses the CPU."
            return _cpu_plan("cpu", "auto" if wanted == -1 else wanted, message=message)
        remedy = "use accelerator=cpu or accelerator=auto"
        if no_gpu_reason(inv).startswith("CUDA_VISIBLE_DEVICES="):
            remedy = "set CUDA_VISIBLE_DEVICES to GPU indices or UUIDs (e.g. 0,1) or unset it"
        raise DeviceError(
            f"accelerator={accelerator} asks for a GPU, but {_describe_visible(inv)}; {remedy}"
        )
    if isinstance(wanted, list):
        if missing := [str(i) for i in wanted if i >= count]:
            raise DeviceError(
                f"devices={wanted} names GPU {', '.join(missing)}, but {_describe_visible(inv)}"
            )
        return DevicePlan(accelerator, wanted, gpus=_gpus_at(inv, wanted))
    if wanted not in ("auto", -1) and int(wanted) > count:
        raise DeviceError(f"devices={wanted} asks for {wanted} GPUs, but {_describe_visible(inv)}")
    number = count if wanted in ("auto", -1) else int(wanted)
    if select == "least_used":
        return _least_used_plan(
            accelerator, number, inv, os.environ if environ is None else environ
        )
    return DevicePlan(accelerator, wanted, gpus=inv.visible[:number])


def resolve_for_run(
    accelerator: Any = "auto",
    devices: Any = "auto",
    *,
    select: str = "first",
    policy: claims.SelectionPolicy | None = None,
    environ: MutableMapping[str, str] | None = None,
) -> DevicePlan:
    """:func:`resolve_devices` for the run that starts now: rank 0 claims ``least_used`` GPUs under
    ``policy`` and puts its choice in ``environ[SELECTION_ENV]`` for its DDP ranks."""
    environ = os.environ if environ is None else environ
    claims.release_claims()
    plan = resolve_devices(accelerator, devices, select=select, environ=environ)
    if not plan.claim:
        return plan
    inv = cached_inventory()
    chosen, message = claims.wait_and_claim(inv, plan.claim, policy or claims.SelectionPolicy())
    record = {"pid": os.getpid(), "request": _request(plan.claim, inv), "gpus": chosen}
    environ[SELECTION_ENV] = json.dumps(record)
    return DevicePlan(plan.accelerator, chosen, message, _gpus_at(inv, chosen))


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


def _least_used_plan(
    accelerator: Any, count: int, inv: Inventory, environ: Mapping[str, str]
) -> DevicePlan:
    key = _request(count, inv)
    saved, local_rank = environ.get(SELECTION_ENV), environ.get("LOCAL_RANK")
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
        return DevicePlan(accelerator, chosen, message, _gpus_at(inv, chosen))
    if local_rank is not None and record is None:
        raise DeviceError(
            f"select_gpus=least_used cannot coordinate processes started by an external launcher "
            f"(LOCAL_RANK={local_rank} is set but {SELECTION_ENV} is not); pin GPUs with "
            "CUDA_VISIBLE_DEVICES or use select_gpus=first"
        )
    first = list(range(count))  # until the run measures and claims
    return DevicePlan(accelerator, first, gpus=_gpus_at(inv, first), claim=count)


def _request(count: int, inv: Inventory) -> str:
    return f"devices={count} CUDA_VISIBLE_DEVICES={inv.cuda_visible_devices}"


def _parse_record(text: str) -> dict[str, Any]:
    with contextlib.suppress(ValueError, TypeError, KeyError):
        record = json.loads(text)
        gpus = record["gpus"]
        if (type(record["pid"]), type(record["request"]), type(gpus)) == (int, str, list) and (
            gpus and len(set(gpus)) == len(gpus) and all(type(i) is int and i >= 0 for i in gpus)
        ):
            return record
    raise DeviceError(
        f"{SELECTION_ENV}={text!r} is not a GPU choice written by this template; unset it"
    )
