"""Device resolution at its edges: an index equal to the GPU count, one GPU, four and five GPUs.

Each test pins one behaviour that a small change to ``machinery/gpus/`` would break (``make
mutate MODULE=gpus``): a ``<`` turned ``<=``, a plural lost, a fallback skipped. Everything is
built from plain :class:`Gpu` records or the fake NVML; nothing needs a GPU.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from runkit.gpus import nvml
from runkit.gpus.inventory import build_inventory, collect_inventory
from runkit.gpus.records import Gpu, Inventory, TorchCuda, no_gpu_reason
from runkit.gpus.resolve import (
    SELECTION_ENV,
    DeviceError,
    parse_devices,
    resolve_devices,
    resolve_for_run,
)
from runkit.gpus.visible import apply_visible_devices, cuda_enumeration
from runkit.testing.fake_nvml import GIB, FakeGpu, FakeNvml


def board(i: int, name: str = "H100", **kw: object) -> Gpu:
    return Gpu(
        uuid=f"GPU-{i:04d}", name=name, nvml_index=i, pci_bus_id=f"00000000:{i + 16:02X}:00.0", **kw
    )


def machine(gpus: int, torch_count: int | None = None, **env: str) -> Inventory:
    """``gpus`` physical H100s; torch counts ``torch_count`` of them (default: all visible)."""
    physical = [board(i) for i in range(gpus)]
    count = gpus if torch_count is None else torch_count
    return build_inventory(physical, TorchCuda(count > 0, count), env=env)


# --------------------------------------------------------------------------- index == count


def test_an_index_equal_to_the_gpu_count_does_not_exist() -> None:
    inv = machine(2)
    assert resolve_devices("gpu", [1], inventory=inv).devices == [1]
    with pytest.raises(DeviceError) as info:
        resolve_devices("gpu", [0, 2], inventory=inv)
    assert str(info.value) == (
        "devices=[0, 2] names GPU 2, but only 2 GPUs are visible (cuda:0 H100, cuda:1 H100)"
    )


def test_a_count_equal_to_the_gpu_count_is_every_gpu() -> None:
    inv = machine(2)
    plan = resolve_devices("gpu", 2, inventory=inv)
    assert plan.devices == 2 and [g.uuid for g in plan.gpus] == ["GPU-0000", "GPU-0001"]
    with pytest.raises(DeviceError) as info:
        resolve_devices("gpu", 3, inventory=inv)
    assert str(info.value) == (
        "devices=3 asks for 3 GPUs, but only 2 GPUs are visible (cuda:0 H100, cuda:1 H100)"
    )


def test_plan_gpus_skip_indices_torch_counts_but_nvml_did_not_place() -> None:
    inv = machine(2, torch_count=3)  # torch sees one more device than the env rules place
    plan = resolve_devices("gpu", [0, 2], inventory=inv)
    assert plan.devices == [0, 2] and [g.uuid for g in plan.gpus] == ["GPU-0000"]
    assert [g.uuid for g in resolve_devices("gpu", "auto", inventory=inv).gpus] == [
        "GPU-0000",
        "GPU-0001",
    ]


def test_a_cuda_visible_devices_ordinal_equal_to_the_count_names_no_gpu() -> None:
    physical = [board(i) for i in range(3)]
    visible, notes = apply_visible_devices(physical, "2,3,0", "PCI_BUS_ID")
    assert [g.uuid for g in visible] == ["GPU-0002"]
    assert notes == [
        "CUDA_VISIBLE_DEVICES entry '3' names no GPU here; CUDA stops at the first invalid "
        "entry, so '3,0' is ignored."
    ]
    visible, _ = apply_visible_devices(physical, "+0, 1", "PCI_BUS_ID")  # strtoul reads "+0"
    assert [g.uuid for g in visible] == ["GPU-0000", "GPU-0001"]


def rank0_record(gpus: list[int], request: str) -> dict[str, str]:
    record = {"pid": os.getpid() + 1, "request": request, "gpus": gpus}
    return {SELECTION_ENV: json.dumps(record), "LOCAL_RANK": "1"}


def loaded(loads: list[tuple[int, int]]) -> Inventory:
    """GPUs with (free MiB, utilisation %) readings, all visible to torch."""
    physical = [
        board(i, memory_free_mib=free, utilization_percent=util)
        for i, (free, util) in enumerate(loads)
    ]
    return build_inventory(physical, TorchCuda(True, len(loads)), env={})


def test_rank_zero_choice_of_a_gpu_equal_to_the_count_is_refused() -> None:
    inv = loaded([(10, 0), (20, 0), (30, 0)])
    request = "devices=2 CUDA_VISIBLE_DEVICES=None"
    ok = resolve_devices(
        "gpu", 2, select="least_used", inventory=inv, environ=rank0_record([1, 2], request)
    )
    assert ok.devices == [1, 2] and ok.selected == (1, 2)
    assert [g.uuid for g in ok.gpus] == ["GPU-0001", "GPU-0002"]
    assert ok.handoff is None  # a child hands nothing further
    with pytest.raises(DeviceError) as info:
        resolve_devices(
            "gpu", 2, select="least_used", inventory=inv, environ=rank0_record([0, 3], request)
        )
    assert str(info.value) == (
        f"rank 0 chose GPUs [0, 3] ({SELECTION_ENV}), but only 3 GPUs are visible "
        "(cuda:0 H100, cuda:1 H100, cuda:2 H100) in this process"
    )


# --------------------------------------------------------------------------- what the user reads


def test_one_four_and_five_visible_gpus_are_described_differently() -> None:
    with pytest.raises(DeviceError) as info:
        resolve_devices("gpu", 2, inventory=machine(1))
    assert str(info.value) == "devices=2 asks for 2 GPUs, but only 1 GPU is visible (cuda:0 H100)"
    with pytest.raises(DeviceError) as info:
        resolve_devices("gpu", 5, inventory=machine(4))
    assert str(info.value).endswith(
        "only 4 GPUs are visible (cuda:0 H100, cuda:1 H100, cuda:2 H100, cuda:3 H100)"
    )
    with pytest.raises(DeviceError) as info:
        resolve_devices("gpu", 6, inventory=machine(5))
    assert str(info.value).endswith("only 5 GPUs are visible (cuda:0..cuda:4)")
    with pytest.raises(DeviceError) as info:
        resolve_devices("gpu", 6, inventory=machine(1, torch_count=5))  # names known for one only
    assert str(info.value).endswith("only 5 GPUs are visible (cuda:0..cuda:4)")
    with pytest.raises(DeviceError) as info:
        resolve_devices("gpu", 2, inventory=machine(0, torch_count=1))
    assert str(info.value).endswith("only 1 GPU is visible (cuda:0..cuda:0)")


def test_summary_counts_gpus_in_words() -> None:
    assert machine(1).summary() == "1 CUDA GPU visible; training can use cuda:0..cuda:0."
    assert machine(3).summary() == "3 CUDA GPUs visible; training can use cuda:0..cuda:2."


@pytest.mark.parametrize(
    ("inv", "reason"),
    [
        (machine(2, CUDA_VISIBLE_DEVICES=" "), "CUDA_VISIBLE_DEVICES is set to an empty string"),
        (
            build_inventory([board(0)], TorchCuda(), env={}),
            "NVML sees 1 GPU but torch has no CUDA (CPU-only build?)",
        ),
        (
            build_inventory([board(0), board(1)], TorchCuda(), env={}),
            "NVML sees 2 GPUs but torch has no CUDA (CPU-only build?)",
        ),
        (
            build_inventory([board(0)], TorchCuda(True, 0), env={"CUDA_VISIBLE_DEVICES": "5"}),
            "CUDA_VISIBLE_DEVICES='5' hides every GPU",
        ),
        (build_inventory(None, TorchCuda(), env={}, nvml_reason="no driver"), "no driver"),
        (build_inventory(None, TorchCuda(), env={}), "no NVIDIA GPU found"),
        (build_inventory([], TorchCuda(), env={}, nvml_reason="ignored"), "no NVIDIA GPU found"),
    ],
    ids=[
        "empty-cvd",
        "one-gpu-no-torch",
        "two-gpus-no-torch",
        "hidden",
        "no-nvml",
        "none",
        "nvml-ok",
    ],
)
def test_no_gpu_reason_names_the_cause(inv: Inventory, reason: str) -> None:
    assert no_gpu_reason(inv) == reason


def test_auto_on_a_machine_without_gpu_runs_on_the_cpu() -> None:
    plan = resolve_devices("auto", 2, inventory=machine(0))
    assert plan.trainer_kwargs() == {"accelerator": "cpu", "devices": 2}
    assert plan.message == "No usable GPU: no NVIDIA GPU found; this run uses the CPU."
    mac = build_inventory(None, TorchCuda(mps_available=True), env={})
    with pytest.raises(DeviceError):
        resolve_devices("gpu", 1, inventory=mac)  # MPS does not answer a GPU request


def test_accelerator_names_are_read_without_case_or_spaces() -> None:
    assert resolve_devices(" CPU ", 2).trainer_kwargs() == {"accelerator": " CPU ", "devices": 2}
    assert resolve_devices("Auto", 1, inventory=machine(1)).devices == 1
    with pytest.raises(DeviceError):
        resolve_devices("Cuda", 2, inventory=machine(1))


def test_trainer_kwargs_are_a_fresh_copy() -> None:
    plan = resolve_devices("gpu", [0, 1], inventory=machine(2))
    kwargs = plan.trainer_kwargs()
    kwargs["devices"].append(5)
    assert plan.devices == [0, 1] and plan.trainer_kwargs()["devices"] == [0, 1]


# --------------------------------------------------------------------------- parse_devices


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1), (-1, -1), ("1", 1), (" -1 ", -1), ("AUTO", "auto"), ("3,", [3]), ("[2]", [2])],
)
def test_parse_devices_edges(value: object, expected: object) -> None:
    assert parse_devices(value) == expected


def test_parse_devices_of_an_empty_list_is_one_line() -> None:
    with pytest.raises(DeviceError) as info:
        parse_devices([])
    assert str(info.value) == "devices=[] lists no GPU; use a count or at least one index"


@pytest.mark.parametrize(
    "value", [0, -2, "0", "-2", True, False, 1.0, None, "[1,-1]", "1,,2", [1, True], [-1]]
)
def test_parse_devices_refuses_zero_and_odd_values(value: object) -> None:
    with pytest.raises(DeviceError) as info:
        parse_devices(value)
    message = str(info.value)
    assert message.endswith(
        "is not valid; use a count ≥ 1, -1 (all), 'auto', or GPU indices such as [0,1] or '0,1'"
    )
    assert "\n" not in message


def test_parse_devices_names_a_gpu_given_twice() -> None:
    with pytest.raises(DeviceError) as info:
        parse_devices("[1,1]")
    assert str(info.value) == "devices='[1,1]' names a GPU twice; each index may appear once"
    assert parse_devices((0, 2)) == [0, 2]


# --------------------------------------------------------------------------- least_used


def test_least_used_picks_by_free_memory_among_visible_gpus() -> None:
    inv = loaded([(10, 0), (30, 50), (20, 0), (30, 10)])
    plan = resolve_devices("gpu", 2, select="least_used", inventory=inv, environ={})
    assert plan.devices == [1, 3]
    assert plan.message == (
        "select_gpus=least_used picked cuda:1, cuda:3 of 4 (most free memory, then lowest "
        "utilisation)"
    )
    assert json.loads(plan.handoff or "") == {
        "pid": os.getpid(),
        "request": "devices=2 CUDA_VISIBLE_DEVICES=None",
        "gpus": [1, 3],
    }


def test_least_used_without_readings_takes_the_first() -> None:
    inv = loaded([(None, None), (None, 5), (None, None)])  # type: ignore[list-item]
    plan = resolve_devices("gpu", 2, select="least_used", inventory=inv, environ={})
    assert plan.devices == [0, 1]
    assert plan.message == (
        "select_gpus=least_used: no GPU load readings (NVML gave none); using the first 2: [0, 1]"
    )
    some = loaded([(None, None), (None, None), (5, 0)])  # type: ignore[list-item]
    assert resolve_devices("gpu", 1, select="least_used", inventory=some, environ={}).devices == [2]
    fewer = build_inventory([board(0, memory_free_mib=1)], TorchCuda(True, 3), env={})
    assert resolve_devices("gpu", 2, select="least_used", inventory=fewer, environ={}).devices == [
        0,
        1,
    ]


def test_resolve_for_run_hands_the_choice_on_only_when_there_is_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runkit.gpus import inventory as inventory_module
    from runkit.gpus.claims import SelectionPolicy

    lib = FakeNvml([FakeGpu(memory_used=used * GIB) for used in (40, 0, 60)], clock=lambda: 0.0)
    monkeypatch.setattr(inventory_module, "probe_torch", lambda uuids=True: TorchCuda(True, 3))
    policy = SelectionPolicy(util_window_s=0.2, lock_dir=str(tmp_path / "locks"))
    nvml.use_library(lib)
    try:
        environ: dict[str, str] = {}
        plan = resolve_for_run("gpu", 1, select="least_used", policy=policy, environ=environ)
        assert plan.devices == [1]
        assert json.loads(environ[SELECTION_ENV])["gpus"] == [1]
        quiet: dict[str, str] = {}
        resolve_for_run("gpu", 1, environ=quiet)  # gives the claim back, claims nothing
        assert quiet == {}
    finally:
        nvml.use_library(None)


@pytest.mark.parametrize(
    "text",
    [
        '{"pid": "1", "request": "r", "gpus": [0]}',
        '{"pid": 1, "request": 5, "gpus": [0]}',
        '{"pid": 1, "request": "r", "gpus": "0"}',
        '{"pid": 1, "request": "r", "gpus": []}',
        '{"pid": 1, "request": "r", "gpus": [0, 0]}',
        '{"pid": 1, "request": "r", "gpus": [-1]}',
        '{"pid": 1, "request": "r", "gpus": [true]}',
        "not json",
    ],
)
def test_a_handed_over_choice_not_written_by_the_template_is_refused(text: str) -> None:
    environ = {SELECTION_ENV: text, "LOCAL_RANK": "1"}
    with pytest.raises(DeviceError) as info:
        resolve_devices(
            "gpu", 1, select="least_used", inventory=loaded([(1, 0), (2, 0)]), environ=environ
        )
    assert str(info.value) == (
        f"{SELECTION_ENV}={text!r} is not a GPU choice written by this template; unset it"
    )


# --------------------------------------------------------------------------- CUDA's numbering


def test_pci_order_without_bus_ids_follows_nvml_indices() -> None:
    a = Gpu(uuid="GPU-a", name="A", nvml_index=1, pci_bus_id=None)
    b = Gpu(uuid="GPU-b", name="A", nvml_index=0, pci_bus_id="00000000:99:00.0")
    ordered, notes = cuda_enumeration([a, b], "pci_bus_id")
    assert [g.uuid for g in ordered] == ["GPU-b", "GPU-a"] and notes == []
    c = Gpu(uuid="GPU-c", name="B", nvml_index=2, pci_bus_id="00000000:01:00.0")
    d = Gpu(uuid="GPU-d", name="B", nvml_index=3, pci_bus_id="00000000:02:00.0")
    ordered, notes = cuda_enumeration([d, c], " pci_bus_id ")
    assert [g.uuid for g in ordered] == ["GPU-c", "GPU-d"] and notes == []
    _, notes = cuda_enumeration([a, c], None)
    assert len(notes) == 1 and notes[0].startswith("CUDA_DEVICE_ORDER is FASTEST_FIRST")


def test_an_unknown_device_order_is_noted_and_fastest_first_used() -> None:
    inv = build_inventory([board(0)], TorchCuda(True, 1), env={"CUDA_DEVICE_ORDER": "slowest"})
    assert inv.cuda_device_order == "FASTEST_FIRST"
    assert inv.notes == (
        "CUDA_DEVICE_ORDER='SLOWEST' is not one of FASTEST_FIRST, PCI_BUS_ID; CUDA uses "
        "FASTEST_FIRST.",
    )


def test_inventory_without_nvml_names_torch_devices_it_cannot_name() -> None:
    inv = build_inventory(None, TorchCuda(True, 2, uuids=("u0",), names=("L4",)), env={})
    assert [(g.uuid, g.name) for g in inv.visible] == [("u0", "L4"), ("", "cuda:1")]
    assert inv.mapping == "torch-only" and not inv.nvml_available
    none = build_inventory(None, TorchCuda(False, 0), env={})
    assert none.mapping == "none" and none.visible == ()


def test_a_torch_device_unknown_to_nvml_is_listed_without_metrics() -> None:
    physical = [board(0)]
    torch_info = TorchCuda(True, 2, uuids=("0000", "beef"), names=("H100",))
    inv = build_inventory(physical, torch_info, env={})
    assert [(g.uuid, g.name) for g in inv.visible] == [
        ("GPU-0000", "H100"),
        ("beef", "unknown GPU"),
    ]
    assert inv.notes == ("cuda:1 (beef) is not in NVML's list; shown without metrics.",)
    named = TorchCuda(True, 2, uuids=("0000", "beef"), names=("H100", "L4"))
    assert build_inventory(physical, named, env={}).visible[1].name == "L4"


def test_collect_inventory_reads_torch_only_when_not_told() -> None:
    nvml.use_library(FakeNvml(2, clock=lambda: 0.0))
    try:
        inv = collect_inventory(torch_info=TorchCuda(True, 2), env={}, detail="identity")
    finally:
        nvml.use_library(None)
    assert inv.mapping == "env-rules" and len(inv.visible) == 2
    assert inv.visible[0].memory_total_mib is None  # identity: no figures read


# --------------------------------------------------------------------------- the listing


def listing_text(inv: Inventory) -> list[str]:
    import io

    from rich.console import Console

    from runkit.gpus.listing import render

    console = Console(file=io.StringIO(), width=160, record=True, color_system=None)
    render(inv, console)
    return [line.rstrip() for line in console.export_text().splitlines()]


def listed_machine() -> Inventory:
    from runkit.gpus.records import GpuProcess

    mig = Gpu(
        uuid="MIG-beef",
        name="A100 slice",
        nvml_index=1,
        parent_uuid="GPU-0001",
        mig_index=3,
        memory_total_mib=10240,
        processes=(GpuProcess(7, None, "python"),),
    )
    a100 = Gpu(uuid="GPU-0001", name="A100", nvml_index=1, mig_enabled=True, mig_devices=(mig,))
    h100 = Gpu(
        uuid="GPU-0000",
        name="H100",
        nvml_index=0,
        memory_total_mib=81920,
        memory_used_mib=1024,
        utilization_percent=37,
        temperature_c=41,
        power_w=71.5,
        power_limit_w=700.0,
        processes=(GpuProcess(4242, 3072, "train.py"), GpuProcess(99, 5, None)),
    )
    hidden = Gpu(uuid="GPU-0002", name="L4", nvml_index=2, power_w=20.0)
    return build_inventory(
        [h100, a100, hidden],
        TorchCuda(True, 2, version="12.4"),
        env={"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
        driver_version="570.1",
    )


def test_the_human_listing_shows_every_figure_as_the_user_reads_it() -> None:
    assert listing_text(listed_machine()) == [
        "CUDA available: yes (torch CUDA 12.4, 2 device(s))",
        "NVML driver 570.1; CUDA_VISIBLE_DEVICES='0,1'; CUDA_DEVICE_ORDER=PCI_BUS_ID; cuda:N "
        "worked out by CUDA's CUDA_VISIBLE_DEVICES/CUDA_DEVICE_ORDER rules",
        "2 CUDA GPUs visible; training can use cuda:0..cuda:1.",
        "┏━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━┳━━━━━━┳━━━━━━━┳━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓",
        "┃ cuda   ┃ nvml    ┃ name       ┃ uuid     ┃ memory           ┃ util ┃ temp  ┃ power        ┃ processes                            ┃",
        "┡━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━╇━━━━━━╇━━━━━━━╇━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩",
        "│ cuda:0 │ 0       │ H100       │ GPU-0000 │ 1024 / 81920 MiB │ 37%  │ 41 °C │ 72 W / 700 W │ 4242 train.py (3072 MiB), 99 (5 MiB) │",
        "│ cuda:1 │ 1 MIG 3 │ A100 slice │ MIG-beef │ - / 10240 MiB    │ -    │ -     │ -            │ 7 python (-)                         │",
        "└────────┴─────────┴────────────┴──────────┴──────────────────┴──────┴───────┴──────────────┴──────────────────────────────────────┘",
        "not visible to CUDA here: NVML GPU 2 L4 GPU-0002",
    ]


def test_the_listing_header_without_torch_cuda_or_driver() -> None:
    inv = build_inventory([board(0)], TorchCuda(False, 0), env={})
    lines = listing_text(inv)
    assert lines[0] == "CUDA available: no (training will use the CPU)"
    assert lines[1] == (
        "NVML driver ?; CUDA_VISIBLE_DEVICES=(unset); CUDA_DEVICE_ORDER=FASTEST_FIRST; cuda:N "
        "worked out by CUDA's CUDA_VISIBLE_DEVICES/CUDA_DEVICE_ORDER rules"
    )
    inv = build_inventory(None, TorchCuda(True, 1, uuids=("u",), names=("L4",)), env={})
    lines = listing_text(inv)
    assert lines[0] == "CUDA available: yes (1 device(s))"
    assert lines[1].endswith("; names from torch; NVML unavailable, so no metrics")
    inv = build_inventory([board(0)], TorchCuda(True, 1, uuids=("0000",)), env={})
    assert listing_text(inv)[1].endswith("; cuda:N matched to NVML by UUID (torch)")
    assert listing_text(machine(0)) == [
        "No usable GPU: no NVIDIA GPU found; training will use the CPU."
    ]


def test_the_listing_notes_come_last() -> None:
    inv = build_inventory([board(0)], TorchCuda(True, 1), env={"CUDA_DEVICE_ORDER": "x"})
    assert listing_text(inv)[-1] == (
        "note: CUDA_DEVICE_ORDER='X' is not one of FASTEST_FIRST, PCI_BUS_ID; CUDA uses FASTEST_FIRST."
    )


def test_json_says_where_training_runs_and_is_indented(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from runkit.gpus import inventory as inventory_module
    from runkit.gpus.listing import inventory_to_json, main

    assert inventory_to_json(machine(0))["training_device"] == "cpu"
    assert inventory_to_json(machine(1))["training_device"] == "cuda"
    nvml.use_library(FakeNvml(1, clock=lambda: 0.0))
    monkeypatch.setattr(inventory_module, "probe_torch", lambda uuids=True: TorchCuda(True, 1))
    try:
        assert main(["--json"]) == 0
    finally:
        nvml.use_library(None)
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == ["{", '  "schema_version": 1,']
    assert json.loads(out)["device_count"] == 1


def test_the_listing_help_names_the_command_and_its_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from runkit.gpus.listing import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: python -m runkit.devices [-h] [--json] ")
    assert re.search(
        r"(^| )List the GPUs this process may use \(as cuda:N\), their load and processes\.( |$)",
        out,
    )
    assert "--json print JSON for scripts" in out
    assert out.startswith("usage: python -m runkit.devices [-h] [--json] [--watch [SECONDS]]")
    assert (
        "--watch [SECONDS] refresh every SECONDS (default 2) until Ctrl-C; with --json, one JSON "
        "document per line" in out
    )


def test_watch_without_seconds_refreshes_every_two(monkeypatch: pytest.MonkeyPatch) -> None:
    from runkit.gpus import listing

    asked: list[tuple[float, bool]] = []
    monkeypatch.setattr(
        listing, "watch", lambda seconds, as_json: asked.append((seconds, as_json)) or 0
    )
    assert listing.main(["--watch"]) == 0
    assert listing.main(["--json", "--watch", "0.5"]) == 0
    assert asked == [(2.0, False), (0.5, True)]


# --------------------------------------------------------------------------- reading a device


class NamedProcessesNvml(FakeNvml):
    """The fake NVML plus the two queries it lacks: process names and graphics processes."""

    def nvmlSystemGetProcessName(self, pid: int) -> bytes:
        if pid == 4242:
            return b"train.py"  # old bindings give bytes
        if pid == 5:
            return b""  # a name NVML could not read
        raise self.NVMLError(3)  # NOT_FOUND: a process gone meanwhile

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        from types import SimpleNamespace

        return [SimpleNamespace(pid=4242, usedGpuMemory=GIB), SimpleNamespace(pid=77)]


def test_processes_are_listed_once_with_their_names() -> None:
    from runkit.gpus.inventory import read_nvml
    from runkit.gpus.records import GpuProcess
    from runkit.testing.fake_nvml import FakeProcess

    lib = NamedProcessesNvml([FakeGpu(processes=[FakeProcess(4242, 2 * GIB), FakeProcess(5, GIB)])])
    nvml.use_library(lib)
    try:
        gpus, _, _ = read_nvml("full")
    finally:
        nvml.use_library(None)
    assert gpus[0].processes == (
        GpuProcess(4242, 2048, "train.py"),  # the compute entry wins over the graphics one
        GpuProcess(5, 1024, None),
        GpuProcess(77, None, None),
    )


def open_reader(lib: FakeNvml, index: int = 0) -> Any:
    from runkit.gpus.reader import DeviceReader

    return DeviceReader.open(lib, lib.nvmlDeviceGetHandleByIndex(index))


def test_the_reader_reads_every_board_figure_in_nvml_units() -> None:
    lib = FakeNvml(
        [
            FakeGpu(
                clock_sm_mhz=1410,
                clocks_event_reasons=4,
                energy_mj=123_456,
                fan_pct=55,
                pcie_tx_kbs=10,
                pcie_rx_kbs=20,
                ecc_uncorrected=3,
                memory_temperature=71,
            ),
            FakeGpu(),
        ],
        clock=lambda: 0.0,
    )
    lib.nvmlInit()
    try:
        reader = open_reader(lib)
        assert not reader.is_mig and reader.index() == 0 and open_reader(lib, 1).index() == 1
        assert reader.sm_clock_mhz() == 1410.0 and isinstance(reader.sm_clock_mhz(), float)
        assert reader.clock_event_reasons() == 4
        assert reader.energy_mj() == 123_456.0
        assert reader.fan_pct() == 55.0
        assert reader.pcie_kbs() == (10.0, 20.0)
        assert reader.ecc_uncorrected() == 3.0
        assert reader.memory_temperature_c() == 71.0
        with pytest.raises(lib.NVMLError):
            open_reader(lib, 1).memory_temperature_c()  # not reported by that board
    finally:
        lib.nvmlShutdown()


def test_the_reader_of_a_mig_slice_reads_board_figures_from_its_gpu() -> None:
    lib = FakeNvml(
        [FakeGpu(clock_sm_mhz=1000, mig=[FakeGpu(memory_total=10 * GIB)]), FakeGpu()],
        clock=lambda: 0.0,
    )
    lib.nvmlInit()
    try:
        board_handle = lib.nvmlDeviceGetHandleByIndex(0)
        child = lib.nvmlDeviceGetMigDeviceHandleByIndex(board_handle, 0)
        from runkit.gpus.reader import DeviceReader

        reader = DeviceReader.open(lib, child)
        assert reader.is_mig and reader.handle is child
        assert reader.index() == 0 and reader.sm_clock_mhz() == 1000.0
        assert reader.memory()[0] == 10 * GIB
    finally:
        lib.nvmlShutdown()


def test_clock_event_reasons_fall_back_to_the_throttle_name_of_old_drivers() -> None:
    class OldDriver(FakeNvml):
        def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
            raise AttributeError("not in these bindings")

    class NotSupported(FakeNvml):
        def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
            raise self.NVMLError_NotSupported()

    for lib_type in (OldDriver, NotSupported, FakeNvml):
        lib = lib_type([FakeGpu(clocks_event_reasons=8)], clock=lambda: 0.0)
        lib.nvmlInit()
        try:
            reader = open_reader(lib)
            assert reader.clock_event_reasons() == 8
            assert reader.clock_event_reasons() == 8  # the name found is kept
        finally:
            lib.nvmlShutdown()
        if lib_type is not FakeNvml:
            assert lib.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2


def test_error_classes_are_those_the_bindings_have() -> None:
    lib = FakeNvml(1)
    classes = nvml.error_classes(
        lib, ["NVMLError_NotSupported", "NVMLError_NoSuchThing", "NVML_SUCCESS"]
    )
    assert classes == (lib.NVMLError_NotSupported,)


# --------------------------------------------------------------------------- NVML and torch


def test_a_backend_spec_without_factory_uses_create(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "_env_cache", {})  # a fresh process: nothing loaded yet
    monkeypatch.setenv(nvml.BACKEND_ENV, "runkit.testing.fake_nvml")
    monkeypatch.setenv("RUNKIT_FAKE_NVML", json.dumps({"gpus": [{}, {}]}))
    lib = nvml.load_library()
    assert isinstance(lib, FakeNvml) and len(lib.gpus) == 2
    monkeypatch.setenv(nvml.BACKEND_ENV, "runkit.testing.fake_nvml:no_such_factory")
    with pytest.raises(nvml.NvmlUnavailable) as info:
        nvml.load_library()
    assert str(info.value) == (
        "RUNKIT_NVML_BACKEND='runkit.testing.fake_nvml:no_such_factory' does not "
        "name an importable 'module:factory'"
    )


def test_a_uuid_with_the_wrong_prefix_is_found_in_one_extra_lookup_at_most() -> None:
    lib = FakeNvml(
        [FakeGpu(uuid="GPU-abcd"), FakeGpu(uuid="GPU-ef01", mig=[FakeGpu(uuid="MIG-9999")])]
    )
    lib.nvmlInit()
    try:
        for spelling, expected in (
            ("MIG-9999", "MIG-9999"),
            ("mig-9999", "MIG-9999"),
            ("9999", "MIG-9999"),
            ("GPU-abcd", "GPU-abcd"),
            ("MIG-abcd", "GPU-abcd"),  # a GPU's UUID given with MIG-
        ):
            lib.reset_counters()
            found = nvml.find_handle(lib, spelling)
            assert found is not None and found[1] == expected, spelling
            first_try = expected.startswith("MIG-") == spelling.upper().startswith("MIG-")
            assert lib.calls["nvmlDeviceGetHandleByUUID"] == (1 if first_try else 2), spelling
        assert nvml.find_handle(lib, "GPU-0000") is None
    finally:
        lib.nvmlShutdown()


def test_probe_torch_counts_without_initialising_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from runkit.gpus.inventory import probe_torch

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: calls.append("count") or 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append("available") or True)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)

    class Props:
        def __init__(self, i: int) -> None:
            self.uuid = f"uuid-{i}"
            self.name = f"GPU {i}"

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: calls.append(f"props {i}") or Props(i)
    )
    assert probe_torch(uuids=False) == TorchCuda(True, 2, version="12.4", mps_available=True)
    assert calls == ["count"]
    calls.clear()
    assert probe_torch() == TorchCuda(
        True, 2, ("uuid-0", "uuid-1"), ("GPU 0", "GPU 1"), "12.4", True
    )
    assert calls == ["available", "count", "props 0", "props 1"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: type("P", (), {"name": "L4"})()
    )
    assert probe_torch(uuids=False).available  # one GPU is a GPU
    assert probe_torch().uuids == ("",)  # properties without a uuid (old torch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe_torch() == TorchCuda(version="12.4", mps_available=True)  # a Mac
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert probe_torch(uuids=False) == TorchCuda(False, 0, version="12.4")
    assert probe_torch() == TorchCuda(version="12.4")


def test_collect_inventory_asks_torch_for_uuids_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from runkit.gpus import inventory as inventory_module

    asked: list[bool] = []

    def probe(uuids: bool = True) -> TorchCuda:
        asked.append(uuids)
        return TorchCuda(True, 1)

    monkeypatch.setattr(inventory_module, "probe_torch", probe)
    nvml.use_library(FakeNvml(1, clock=lambda: 0.0))
    try:
        collect_inventory(env={})
        collect_inventory(env={}, probe_uuids=False)
    finally:
        nvml.use_library(None)
    assert asked == [True, False]


def test_collect_inventory_keeps_the_environment_and_notes_it_was_given() -> None:
    lib = FakeNvml([FakeGpu(), FakeGpu()], clock=lambda: 0.0)
    lib.gpus[1].lose(0.0)
    nvml.use_library(lib)
    try:
        inv = collect_inventory(torch_info=TorchCuda(True, 1), env={"CUDA_VISIBLE_DEVICES": "0"})
    finally:
        nvml.use_library(None)
    assert inv.cuda_visible_devices == "0"
    assert any(note.startswith("NVML cannot open GPU 1 (") for note in inv.notes)
    nvml.use_library(FakeNvml(1, init_error="driver_not_loaded"))
    try:
        failed = collect_inventory(torch_info=TorchCuda(), env={"CUDA_VISIBLE_DEVICES": "3"})
    finally:
        nvml.use_library(None)
    assert failed.cuda_visible_devices == "3" and not failed.nvml_available
    assert failed.nvml_reason is not None and failed.nvml_reason.startswith(
        "NVML is not available ("
    )


def test_least_used_ranks_zero_free_below_some_and_zero_load_above_some() -> None:
    from runkit.gpus.resolve import rank_by_load

    def g(free: int | None, util: int | None) -> Gpu:
        return Gpu(uuid="", name="x", memory_free_mib=free, utilization_percent=util)

    assert rank_by_load([g(0, 0), g(1, 50)]) == [1, 0]
    assert rank_by_load([g(5, 1), g(5, 0)]) == [1, 0]


def test_cpu_plans_refuse_gpu_requests_in_exact_words() -> None:
    with pytest.raises(DeviceError) as info:
        resolve_devices("cpu", [0])
    assert str(info.value) == (
        "devices=[0] lists GPU indices, but this run uses the CPU, where devices is a process "
        "count (an integer ≥ 1 or 'auto')"
    )
    with pytest.raises(DeviceError) as info:
        resolve_devices("cpu", -1)
    assert str(info.value) == (
        "devices=-1 means 'every GPU' and has no meaning with accelerator=cpu; "
        "use a process count ≥ 1 or 'auto'"
    )


def test_an_external_launcher_is_refused_in_exact_words() -> None:
    with pytest.raises(DeviceError) as info:
        resolve_devices(
            "gpu",
            1,
            select="least_used",
            inventory=loaded([(1, 0), (2, 0)]),
            environ={"LOCAL_RANK": "2"},
        )
    assert str(info.value) == (
        f"select_gpus=least_used cannot coordinate processes started by an external launcher "
        f"(LOCAL_RANK=2 is set but {SELECTION_ENV} is not); pin GPUs with "
        "CUDA_VISIBLE_DEVICES or use select_gpus=first"
    )


def test_a_rank_zero_choice_keeps_the_accelerator_asked_for() -> None:
    inv = loaded([(10, 0), (20, 0)])
    environ = rank0_record([1], "devices=1 CUDA_VISIBLE_DEVICES=None")
    plan = resolve_devices("cuda", 1, select="least_used", inventory=inv, environ=environ)
    assert plan.trainer_kwargs() == {"accelerator": "cuda", "devices": [1]}
    assert plan.message == "GPUs chosen by rank 0 (least used): [1]"


class CheckedEcc(FakeNvml):
    """The fake, refusing an ECC query for anything but volatile uncorrected errors."""

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter: int) -> int:
        if (error_type, counter) != (
            self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            self.NVML_VOLATILE_ECC,
        ):
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        return 2


def test_ecc_counts_volatile_uncorrected_errors() -> None:
    lib = CheckedEcc([FakeGpu()], clock=lambda: 0.0)
    lib.nvmlInit()
    try:
        assert open_reader(lib).ecc_uncorrected() == 2.0
    finally:
        lib.nvmlShutdown()


class TypedField(FakeNvml):
    """The fake, answering the memory temperature field with a chosen NVML value type."""

    value_type = 0
    result = 0  # NVML_SUCCESS

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: Any) -> list[Any]:
        from types import SimpleNamespace

        value = SimpleNamespace(dVal=1.5, uiVal=2, ulVal=3, ullVal=4, sllVal=5, siVal=6)
        return [SimpleNamespace(nvmlReturn=self.result, valueType=self.value_type, value=value)]


@pytest.mark.parametrize(
    ("value_type", "expected"), [(0, 1.5), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (9, 6)]
)
def test_memory_temperature_reads_the_field_of_its_value_type(
    value_type: int, expected: float
) -> None:
    lib = TypedField([FakeGpu()], clock=lambda: 0.0)
    lib.value_type = value_type
    lib.nvmlInit()
    try:
        assert open_reader(lib).memory_temperature_c() == expected
    finally:
        lib.nvmlShutdown()


def test_memory_temperature_refused_raises_the_error_nvml_gave() -> None:
    lib = TypedField([FakeGpu()], clock=lambda: 0.0)
    lib.result = lib.NVML_ERROR_NOT_SUPPORTED
    lib.nvmlInit()
    try:
        with pytest.raises(lib.NVMLError_NotSupported):
            open_reader(lib).memory_temperature_c()
    finally:
        lib.nvmlShutdown()


# --------------------------------------------------------------------------- more edges


@pytest.mark.parametrize(
    ("value", "shown", "note"),
    [
        (
            "GPU-0000,1",
            ["GPU-0000"],
            "CUDA_VISIBLE_DEVICES entry '1' is not of the list's kind (GPU- UUIDs, set by its first "
            "entry); CUDA stops at the first invalid entry, so '1' is ignored.",
        ),
        (
            "GPU-0000, GPU-0001",  # torch compares the raw entry: the blank ends the list
            ["GPU-0000"],
            "CUDA_VISIBLE_DEVICES entry ' GPU-0001' is not of the list's kind (GPU- UUIDs, set by "
            "its first entry); CUDA stops at the first invalid entry, so ' GPU-0001' is ignored.",
        ),
        (
            "0,GPU-0001",
            ["GPU-0000"],
            "CUDA_VISIBLE_DEVICES entry 'GPU-0001' is not of the list's kind (indices, set by its "
            "first entry); CUDA stops at the first invalid entry, so 'GPU-0001' is ignored.",
        ),
        (
            "0,MIG-beef",
            ["GPU-0000"],
            "CUDA_VISIBLE_DEVICES entry 'MIG-beef' is not of the list's kind (indices, set by its "
            "first entry); CUDA stops at the first invalid entry, so 'MIG-beef' is ignored.",
        ),
        (
            "MIG-beef,0",
            ["MIG-beef"],
            "CUDA_VISIBLE_DEVICES entry '0' is not of the list's kind (MIG- UUIDs, set by its "
            "first entry); CUDA stops at the first invalid entry, so '0' is ignored.",
        ),
    ],
)
def test_an_entry_of_another_kind_ends_the_list(value: str, shown: list[str], note: str) -> None:
    mig = Gpu(uuid="MIG-beef", name="slice", nvml_index=1, parent_uuid="GPU-0001")
    physical = [board(0), board(1, mig_enabled=True, mig_devices=(mig,))]
    visible, notes = apply_visible_devices(physical, value, "PCI_BUS_ID", driver_version="570.1")
    assert [g.uuid for g in visible] == shown
    assert note in notes


def test_a_narrow_terminal_folds_long_values_and_shows_unknowns_as_dashes() -> None:
    import io

    from rich.console import Console

    from runkit.gpus.listing import render

    long_uuid = "GPU-" + "0123456789abcdef" * 4
    inv = build_inventory(None, TorchCuda(True, 1, uuids=(long_uuid,), names=("L4",)), env={})
    console = Console(file=io.StringIO(), width=70, record=True, color_system=None)
    render(inv, console)
    text = console.export_text()
    assert "…" not in text  # folded onto more lines, never cut
    assert (
        "".join(line.split("│")[4].strip() for line in text.splitlines() if line.count("│") > 8)
        == long_uuid
    )
    row = next(line for line in text.splitlines() if line.startswith("│ cuda:"))
    cells = [cell.strip() for cell in row.split("│")[1:-1]]
    assert cells[1] == "-" and cells[4] == "-" and cells[8] == "-"  # nvml index, memory, processes


def test_the_listing_text_is_not_colour_highlighted() -> None:
    import io

    from rich.console import Console

    from runkit.gpus.listing import render

    console = Console(file=io.StringIO(), width=200, force_terminal=True, color_system="standard")
    render(listed_machine(), console)
    first = console.file.getvalue().splitlines()[0]  # type: ignore[attr-defined]
    assert first == "CUDA available: yes (torch CUDA 12.4, 2 device(s))"


class GraphicsNvml(FakeNvml):
    """The fake plus graphics processes, and a compute process that reports no memory."""

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        from types import SimpleNamespace

        assert handle is not None
        return [SimpleNamespace(pid=88, usedGpuMemory=2 * GIB), SimpleNamespace(pid=89)]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        from types import SimpleNamespace

        return [SimpleNamespace(pid=5)]


def test_graphics_and_compute_processes_are_read_with_their_memory() -> None:
    lib = GraphicsNvml([FakeGpu()], clock=lambda: 0.0)
    lib.nvmlInit()
    try:
        reader = open_reader(lib)
        assert reader.graphics_processes() == [(88, 2 * GIB), (89, None)]
        assert reader.compute_processes() == [(5, None)]
    finally:
        lib.nvmlShutdown()


def test_a_fresh_least_used_choice_keeps_the_accelerator_and_names_its_gpus() -> None:
    inv = loaded([(10, 0), (30, 0), (20, 0)])
    plan = resolve_devices("cuda", 2, select="least_used", inventory=inv, environ={})
    assert plan.accelerator == "cuda" and plan.devices == [1, 2]
    assert [g.uuid for g in plan.gpus] == ["GPU-0001", "GPU-0002"]


def test_parse_devices_reads_brackets_only_as_a_pair_and_a_trailing_comma() -> None:
    assert parse_devices("0,1,") == [0, 1]
    for half in ("0,1]", "[0,1"):
        with pytest.raises(DeviceError):
            parse_devices(half)


def test_resolve_devices_defaults_to_auto() -> None:
    plan = resolve_devices(inventory=machine(0))
    assert plan.trainer_kwargs() == {"accelerator": "cpu", "devices": "auto"}
    assert plan.message == "No usable GPU: no NVIDIA GPU found; this run uses the CPU."
    assert resolve_devices(inventory=machine(2)).trainer_kwargs() == {
        "accelerator": "auto",
        "devices": "auto",
    }


def test_every_gpu_and_one_gpu_are_different_requests() -> None:
    inv = machine(2)
    every = resolve_devices("gpu", -1, inventory=inv)
    assert every.devices == -1 and [g.uuid for g in every.gpus] == ["GPU-0000", "GPU-0001"]
    one = resolve_devices("gpu", 1, inventory=inv)
    assert one.devices == 1 and [g.uuid for g in one.gpus] == ["GPU-0000"]
    by_load = loaded([(10, 0), (30, 0)])
    assert resolve_devices(
        "gpu", -1, select="least_used", inventory=by_load, environ={}
    ).devices == [0, 1]
    plan = resolve_devices("gpu", 1, select="least_used", inventory=by_load, environ={})
    assert plan.devices == [1]
    with pytest.raises(DeviceError) as info:
        resolve_devices("gpu", 3, select="least_used", inventory=by_load, environ={})
    assert str(info.value) == (
        "devices=3 asks for 3 GPUs, but only 2 GPUs are visible (cuda:0 H100, cuda:1 H100)"
    )


def test_an_accelerator_object_and_a_mac_pass_through_untouched() -> None:
    class MyAccelerator:
        pass

    mine = MyAccelerator()
    plan = resolve_devices(mine, 2, inventory=machine(2))
    assert plan.accelerator is mine and plan.devices == 2
    mac = build_inventory(None, TorchCuda(mps_available=True), env={})
    assert resolve_devices("auto", 1, inventory=mac).trainer_kwargs() == {
        "accelerator": "auto",
        "devices": 1,
    }


def test_every_missing_index_is_named() -> None:
    with pytest.raises(DeviceError) as info:
        resolve_devices("gpu", [0, 2, 3], inventory=machine(2))
    assert str(info.value).startswith("devices=[0, 2, 3] names GPU 2, 3, but only 2 GPUs")


def test_pci_order_breaks_ties_of_bus_id_by_nvml_index() -> None:
    a = Gpu(uuid="GPU-a", name="A", nvml_index=2, pci_bus_id="00000000:01:00.0")
    b = Gpu(uuid="GPU-b", name="A", nvml_index=0, pci_bus_id="00000000:01:00.0")
    c = Gpu(uuid="GPU-c", name="A", nvml_index=None, pci_bus_id="00000000:01:00.0")
    d = Gpu(uuid="GPU-d", name="A", nvml_index=1, pci_bus_id="00000000:01:00.0")
    ordered, _ = cuda_enumeration([a, b, d, c], "PCI_BUS_ID")
    assert [g.uuid for g in ordered] == ["GPU-b", "GPU-c", "GPU-d", "GPU-a"]
    early = Gpu(uuid="GPU-e", name="A", nvml_index=3, pci_bus_id="00000000:00:00.0")
    ordered, _ = cuda_enumeration([a, early], "PCI_BUS_ID")
    assert [g.uuid for g in ordered] == ["GPU-e", "GPU-a"]


def test_mixed_models_get_the_order_note_in_full_unless_pci_order_is_set() -> None:
    a = Gpu(uuid="GPU-a", name="RTX 4090", nvml_index=0, pci_bus_id="00000000:01:00.0")
    b = Gpu(uuid="GPU-b", name="RTX 3060", nvml_index=1, pci_bus_id="00000000:02:00.0")
    _, notes = cuda_enumeration([a, b], None)
    assert notes == [
        "CUDA_DEVICE_ORDER is FASTEST_FIRST (CUDA's default) and the GPUs are different models, so "
        "CUDA may number them differently from PCI bus order; the indices shown assume PCI order. "
        "Set CUDA_DEVICE_ORDER=PCI_BUS_ID to make them exact."
    ]
    assert cuda_enumeration([a, b], "pci_bus_id")[1] == []


def test_an_ambiguous_prefix_and_a_repeated_gpu_are_explained() -> None:
    physical = [board(0), board(1)]
    _, notes = apply_visible_devices(physical, "GPU-000", "PCI_BUS_ID")
    assert notes == [
        "CUDA_VISIBLE_DEVICES entry 'GPU-000' matches more than one GPU; CUDA stops at the first "
        "invalid entry, so 'GPU-000' is ignored."
    ]
    visible, notes = apply_visible_devices(physical, "1,1", "PCI_BUS_ID")
    assert visible == [] and notes == [
        "CUDA_VISIBLE_DEVICES names '1' twice; CUDA then shows no GPU at all."
    ]
