"""``python -m runkit.devices [--json] [--watch [SECONDS]]``: the GPUs this process may use, as
``cuda:N`` (nvitop numbers them by NVML index and cannot read the fake NVML)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from runkit.gpus.inventory import Gpu, Inventory, collect_inventory, probe_torch

DEFAULT_WATCH_S, MIN_WATCH_S = 2.0, 0.1
JSON_SCHEMA_VERSION = 1  # bumped when a key of the JSON changes meaning or goes away
_GPU_KEYS = "nvml_index name uuid is_mig parent_uuid memory_used_mib memory_total_mib "
_GPU_KEYS += "memory_free_mib utilization_percent temperature_c power_w power_limit_w"
_MAPPING_TEXT = {
    "torch-uuid": "cuda:N matched to NVML by UUID (torch)",
    "env-rules": "cuda:N worked out by CUDA's CUDA_VISIBLE_DEVICES/CUDA_DEVICE_ORDER rules",
    "torch-only": "names from torch; NVML unavailable, so no metrics",
    "none": "no GPU",
}


def _gpu_json(gpu: Gpu, index: int | None) -> dict[str, Any]:
    doc = {"index": index, **{k.removeprefix("is_"): getattr(gpu, k) for k in _GPU_KEYS.split()}}
    return {**doc, "processes": [vars(p) for p in gpu.processes]}


def inventory_to_json(inv: Inventory) -> dict[str, Any]:
    n = inv.usable_gpu_count
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "cuda_available": inv.torch.available,
        "device_count": n,
        "training_device": "cuda" if n else "cpu",
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


def _fmt(value: Any, unit: str = "") -> str:
    return "-" if value is None else f"{value:.0f}{unit}"


def _row(i: int, g: Gpu) -> list[str]:
    total, limit = g.memory_total_mib, g.power_limit_w
    procs = ", ".join(
        f"{p.pid}{' ' + p.name if p.name else ''} ({_fmt(p.used_memory_mib, ' MiB')})"
        for p in g.processes
    )
    return [
        f"cuda:{i}", _fmt(g.nvml_index) + (f" MIG {g.mig_index}" if g.is_mig else ""), g.name,
        g.uuid, "-" if total is None else f"{_fmt(g.memory_used_mib)} / {total} MiB",
        _fmt(g.utilization_percent, "%"), _fmt(g.temperature_c, " °C"),
        _fmt(g.power_w, " W") + ("" if limit is None else f" / {limit:.0f} W"), procs or "-",
    ]  # fmt: skip


def listing(inv: Inventory, header: str | None = None) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(header)] if header else []
    if not inv.visible:
        return Group(*parts, Text(inv.summary()))
    built = f"torch CUDA {inv.torch.version}, " if inv.torch.version else ""
    cuda = f"yes ({built}{inv.torch.device_count} device(s))"
    cvd = inv.cuda_visible_devices
    table = Table(title=inv.summary(), title_justify="left")
    for column in ("cuda", "nvml", "name", "uuid", "memory", "util", "temp", "power", "processes"):
        table.add_column(column, overflow="fold")
    for i, g in enumerate(inv.visible):
        table.add_row(*_row(i, g))
    return Group(
        *parts,
        Text(f"CUDA available: {cuda if inv.torch.available else 'no (training will use the CPU)'}"),
        Text(f"NVML driver {inv.driver_version or '?'}; CUDA_VISIBLE_DEVICES="
             f"{'(unset)' if cvd is None else repr(cvd)}; "
             f"CUDA_DEVICE_ORDER={inv.cuda_device_order}; {_MAPPING_TEXT[inv.mapping]}"),
        table,
        *(Text(f"not visible to CUDA here: NVML GPU {g.nvml_index} {g.name} {g.uuid}") for g in inv.hidden),
        *(Text(f"note: {note}") for note in inv.notes),
    )  # fmt: skip


def render(inv: Inventory, console: Any) -> None:
    console.print(listing(inv), highlight=False, soft_wrap=True)


def watch_seconds(text: str) -> float:
    with contextlib.suppress(ValueError):
        if math.isfinite(value := float(text)) and value >= MIN_WATCH_S:
            return value
    raise argparse.ArgumentTypeError(
        f"SECONDS={text!r} is invalid; expected a number of seconds >= {MIN_WATCH_S}"
    )


def watch(seconds: float, as_json: bool, console: Any = None) -> int:
    """Refresh every ``seconds`` until Ctrl-C: a table redrawn in place, or a JSON line each time."""
    try:  # Ctrl-C in any phase, asking torch included, ends the watch quietly
        from rich.console import Console
        from rich.live import Live

        torch_info = probe_torch()
        if as_json:
            while True:
                doc = inventory_to_json(collect_inventory(torch_info=torch_info))
                print(json.dumps({**doc, "time": time.time()}), flush=True)
                time.sleep(seconds)
        with Live(console=console or Console(), auto_refresh=False) as live:
            while True:
                header = f"{time.strftime('%H:%M:%S')}  every {seconds:g} s; Ctrl-C to quit"
                live.update(listing(collect_inventory(torch_info=torch_info), header), refresh=True)
                time.sleep(seconds)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # ``... --json --watch | head``: the reader left; so do we, quietly
        sys.stdout = None  # type: ignore[assignment]  # nothing left to flush at exit
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runkit.devices",
        description="List the GPUs this process may use (as cuda:N), their load and processes.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.add_argument(
        "--watch",
        nargs="?",
        const=DEFAULT_WATCH_S,
        type=watch_seconds,
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C; with --json, "
        "one JSON document per line",
    )
    args = parser.parse_args(argv)
    if args.watch is not None:
        return watch(args.watch, args.json)
    if args.json:
        print(json.dumps(inventory_to_json(collect_inventory()), indent=2))
    else:
        from rich.console import Console

        render(collect_inventory(), Console())
    return 0
