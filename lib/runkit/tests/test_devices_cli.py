"""``python -m runkit.devices``: listing, JSON, --watch, the no-GPU line, agreement with CUDA."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace
from unittest.mock import Mock

import pytest
from rich.console import Console

import prewarmed
from runkit.gpus import inventory, listing, nvml
from runkit.gpus.inventory import (
    Gpu,
    GpuProcess,
    Inventory,
    TorchCuda,
    apply_visible_devices,
    build_inventory,
    collect_inventory,
    read_nvml,
)
from runkit.gpus.listing import main
from runkit.testing.fake_nvml import GIB, FakeClock, FakeGpu, FakeNvml, FakeProcess

UUID0 = "GPU-aaaa1111-1111-1111-1111-111111111111"
UUID1 = "GPU-bbbb2222-2222-2222-2222-222222222222"
UUID2 = "GPU-cccc3333-3333-3333-3333-333333333333"

JSON_KEYS = {
    "schema_version", "cuda_available", "device_count", "training_device", "message", "nvml",
    "cuda_visible_devices", "cuda_device_order", "index_mapping", "gpus", "hidden_gpus", "notes",
}  # fmt: skip
GPU_KEYS = {
    "index", "nvml_index", "name", "uuid", "mig", "parent_uuid", "memory_used_mib",
    "memory_total_mib", "memory_free_mib", "utilization_percent", "temperature_c", "power_w",
    "power_limit_w", "processes",
}  # fmt: skip


@pytest.fixture
def machine(monkeypatch, use_fake):
    """The fake NVML in-process, torch pretending to see the GPUs CUDA_VISIBLE_DEVICES leaves."""
    gpus = [FakeGpu(uuid=UUID0, memory_used=10 * GIB, processes=[FakeProcess(4242, 3 * GIB)]),
            FakeGpu(uuid=UUID1), FakeGpu(uuid=UUID2, util_gpu=37)]  # fmt: skip
    lib = use_fake(FakeNvml(gpus, clock=lambda: 0.0))
    monkeypatch.setenv("COLUMNS", "250")  # keep Rich from folding UUIDs in the captured table
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setattr(inventory, "probe_torch", lambda uuids=True: TorchCuda(True, 2))
    return lib


def test_json_output_has_the_documented_keys_and_indices(machine, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert main(["--json"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == ["{", '  "schema_version": 1,']  # indented for people too
    doc = json.loads(out)
    assert set(doc) == JSON_KEYS and doc["schema_version"] == 1
    assert (doc["cuda_available"], doc["device_count"], doc["training_device"]) == (True, 2, "cuda")
    assert doc["index_mapping"] == "env-rules" and doc["cuda_visible_devices"] == "2,0"
    assert [(g["index"], g["nvml_index"], g["uuid"]) for g in doc["gpus"]] == [(0, 2, UUID2), (1, 0, UUID0)]  # fmt: skip
    assert all(set(g) == GPU_KEYS for g in doc["gpus"] + doc["hidden_gpus"])
    assert doc["gpus"][0]["utilization_percent"] == 37
    assert doc["gpus"][1]["memory_used_mib"] == 10240
    assert doc["gpus"][1]["processes"] == [{"pid": 4242, "used_memory_mib": 3072, "name": None}]
    assert [(g["index"], g["uuid"]) for g in doc["hidden_gpus"]] == [(None, UUID1)]
    assert doc["nvml"] == {"available": True, "reason": None, "driver_version": "570.133.20"}
    assert doc["message"] == "2 CUDA GPUs visible; training can use cuda:0..cuda:1."
    assert machine.balanced
    monkeypatch.setattr(inventory, "probe_torch", lambda uuids=True: TorchCuda())
    assert main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["training_device"] == "cpu"


def listing_text(inv: Inventory, width: int = 160) -> list[str]:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    listing.render(inv, console)
    return [line.rstrip() for line in console.export_text().splitlines()]


# fmt: off
def listed_machine() -> Inventory:
    mig = Gpu("MIG-beef", "A100 slice", nvml_index=1, parent_uuid="GPU-0001", mig_index=3,
              memory_total_mib=10240, processes=(GpuProcess(7, None, "python"),))
    a100 = Gpu("GPU-0001", "A100", nvml_index=1, mig_enabled=True, mig_devices=(mig,))
    h100 = Gpu("GPU-0000", "H100", nvml_index=0, memory_total_mib=81920, memory_used_mib=1024,
               utilization_percent=37, temperature_c=41, power_w=71.5, power_limit_w=700.0,
               processes=(GpuProcess(4242, 3072, "train.py"), GpuProcess(99, 5, None)))
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    hidden = Gpu("GPU-0002", "L4", nvml_index=2, power_w=20.0)
    torch_info = TorchCuda(True, 2, version="12.4")
    return build_inventory([h100, a100, hidden], torch_info, env=env, driver_version="570.1")
# fmt: on


def test_the_human_listing_shows_every_figure_as_the_user_reads_it():
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
    noted = build_inventory(
        [Gpu(uuid="GPU-0", name="H100")], TorchCuda(True, 1), env={"CUDA_DEVICE_ORDER": "x"}
    )
    assert listing_text(noted)[-1] == (  # notes come last
        "note: CUDA_DEVICE_ORDER='X' is not one of FASTEST_FIRST, PCI_BUS_ID; CUDA uses FASTEST_FIRST."
    )
    console = Console(file=io.StringIO(), width=200, force_terminal=True, color_system="standard")
    listing.render(listed_machine(), console)  # plain text, not colour-highlighted
    assert console.file.getvalue().splitlines()[0] == listing_text(listed_machine())[0]


@pytest.mark.parametrize(
    ("physical", "torch_info", "cuda", "mapping"),
    [
        ([Gpu(uuid="GPU-0", name="H100")], TorchCuda(False, 0),
         "no (training will use the CPU)", "cuda:N worked out by CUDA's CUDA_VISIBLE_DEVICES/CUDA_DEVICE_ORDER rules"),
        (None, TorchCuda(True, 1, uuids=("u",), names=("L4",)),
         "yes (1 device(s))", "names from torch; NVML unavailable, so no metrics"),
        ([Gpu(uuid="GPU-0", name="H100")], TorchCuda(True, 1, uuids=("0",)),
         "yes (1 device(s))", "cuda:N matched to NVML by UUID (torch)"),
    ],
)  # fmt: skip
def test_the_listing_header_says_where_training_runs_and_how_cuda_n_was_found(
    physical, torch_info, cuda, mapping
):
    lines = listing_text(build_inventory(physical, torch_info, env={}))
    assert lines[0] == f"CUDA available: {cuda}"
    assert lines[1] == (
        "NVML driver ?; CUDA_VISIBLE_DEVICES=(unset); CUDA_DEVICE_ORDER=FASTEST_FIRST; " + mapping
    )


def test_a_narrow_terminal_folds_long_values_and_shows_unknowns_as_dashes():
    long_uuid = "GPU-" + "0123456789abcdef" * 4
    inv = build_inventory(None, TorchCuda(True, 1, uuids=(long_uuid,), names=("L4",)), env={})
    lines = listing_text(inv, width=70)
    assert not any("…" in line for line in lines)  # folded onto more lines, never cut
    rows = [line.split("│") for line in lines if line.count("│") > 8]
    assert "".join(cells[4].strip() for cells in rows) == long_uuid
    cells = [cell.strip() for cell in rows[0][1:-1]]
    assert cells[1] == "-" and cells[4] == "-" and cells[8] == "-"  # nvml index, memory, processes


@pytest.mark.parametrize(
    ("fake", "cvd", "reason"),
    [
        (FakeNvml(2, init_error="library_not_found"), None, "NVML is not available (NVML Shared Library Not Found)"),
        (FakeNvml(0), None, "no NVIDIA GPU found"),
        (FakeNvml(2), "", "CUDA_VISIBLE_DEVICES is set to an empty string"),
    ],
)  # fmt: skip
def test_no_usable_gpu_is_one_line_and_exit_zero(monkeypatch, capsys, use_fake, fake, cvd, reason):
    use_fake(fake)
    monkeypatch.setenv("COLUMNS", "40")  # the line must not be wrapped even on a narrow terminal
    monkeypatch.setattr(inventory, "probe_torch", lambda uuids=True: TorchCuda())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if cvd is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
    assert main([]) == 0
    assert capsys.readouterr().out == f"No usable GPU: {reason}; training will use the CPU.\n"


def test_the_help_names_the_command_and_its_options_and_bad_seconds_are_one_line(
    capsys, monkeypatch
):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: python -m runkit.devices [-h] [--json] [--watch [SECONDS]]")
    assert "List the GPUs this process may use (as cuda:N), their load and processes." in out
    assert "--json print JSON for scripts" in out
    assert "--watch [SECONDS] refresh every SECONDS (default 2) until Ctrl-C; with --json, one JSON document per line" in out  # fmt: skip
    asked: list[tuple[float, bool]] = []
    monkeypatch.setattr(listing, "watch", lambda seconds, as_json: asked.append((seconds, as_json)) or 0)  # fmt: skip
    assert main(["--watch"]) == main(["--json", "--watch", "0.5"]) == 0
    assert asked == [(2.0, False), (0.5, True)]
    for value in ["0", "-1", "abc", "nan", "inf", "0.05"]:
        with pytest.raises(SystemExit) as info:
            main(["--watch", value])
        assert info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"python -m runkit.devices: error: argument --watch: SECONDS={value!r} is invalid; "
            "expected a number of seconds >= 0.1"
        )


def test_module_import_stays_light():
    code = (
        "import sys, runkit.devices, runkit.gpus.resolve; "
        "print(sorted({'torch', 'lightning', 'rich'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------- --watch
@pytest.fixture
def refreshes(monkeypatch, use_fake):
    """GPU 0: 10 % then 90 % busy from t=1 s; torch probes counted; the third sleep is Ctrl-C."""
    clock = FakeClock()
    busy = FakeGpu(uuid=UUID0, util_gpu=[(0, 10), (1, 90)], processes=[FakeProcess(4242, 3 * GIB)])
    fake = use_fake(FakeNvml([busy, FakeGpu(uuid=UUID1)], clock=clock))
    probes: list[bool] = []
    probe = lambda uuids=True: probes.append(uuids) or TorchCuda(True, 2)  # noqa: E731
    monkeypatch.setattr(listing, "probe_torch", probe)
    monkeypatch.setattr(inventory, "probe_torch", probe)
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt
        clock.advance(seconds)

    monkeypatch.setattr(listing, "time", SimpleNamespace(sleep=sleep, time=time.time, strftime=time.strftime))  # fmt: skip
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return SimpleNamespace(fake=fake, probes=probes, sleeps=sleeps)


def test_json_watch_prints_one_document_per_refresh_and_ctrl_c_exits_zero(refreshes, capsys):
    assert main(["--json", "--watch", "1.5"]) == 0
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(docs) == 3 and refreshes.sleeps == [1.5, 1.5, 1.5]
    assert all(set(d) == JSON_KEYS | {"time"} for d in docs)
    assert all(set(g) == GPU_KEYS for d in docs for g in d["gpus"])
    assert [d["gpus"][0]["utilization_percent"] for d in docs] == [10, 90, 90]
    assert docs[0]["gpus"][0]["processes"] == [{"pid": 4242, "used_memory_mib": 3072, "name": None}]
    # NVML once per refresh, torch once in all
    assert refreshes.fake.calls["nvmlInit"] == 3 and refreshes.probes == [True]
    assert refreshes.fake.balanced


def test_ctrl_c_while_torch_is_asked_ends_the_watch_quietly(monkeypatch, capsys):
    monkeypatch.setattr(listing, "probe_torch", Mock(side_effect=KeyboardInterrupt))
    for as_json in (True, False):
        assert listing.watch(1.0, as_json=as_json) == 0 and capsys.readouterr().out == ""


def test_the_table_is_redrawn_in_place_on_a_terminal(refreshes):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=220, color_system=None)
    assert listing.watch(2.0, as_json=False, console=console) == 0
    text = out.getvalue()
    assert "\x1b[2K" in text and "\x1b[1A" in text  # Rich Live erases and rewrites its lines
    assert text.count("every 2 s; Ctrl-C to quit") == 4  # 3 refreshes; the last stays at exit
    assert "│ cuda:0 │ 0" in text and "4242 (3072 MiB)" in text
    assert "10%" in text and "90%" in text
    assert refreshes.fake.calls["nvmlInit"] == 3 and refreshes.probes == [True]


# ------------------------------------------------------------------------- real GPU
def _cuda_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False")
    return torch


@pytest.mark.gpu
def test_listing_matches_torch_on_a_real_gpu():
    torch = _cuda_or_skip()
    inv = collect_inventory()
    assert inv.nvml_available, inv.nvml_reason
    assert inv.mapping == "torch-uuid"
    assert inv.usable_gpu_count == torch.cuda.device_count() == len(inv.visible)
    for i, gpu in enumerate(inv.visible):
        props = torch.cuda.get_device_properties(i)
        assert gpu.name == props.name
        assert nvml.bare_uuid(gpu.uuid) == nvml.bare_uuid(str(props.uuid))
        assert gpu.memory_total_mib is not None
        assert abs(gpu.memory_total_mib * 2**20 - props.total_memory) < 0.05 * props.total_memory
    # Without torch's UUIDs, CUDA's rules applied to NVML give the same cuda:N order.
    by_rules = build_inventory(list(inv.physical), TorchCuda(True, len(inv.visible)))
    if not any("FASTEST_FIRST" in note for note in by_rules.notes):
        assert [g.uuid for g in by_rules.visible] == [g.uuid for g in inv.visible]


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_visible_devices_rules_match_real_cuda():
    _cuda_or_skip()
    physical, _, _ = read_nvml()
    if any(g.mig_enabled for g in physical):
        pytest.skip("MIG mode: CUDA's MIG enumeration differs between driver releases")
    first = physical[0].uuid
    n = len(physical)
    values = ["0", "", "-1", "0,-1", f"{n}", f"{n},0", "0,0", "0x", first, first[:12], "GPU-zz"]
    if n > 1:
        values += ["1,0", f"1,{first[:12]}", f"0,{n},1"]
    code = "import torch; print(torch.cuda.device_count())"
    for value in values:
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
        env.update(CUDA_VISIBLE_DEVICES=value, CUDA_DEVICE_ORDER="PCI_BUS_ID")
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        predicted, _ = apply_visible_devices(physical, value, "PCI_BUS_ID")
        assert int(out.stdout.strip()) == len(predicted), f"CUDA_VISIBLE_DEVICES={value!r}"


@pytest.mark.gpu
@pytest.mark.slow
def test_cli_json_on_a_real_gpu_names_the_gpu_torch_sees():
    torch = _cuda_or_skip()
    env = {k: v for k, v in os.environ.items() if k not in ("RUNKIT_NVML_BACKEND",)}
    env["CUDA_VISIBLE_DEVICES"] = str(torch.cuda.device_count() - 1)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    command = [sys.executable, "-m", "runkit.devices", "--json"]
    result = prewarmed.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["device_count"] == 1 and doc["index_mapping"] == "torch-uuid"
    physical, _, _ = read_nvml()
    assert doc["gpus"][0]["uuid"] == physical[-1].uuid
